// Host-side launcher for the gated delta rule kernel. Torch-free on purpose.
#include "gated_delta_rule/gated_delta_rule_kernels.cuh"
#include "gated_delta_rule/gated_delta_rule_launch.h"

namespace clef {

template <typename T, int D>
static const char* launch_gated_delta_rule(const GatedDeltaRuleParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.num_v_heads == 0) return nullptr;
  const dim3 grid(D / GdrTiling<D>::kColumns, p.num_v_heads, p.batch);
  auto* kernel = &gated_delta_rule_kernel<T, D, D>;
  CLEF_LAUNCH(kernel, grid, kGdrThreads, 0, stream)(p);
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

template <typename T>
static const char* launch_for_dims(const GatedDeltaRuleParams& p, cudaStream_t stream) {
  if (p.head_k_dim != p.head_v_dim) return "gated delta rule CUDA kernels need head_k_dim == head_v_dim";
  switch (p.head_k_dim) {
    case 16: return launch_gated_delta_rule<T, 16>(p, stream);
    case 32: return launch_gated_delta_rule<T, 32>(p, stream);
    case 64: return launch_gated_delta_rule<T, 64>(p, stream);
    case 128: return launch_gated_delta_rule<T, 128>(p, stream);
  }
  return "gated delta rule CUDA kernels are compiled for head dims 16, 32, 64 and 128";
}

const char* gated_delta_rule_cuda(const GatedDeltaRuleParams& p, ScalarKind kind, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  switch (kind) {
    case ScalarKind::F32: return launch_for_dims<float>(p, stream);
    case ScalarKind::F16: return launch_for_dims<__half>(p, stream);
    case ScalarKind::BF16: return launch_for_dims<__nv_bfloat16>(p, stream);
  }
  return "gated delta rule: unknown dtype";
}

}  // namespace clef
