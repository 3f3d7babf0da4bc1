// Host entries of the glue family: check every argument, fill the params, dispatch.
#include "common/torch_glue.h"
#include "glue/glue_launch.h"
#include "ops.h"

namespace clef {
namespace {

void check_like(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name) {
  check_dtype(t, ref.scalar_type(), op, name);
  check_device(t, ref, op, name);
}

void check_fp32_vector(const at::Tensor& t, int64_t n, const at::Tensor& ref, const char* op, const char* name) {
  check_shape(t, {n}, op, name);
  check_dtype(t, at::kFloat, op, name);
  check_contiguous(t, op, name);
  check_device(t, ref, op, name);
}

}  // namespace

void add_rms_norm(at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& scale, double eps,
                  at::Tensor& out) {
  const char* op = "add_rms_norm";
  check_dim(x, 2, op, "x", "[rows, cols]");
  check_dtype(x, at::kFloat, op, "x");
  check_contiguous(x, op, "x");
  const ScalarKind kind = activation_kind(out, op, "out");
  check_shape(out, x.sizes(), op, "out");
  check_contiguous(out, op, "out");
  check_device(out, x, op, "out");
  if (delta.has_value()) {
    check_shape(*delta, x.sizes(), op, "delta");
    check_like(*delta, out, op, "delta");
    check_contiguous(*delta, op, "delta");
  }
  check_fp32_vector(scale, x.size(1), x, op, "scale");
  // x is the residual stream it updates: out may replace delta (each thread reads its delta element
  // before writing the same out element), never x.
  check_no_overlap(out, x, op, "out", "x", false);
  if (delta.has_value()) {
    check_no_overlap(out, *delta, op, "out", "delta", true);
    check_no_overlap(x, *delta, op, "x", "delta", false);
  }
  check_no_overlap(out, scale, op, "out", "scale", false);
  AddRmsNormParams p;
  p.x = x.data_ptr<float>();
  p.delta = delta.has_value() ? delta->data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.scale = scale.data_ptr<float>();
  p.rows = x.size(0);
  p.cols = checked_int32(x.size(1), op, "cols");
  p.eps = static_cast<float>(eps);
  run_on_device(x, op, [&](void* s) { return add_rms_norm_cuda(p, kind, s); }, [&] { add_rms_norm_cpu(p, kind); });
}

void silu_mul(const at::Tensor& gate_up, at::Tensor& out) {
  const char* op = "silu_mul";
  check_dim(gate_up, 2, op, "gate_up", "[rows, 2 * cols]");
  const ScalarKind kind = activation_kind(gate_up, op, "gate_up");
  check_contiguous(gate_up, op, "gate_up");
  TORCH_CHECK_VALUE(gate_up.size(1) % 2 == 0, op, ": gate_up's width must be even (gate | up), got ", gate_up.size(1));
  check_shape(out, {gate_up.size(0), gate_up.size(1) / 2}, op, "out");
  check_like(out, gate_up, op, "out");
  check_contiguous(out, op, "out");
  // Element (r, c) of out sits where other threads read gate_up's rows: no overlap at all.
  check_no_overlap(out, gate_up, op, "out", "gate_up", false);
  SiluMulParams p;
  p.gate_up = gate_up.data_ptr();
  p.out = out.data_ptr();
  p.rows = gate_up.size(0);
  p.cols = checked_int32(gate_up.size(1) / 2, op, "cols");
  run_on_device(gate_up, op, [&](void* s) { return silu_mul_cuda(p, kind, s); }, [&] { silu_mul_cpu(p, kind); });
}

void gated_rms_norm(const at::Tensor& core, const at::Tensor& z, const at::Tensor& weight, double eps, at::Tensor& out) {
  const char* op = "gated_rms_norm";
  check_dim(core, 3, op, "core", "[tokens, heads, dim]");
  const ScalarKind kind = activation_kind(core, op, "core");
  check_contiguous(core, op, "core");
  const int64_t tokens = core.size(0), heads = core.size(1), dim = core.size(2);
  check_dim(z, 2, op, "z", "[tokens, heads * dim]");
  check_shape(z, {tokens, heads * dim}, op, "z");
  check_like(z, core, op, "z");
  check_last_dim_contiguous(z, op, "z");
  check_fp32_vector(weight, dim, core, op, "weight");
  check_shape(out, {tokens, heads * dim}, op, "out");
  check_like(out, core, op, "out");
  check_contiguous(out, op, "out");
  // Each lane reads its core and z elements before writing the same out element: out may be core (or z)
  // itself, but not overlap either otherwise.
  check_no_overlap(out, core.view({tokens, heads * dim}), op, "out", "core", true);
  check_no_overlap(out, z, op, "out", "z", true);
  check_no_overlap(out, weight, op, "out", "weight", false);
  GatedRmsNormParams p;
  p.core = core.data_ptr();
  p.z = z.data_ptr();
  p.z_token_stride = z.stride(0);
  p.out = out.data_ptr();
  p.weight = weight.data_ptr<float>();
  p.tokens = tokens;
  p.heads = checked_int32(heads, op, "heads");
  p.dim = checked_int32(dim, op, "dim");
  p.eps = static_cast<float>(eps);
  run_on_device(core, op, [&](void* s) { return gated_rms_norm_cuda(p, kind, s); }, [&] { gated_rms_norm_cpu(p, kind); });
}

void rms_norm_rope(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& cos, const at::Tensor& sin,
                   double eps, at::Tensor& out) {
  const char* op = "rms_norm_rope";
  check_dim(x, 3, op, "x", "[tokens, heads, dim]");
  const ScalarKind kind = activation_kind(x, op, "x");
  check_last_dim_contiguous(x, op, "x");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK_VALUE(dim <= 1024, op, ": head dims up to 1024 are supported, got ", dim);
  check_fp32_vector(scale, dim, x, op, "scale");
  check_dim(cos, 2, op, "cos", "[tokens, rotary_dim / 2]");
  const int64_t half = cos.size(1);
  TORCH_CHECK_VALUE(2 * half <= dim, op, ": rotary_dim (", 2 * half, ") exceeds head_dim (", dim, ")");
  check_shape(cos, {tokens, half}, op, "cos");
  check_shape(sin, {tokens, half}, op, "sin");
  for (const auto& [t, name] : {std::pair{cos, "cos"}, std::pair{sin, "sin"}}) {
    check_dtype(t, at::kFloat, op, name);
    check_contiguous(t, op, name);
    check_device(t, x, op, name);
  }
  check_shape(out, x.sizes(), op, "out");
  check_like(out, x, op, "out");
  check_contiguous(out, op, "out");
  // A row's rotation partners are read before any of it is written (glue_kernels.cuh): out may be x itself.
  check_no_overlap(out, x, op, "out", "x", true);
  for (const auto& [t, name] : {std::pair{scale, "scale"}, std::pair{cos, "cos"}, std::pair{sin, "sin"}})
    check_no_overlap(out, t, op, "out", name, false);
  RmsNormRopeParams p;
  p.x = x.data_ptr();
  p.x_token_stride = x.stride(0);
  p.x_head_stride = x.stride(1);
  p.out = out.data_ptr();
  p.scale = scale.data_ptr<float>();
  p.cos = cos.data_ptr<float>();
  p.sin = sin.data_ptr<float>();
  p.tokens = tokens;
  p.heads = checked_int32(heads, op, "heads");
  p.dim = checked_int32(dim, op, "dim");
  p.rotary_half = checked_int32(half, op, "rotary_dim / 2");
  p.eps = static_cast<float>(eps);
  run_on_device(x, op, [&](void* s) { return rms_norm_rope_cuda(p, kind, s); }, [&] { rms_norm_rope_cpu(p, kind); });
}

void sigmoid_gate(const at::Tensor& attn, const at::Tensor& gate, at::Tensor& out) {
  const char* op = "sigmoid_gate";
  check_dim(attn, 3, op, "attn", "[tokens, heads, dim]");
  const ScalarKind kind = activation_kind(attn, op, "attn");
  check_contiguous(attn, op, "attn");
  check_shape(gate, attn.sizes(), op, "gate");
  check_like(gate, attn, op, "gate");
  check_last_dim_contiguous(gate, op, "gate");
  check_shape(out, {attn.size(0), attn.size(1) * attn.size(2)}, op, "out");
  check_like(out, attn, op, "out");
  check_contiguous(out, op, "out");
  // Element e of out is written by the thread that reads element e of attn: out may be attn itself; the
  // gate is read at other strides, so it must not overlap out.
  check_no_overlap(out, attn.view({attn.size(0), attn.size(1) * attn.size(2)}), op, "out", "attn", true);
  check_no_overlap(out, gate, op, "out", "gate", false);
  SigmoidGateParams p;
  p.attn = attn.data_ptr();
  p.gate = gate.data_ptr();
  p.gate_token_stride = gate.stride(0);
  p.gate_head_stride = gate.stride(1);
  p.out = out.data_ptr();
  p.tokens = attn.size(0);
  p.heads = checked_int32(attn.size(1), op, "heads");
  p.dim = checked_int32(attn.size(2), op, "dim");
  run_on_device(attn, op, [&](void* s) { return sigmoid_gate_cuda(p, kind, s); }, [&] { sigmoid_gate_cpu(p, kind); });
}

}  // namespace clef
