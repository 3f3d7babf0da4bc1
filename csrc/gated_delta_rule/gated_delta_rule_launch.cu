// Host-side launchers for the gated delta rule kernels. Torch-free on purpose.
#include "common/device_launch.cuh"
#include "gated_delta_rule/gated_delta_rule_kernels.cuh"
#include "gated_delta_rule/gated_delta_rule_launch.h"

namespace clef {

template <typename T, int D>
static const char* launch_serial(const GatedDeltaRuleParams& p, cudaStream_t stream) {
  if (p.batch > kMaxGridYZ) return "gated delta rule: more sequences in one call than a grid's 65,535 (grid.z)";
  const dim3 grid(D / GdrTiling<D>::kColumns, p.num_v_heads, p.batch);
  auto* kernel = &gated_delta_rule_kernel<T, D, D>;
  CLEF_LAUNCH(kernel, grid, kGdrThreads, 0, stream)(p);
  return launch_error();
}

// The state pass in one of its variants (gdr_state_variants), with cp.async (ASYNC, from sm_80) or registers.
template <typename T, int D, int BV, bool STAGED, bool ASYNC>
static const char* launch_state(const GatedDeltaRuleParams& p, cudaStream_t stream) {
  if constexpr (!gdr_state_variant_compiled(D, BV, STAGED) || (ASYNC && !STAGED)) {
    return "gated delta rule: no state pass is compiled for these columns (gdr_choose and the launcher disagree)";
  } else {
    auto* state = &gdr_chunk_state_kernel<T, D, BV, STAGED, ASYNC>;
    constexpr int smem = gdr_state_layout(D, BV, STAGED).bytes;
    if (const char* err = opt_in(state, smem)) return err;
    CLEF_LAUNCH(state, dim3(D / BV, p.num_v_heads, static_cast<unsigned>(p.batch)), kGdrChunkThreads, smem, stream)(p);
    return launch_error();
  }
}

template <typename T, int D, bool STAGED, bool ASYNC>
static const char* launch_state_columns(const GatedDeltaRuleParams& p, cudaStream_t stream) {
  switch (p.state.columns) {
    case 16: return launch_state<T, D, 16, STAGED, ASYNC>(p, stream);
    case 32: return launch_state<T, D, 32, STAGED, ASYNC>(p, stream);
    case 64: return launch_state<T, D, 64, STAGED, ASYNC>(p, stream);
    case 128: return launch_state<T, D, 128, STAGED, ASYNC>(p, stream);
  }
  return "gated delta rule: no state pass is compiled for these columns (gdr_choose and the launcher disagree)";
}

// The three passes (gated_delta_rule_chunked.cuh): the state pass in the variant gdr_choose picked, its staged
// tiles fetched with cp.async where the device has it (sm_80 on); the output pass OC columns at a time.
template <typename T, int D, int OC>
static const char* launch_chunked_passes(const GatedDeltaRuleParams& p, cudaStream_t stream) {
  const unsigned chunks = static_cast<unsigned>(gdr_max_chunks(p.num_tokens, p.batch));
  const unsigned heads = static_cast<unsigned>(p.num_v_heads);

  auto* prepare = &gdr_chunk_prepare_kernel<T, D>;
  constexpr int prepare_smem = gdr_prepare_layout(D).bytes;
  if (const char* err = opt_in(prepare, prepare_smem)) return err;
  CLEF_LAUNCH(prepare, dim3(chunks, heads), kGdrChunkThreads, prepare_smem, stream)(p);
  if (const char* err = launch_error()) return err;

  const bool async = current_device().cc >= 80;
  const char* err = !p.state.staged ? launch_state_columns<T, D, false, false>(p, stream)
                    : async         ? launch_state_columns<T, D, true, true>(p, stream)
                                    : launch_state_columns<T, D, true, false>(p, stream);
  if (err != nullptr) return err;

  auto* output = &gdr_chunk_output_kernel<T, D, OC>;
  constexpr int output_smem = gdr_output_layout(D, OC).bytes;
  if (const char* err = opt_in(output, output_smem)) return err;
  CLEF_LAUNCH(output, dim3(chunks, heads), kGdrChunkThreads, output_smem, stream)(p);
  return launch_error();
}

template <typename T, int D>
static const char* launch_chunked(const GatedDeltaRuleParams& p, cudaStream_t stream) {
  if (p.output_columns == D) return launch_chunked_passes<T, D, D>(p, stream);
  if constexpr (D == 128) {
    if (p.output_columns == D / 2) return launch_chunked_passes<T, D, D / 2>(p, stream);
  }
  return "gated delta rule: no output pass is compiled for these columns (gdr_choose and the launcher disagree)";
}

template <typename T>
static const char* launch_chunked_for_dims(const GatedDeltaRuleParams& p, cudaStream_t stream) {
  switch (p.head_k_dim) {
    case 16: return launch_chunked<T, 16>(p, stream);
    case 32: return launch_chunked<T, 32>(p, stream);
    case 64: return launch_chunked<T, 64>(p, stream);
    case 128: return launch_chunked<T, 128>(p, stream);
  }
  return "the chunked gated delta rule kernel is compiled for head dims 16, 32, 64 and 128";
}

template <typename T>
static const char* launch_serial_for_dims(const GatedDeltaRuleParams& p, cudaStream_t stream) {
  if (p.head_k_dim != p.head_v_dim) return "gated delta rule CUDA kernels need head_k_dim == head_v_dim";
  switch (p.head_k_dim) {
    case 16: return launch_serial<T, 16>(p, stream);
    case 32: return launch_serial<T, 32>(p, stream);
    case 64: return launch_serial<T, 64>(p, stream);
    case 128: return launch_serial<T, 128>(p, stream);
  }
  return "gated delta rule CUDA kernels are compiled for head dims 16, 32, 64 and 128";
}

GdrChoice gated_delta_rule_cuda_choice(const GatedDeltaRuleParams& p, ScalarKind kind) {
  return gdr_choose(p, kind, current_device());
}

const char* gated_delta_rule_cuda(const GatedDeltaRuleParams& p, ScalarKind kind, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (p.batch == 0 || p.num_v_heads == 0) return nullptr;
  const GdrChoice choice = gdr_choose(p, kind, current_device());
  if (choice.error != nullptr) return choice.error;
  if (choice.kernel == GdrKernel::Chunked) {
    if (p.workspace == nullptr || p.workspace_bytes < choice.workspace_bytes)
      return "gated delta rule: the chunked kernel needs the workspace gated_delta_rule_cuda_choice sized";
    if (p.state.columns != choice.state.columns || p.state.staged != choice.state.staged ||
        p.output_columns != choice.output_columns)
      return "gated delta rule: the chunked kernel's columns differ from gated_delta_rule_cuda_choice's";
    switch (kind) {
      case ScalarKind::F16: return launch_chunked_for_dims<__half>(p, stream);
      case ScalarKind::BF16: return launch_chunked_for_dims<__nv_bfloat16>(p, stream);
      case ScalarKind::F32: break;  // gdr_chunked_unsupported said so already
    }
    return "gated delta rule: the chunked kernel takes f16 or bf16";
  }
  switch (kind) {
    case ScalarKind::F32: return launch_serial_for_dims<float>(p, stream);
    case ScalarKind::F16: return launch_serial_for_dims<__half>(p, stream);
    case ScalarKind::BF16: return launch_serial_for_dims<__nv_bfloat16>(p, stream);
  }
  return "gated delta rule: unknown dtype";
}

}  // namespace clef
