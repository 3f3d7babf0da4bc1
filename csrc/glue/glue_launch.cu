// Host-side launchers of the glue kernels. Torch-free on purpose.
#include "glue/glue_kernels.cuh"
#include "glue/glue_launch.h"

namespace clef {

static const char* glue_error() {
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

static int64_t blocks_for(int64_t items, int per_block) { return (items + per_block - 1) / per_block; }

// One instantiation per serving dtype; `launch<T>` does the work.
#define CLEF_GLUE_DISPATCH(launch, p, kind, stream)                   \
  switch (kind) {                                                     \
    case ScalarKind::F32: return launch<float>(p, stream);            \
    case ScalarKind::F16: return launch<__half>(p, stream);           \
    case ScalarKind::BF16: return launch<__nv_bfloat16>(p, stream);   \
  }                                                                   \
  return "glue: unknown dtype";

// Every glue kernel runs kGlueThreads threads a block without dynamic shared memory; no work, no launch.
template <typename Kernel, typename Params>
static const char* launch_glue(Kernel* kernel, int64_t blocks, const Params& p, cudaStream_t stream) {
  if (blocks == 0) return nullptr;
  CLEF_LAUNCH(kernel, static_cast<unsigned>(blocks), kGlueThreads, 0, stream)(p);
  return glue_error();
}

// Blocks: a row each for add_rms_norm; a warp per (token, head) row for the per-head norms; a thread per
// element for the elementwise ones.
template <typename T>
static const char* launch_add_rms_norm(const AddRmsNormParams& p, cudaStream_t stream) {
  return launch_glue(&add_rms_norm_kernel<T>, p.rows, p, stream);
}
template <typename T>
static const char* launch_silu_mul(const SiluMulParams& p, cudaStream_t stream) {
  return launch_glue(&silu_mul_kernel<T>, blocks_for(p.rows * p.cols, kGlueThreads), p, stream);
}
template <typename T>
static const char* launch_gated_rms_norm(const GatedRmsNormParams& p, cudaStream_t stream) {
  return launch_glue(&gated_rms_norm_kernel<T>, blocks_for(p.tokens * p.heads, kGlueWarps), p, stream);
}
// The row's results wait in PER_LANE registers a lane (head dims up to 32 x PER_LANE).
template <typename T>
static const char* launch_rms_norm_rope(const RmsNormRopeParams& p, cudaStream_t stream) {
  const int64_t blocks = blocks_for(p.tokens * p.heads, kGlueWarps);
  if (p.dim <= 32 * 8) return launch_glue(&rms_norm_rope_kernel<T, 8>, blocks, p, stream);
  if (p.dim <= 32 * 32) return launch_glue(&rms_norm_rope_kernel<T, 32>, blocks, p, stream);
  return "rms_norm_rope: head dims up to 1024";
}
template <typename T>
static const char* launch_sigmoid_gate(const SigmoidGateParams& p, cudaStream_t stream) {
  return launch_glue(&sigmoid_gate_kernel<T>, blocks_for(p.tokens * p.heads * p.dim, kGlueThreads), p, stream);
}

const char* add_rms_norm_cuda(const AddRmsNormParams& p, ScalarKind kind, void* stream) {
  CLEF_GLUE_DISPATCH(launch_add_rms_norm, p, kind, static_cast<cudaStream_t>(stream))
}
const char* silu_mul_cuda(const SiluMulParams& p, ScalarKind kind, void* stream) {
  CLEF_GLUE_DISPATCH(launch_silu_mul, p, kind, static_cast<cudaStream_t>(stream))
}
const char* gated_rms_norm_cuda(const GatedRmsNormParams& p, ScalarKind kind, void* stream) {
  CLEF_GLUE_DISPATCH(launch_gated_rms_norm, p, kind, static_cast<cudaStream_t>(stream))
}
const char* rms_norm_rope_cuda(const RmsNormRopeParams& p, ScalarKind kind, void* stream) {
  CLEF_GLUE_DISPATCH(launch_rms_norm_rope, p, kind, static_cast<cudaStream_t>(stream))
}
const char* sigmoid_gate_cuda(const SigmoidGateParams& p, ScalarKind kind, void* stream) {
  CLEF_GLUE_DISPATCH(launch_sigmoid_gate, p, kind, static_cast<cudaStream_t>(stream))
}

}  // namespace clef
