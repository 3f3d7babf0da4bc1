// Host entries of the gated delta rule family: check every argument, fill the params, dispatch.
#include <ATen/ops/empty.h>

#include <algorithm>
#include <string>

#include "common/torch_glue.h"
#include "gated_delta_rule/gated_delta_rule_launch.h"
#include "ops.h"

namespace clef {
namespace {

GatedDeltaRuleParams gdr_params(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& g, const at::Tensor& beta, at::Tensor& states,
                                const at::Tensor& state_indices, double scale, bool use_qk_l2norm, at::Tensor& out) {
  check_dim(q, 3, op, "q", "[num_tokens, num_k_heads, head_k_dim]");
  check_dim(k, 3, op, "k", "[num_tokens, num_k_heads, head_k_dim]");
  check_dim(v, 3, op, "v", "[num_tokens, num_v_heads, head_v_dim]");
  activation_kind(q, op, "q");
  check_shape(k, q.sizes(), op, "k");
  check_dtype(k, q.scalar_type(), op, "k");
  check_dtype(v, q.scalar_type(), op, "v");
  check_device(k, q, op, "k");
  check_device(v, q, op, "v");
  const int64_t num_tokens = q.size(0), num_k_heads = q.size(1), head_k_dim = q.size(2);
  const int64_t num_v_heads = v.size(1), head_v_dim = v.size(2);
  TORCH_CHECK_VALUE(v.size(0) == num_tokens, op, ": v has ", v.size(0), " tokens but q has ", num_tokens);
  TORCH_CHECK_VALUE(num_k_heads > 0 && num_v_heads % num_k_heads == 0, op, ": num_v_heads (", num_v_heads,
                    ") must be a multiple of num_k_heads (", num_k_heads, ")");
  TORCH_CHECK_VALUE(head_k_dim > 0 && head_v_dim > 0, op, ": head dims must be positive");
  check_last_dim_contiguous(q, op, "q");
  check_last_dim_contiguous(k, op, "k");
  check_last_dim_contiguous(v, op, "v");
  check_shape(g, {num_tokens, num_v_heads}, op, "g");
  check_dtype(g, at::kFloat, op, "g");
  check_contiguous(g, op, "g");
  check_device(g, q, op, "g");
  check_shape(beta, {num_tokens, num_v_heads}, op, "beta");
  check_dtype(beta, at::kFloat, op, "beta");
  check_contiguous(beta, op, "beta");
  check_device(beta, q, op, "beta");
  check_dim(states, 4, op, "states", "[num_slots, num_v_heads, head_k_dim, head_v_dim]");
  check_shape(states, {states.size(0), num_v_heads, head_k_dim, head_v_dim}, op, "states");
  check_dtype(states, at::kFloat, op, "states");
  check_contiguous(states, op, "states");
  check_device(states, q, op, "states");
  check_dim(state_indices, 1, op, "state_indices", "[batch]");
  check_dtype(state_indices, at::kInt, op, "state_indices");
  check_contiguous(state_indices, op, "state_indices");
  check_device(state_indices, q, op, "state_indices");
  check_shape(out, {num_tokens, num_v_heads, head_v_dim}, op, "out");
  check_dtype(out, q.scalar_type(), op, "out");
  check_contiguous(out, op, "out");
  check_device(out, q, op, "out");
  check_state_indices_values(state_indices, states.size(0), op);
  if (q.is_cuda() && cuda_build())
    TORCH_CHECK_VALUE(gated_delta_rule_cuda_supports(static_cast<int>(head_k_dim), static_cast<int>(head_v_dim)), op,
                      ": the CUDA kernels are compiled for head_k_dim == head_v_dim in {16, 32, 64, 128}, got ",
                      head_k_dim, " and ", head_v_dim);

  GatedDeltaRuleParams p;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_token_stride = q.stride(0);
  p.q_head_stride = q.stride(1);
  p.k_token_stride = k.stride(0);
  p.k_head_stride = k.stride(1);
  p.v_token_stride = v.stride(0);
  p.v_head_stride = v.stride(1);
  p.g = g.data_ptr<float>();
  p.beta = beta.data_ptr<float>();
  p.states = states.data_ptr<float>();
  p.out = out.data_ptr();
  p.state_indices = state_indices.data_ptr<int32_t>();
  p.num_tokens = num_tokens;
  p.batch = checked_int32(state_indices.size(0), op, "batch");
  p.num_k_heads = checked_int32(num_k_heads, op, "num_k_heads");
  p.num_v_heads = checked_int32(num_v_heads, op, "num_v_heads");
  p.head_k_dim = checked_int32(head_k_dim, op, "head_k_dim");
  p.head_v_dim = checked_int32(head_v_dim, op, "head_v_dim");
  p.num_slots = checked_int32(states.size(0), op, "num_slots");
  p.scale = static_cast<float>(scale);
  p.l2norm_qk = use_qk_l2norm;
  return p;
}

void run_gdr(const char* op, const GatedDeltaRuleParams& p, const at::Tensor& q) {
  const ScalarKind kind = activation_kind(q, op, "q");
  run_on_device(
      q, op, [&](void* stream) { return gated_delta_rule_cuda(p, kind, stream); },
      [&] { gated_delta_rule_cpu(p, kind); });
}

// "auto", "serial", "chunked", or "chunked:<variant>" with a state-pass variant forced: "s16", "s32", "s64"
// (staged), "d64", "d128" (direct; gdr_state_variants says which a head dim has).
void parse_gdr_kernel(c10::string_view kernel, const char* op, GatedDeltaRuleParams& p) {
  const std::string name(kernel);
  p.state_request = GdrStateVariant{0, true};
  if (name == "auto") {
    p.kernel = GdrKernel::Auto;
  } else if (name == "serial") {
    p.kernel = GdrKernel::Serial;
  } else if (name == "chunked") {
    p.kernel = GdrKernel::Chunked;
  } else if (name.rfind("chunked:", 0) == 0 && name.size() > 9 && (name[8] == 's' || name[8] == 'd') &&
             name.find_first_not_of("0123456789", 9) == std::string::npos && name.size() <= 12) {
    p.kernel = GdrKernel::Chunked;
    p.state_request = GdrStateVariant{std::stoi(name.substr(9)), name[8] == 's'};
  } else {
    TORCH_CHECK_VALUE(false, op, ": kernel must be 'auto', 'serial' or 'chunked' (or 'chunked:s32' and the like, ",
                      "a state-pass variant), got '", name, "'");
  }
}

std::string gdr_kernel_name(GdrKernel kernel) {
  switch (kernel) {
    case GdrKernel::Auto: return "auto";
    case GdrKernel::Serial: return "serial";
    case GdrKernel::Chunked: return "chunked";
  }
  return "?";
}

// "s32", "d128": a state-pass variant's name (the kernel strings' suffix).
std::string gdr_variant_name(GdrStateVariant v) { return (v.staged ? "s" : "d") + std::to_string(v.columns); }

// The kernel the CUDA launcher will run for p on q's device; a forced one that cannot run p raises ValueError
// saying why (before any launch).
GdrChoice checked_cuda_choice(const GatedDeltaRuleParams& p, const at::Tensor& q, const char* op) {
#if defined(CLEF_WITH_CUDA) || defined(CLEF_CUDA_SIM)
#ifdef CLEF_WITH_CUDA
  c10::cuda::CUDAGuard guard(q.device());
#endif
  const GdrChoice choice = gated_delta_rule_cuda_choice(p, activation_kind(q, op, "q"));
  TORCH_CHECK_VALUE(choice.error == nullptr, op, ": kernel='", gdr_kernel_name(choice.kernel),
                    p.state_request.columns != 0 ? ":" + gdr_variant_name(p.state_request) : std::string(),
                    "' cannot run these arguments: ", choice.error);
  return choice;
#else
  (void)p;
  TORCH_CHECK(false, op, ": clef_cuda._C was built without CUDA kernels, so ", q.device(),
              " tensors cannot run; rebuild it with a CUDA toolchain (README)");
  return GdrChoice{GdrKernel::Serial, nullptr};  // not reached
#endif
}

}  // namespace

void gated_delta_rule_chunk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, at::Tensor& states, const at::Tensor& cu_seqlens,
                            const at::Tensor& state_indices, const at::Tensor& has_initial_state, double scale,
                            bool use_qk_l2norm, at::Tensor& out, c10::string_view kernel) {
  const char* op = "gated_delta_rule_chunk";
  GatedDeltaRuleParams p = gdr_params(op, q, k, v, g, beta, states, state_indices, scale, use_qk_l2norm, out);
  check_pack(cu_seqlens, has_initial_state, state_indices.size(0), q.size(0), q, op);
  p.cu_seqlens = cu_seqlens.data_ptr<int32_t>();
  p.has_initial_state = has_initial_state.data_ptr<bool>();
  parse_gdr_kernel(kernel, op, p);
  TORCH_CHECK_VALUE(p.kernel == GdrKernel::Auto || runs_cuda_launcher(q), op, ": kernel='", std::string(kernel),
                    "' picks a CUDA kernel, but ", q.device(), " tensors run the CPU implementation (pass kernel='auto')");
  // The chunked kernel's workspace, allocated here so the launcher stays torch-free. Freed when this returns:
  // the caching allocator hands it out again only to work queued after the kernels on this stream.
  at::Tensor workspace;
  if (runs_cuda_launcher(q) && p.batch > 0 && p.num_v_heads > 0) {
    const GdrChoice choice = checked_cuda_choice(p, q, op);
    if (choice.kernel == GdrKernel::Chunked) {
      workspace = at::empty({choice.workspace_bytes}, q.options().dtype(at::kByte));
      p.workspace = workspace.data_ptr();
      p.workspace_bytes = choice.workspace_bytes;
      p.state = choice.state;
      p.output_columns = choice.output_columns;
    }
  }
  run_gdr(op, p, q);
}

namespace {
// The CUDA launcher's choice for a pack of these tensors ("cpu" when they run the CPU implementation).
std::string gdr_dispatch(const at::Tensor& q, const at::Tensor& v, const at::Tensor& cu_seqlens,
                         c10::string_view kernel, const char* op, bool variant) {
  check_dim(q, 3, op, "q", "[num_tokens, num_k_heads, head_k_dim]");
  check_dim(v, 3, op, "v", "[num_tokens, num_v_heads, head_v_dim]");
  check_dim(cu_seqlens, 1, op, "cu_seqlens", "[batch + 1]");
  check_dtype(cu_seqlens, at::kInt, op, "cu_seqlens");
  activation_kind(q, op, "q");
  GatedDeltaRuleParams p;
  p.num_tokens = q.size(0);
  p.batch = checked_int32(std::max<int64_t>(cu_seqlens.size(0) - 1, 0), op, "batch");
  p.num_k_heads = checked_int32(q.size(1), op, "num_k_heads");
  p.num_v_heads = checked_int32(v.size(1), op, "num_v_heads");
  p.head_k_dim = checked_int32(q.size(2), op, "head_k_dim");
  p.head_v_dim = checked_int32(v.size(2), op, "head_v_dim");
  p.cu_seqlens = cu_seqlens.data_ptr<int32_t>();  // the rule asks only whether there is one, never reads it
  parse_gdr_kernel(kernel, op, p);
  if (!runs_cuda_launcher(q)) {
    TORCH_CHECK_VALUE(p.kernel == GdrKernel::Auto, op, ": kernel='", std::string(kernel), "' picks a CUDA kernel, but ",
                      q.device(), " tensors run the CPU implementation");
    return "cpu";
  }
  const GdrChoice choice = checked_cuda_choice(p, q, op);
  std::string name = gdr_kernel_name(choice.kernel);
  if (variant && choice.kernel == GdrKernel::Chunked) name += ":" + gdr_variant_name(choice.state);
  return name;
}
}  // namespace

std::string gated_delta_rule_dispatch(const at::Tensor& q, const at::Tensor& v, const at::Tensor& cu_seqlens,
                                      c10::string_view kernel) {
  return gdr_dispatch(q, v, cu_seqlens, kernel, "gated_delta_rule_dispatch", false);
}

std::string gated_delta_rule_variant(const at::Tensor& q, const at::Tensor& v, const at::Tensor& cu_seqlens,
                                     c10::string_view kernel) {
  return gdr_dispatch(q, v, cu_seqlens, kernel, "gated_delta_rule_variant", true);
}

void gated_delta_rule_recurrent(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                const at::Tensor& beta, at::Tensor& states, const at::Tensor& state_indices,
                                double scale, bool use_qk_l2norm, at::Tensor& out) {
  const char* op = "gated_delta_rule_recurrent";
  GatedDeltaRuleParams p = gdr_params(op, q, k, v, g, beta, states, state_indices, scale, use_qk_l2norm, out);
  check_shape(state_indices, {q.size(0)}, op, "state_indices");
  run_gdr(op, p, q);
}

}  // namespace clef
