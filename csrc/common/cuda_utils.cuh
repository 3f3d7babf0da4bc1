// Small device helpers shared by the kernel families (device code only).
#pragma once

#include "common/hd.h"

// Launch and dynamic shared memory go through macros so the test-only CUDA simulator
// (tests/cuda_sim) can run the very same kernel and launcher source on the CPU.
#ifndef CLEF_LAUNCH
#define CLEF_LAUNCH(kernel, grid, block, smem_bytes, stream) kernel<<<grid, block, smem_bytes, stream>>>
#endif
#ifndef CLEF_DYNAMIC_SHARED
#define CLEF_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

namespace clef {

// Sum over the GROUP consecutive lanes that share (lane / GROUP); GROUP is a power of two <= 32.
template <int GROUP>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int offset = GROUP / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <int GROUP>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int offset = GROUP / 2; offset > 0; offset /= 2) v = max_f32(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

}  // namespace clef
