// Host-side launchers for the conv1d kernels. Torch-free on purpose: this file compiles in seconds.
#include "conv1d/conv1d_kernels.cuh"
#include "conv1d/conv1d_launch.h"

namespace clef {

template <typename T, int W>
static const char* launch_conv1d(const Conv1dParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.channels == 0) return nullptr;
  const int channel_blocks = ceil_div(p.channels, kConvThreads);
  // No sequence is longer than the whole pack, so this bound needs no device-to-host copy of cu_seqlens;
  // tiles past a sequence's end exit at once.
  const int tiles = p.cu_seqlens != nullptr ? ceil_div(static_cast<int>(p.num_tokens > 0 ? p.num_tokens : 1), kConvTileTokens) : 1;
  auto* fwd = &conv1d_fwd_kernel<T, W>;
  auto* save_state = &conv1d_save_state_kernel<T, W>;
  CLEF_LAUNCH(fwd, dim3(channel_blocks, tiles, p.batch), kConvThreads, 0, stream)(p);
  CLEF_LAUNCH(save_state, dim3(channel_blocks, p.batch), kConvThreads, 0, stream)(p);
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

const char* conv1d_fwd_cuda(const Conv1dParams& p, ScalarKind kind, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (p.width != 4) return "conv1d CUDA kernels are compiled for width 4 only";
  switch (kind) {
    case ScalarKind::F32:
      return launch_conv1d<float, 4>(p, stream);
    case ScalarKind::F16:
      return launch_conv1d<__half, 4>(p, stream);
    case ScalarKind::BF16:
      return launch_conv1d<__nv_bfloat16, 4>(p, stream);
  }
  return "conv1d: unknown dtype";
}

}  // namespace clef
