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
// Tensor-core tiles need their shared-memory base aligned (wmma::load_matrix_sync: 32 bytes).
#ifndef CLEF_DYNAMIC_SHARED_ALIGNED
#define CLEF_DYNAMIC_SHARED_ALIGNED(type, name, bytes) extern __shared__ __align__(bytes) type name[]
#endif
// Test-only fault injection points: CLEF_FAULT(name, good, faulty) is `good` in every real build. The CUDA
// simulator (tests/cuda_sim) evaluates `faulty` instead while a test has switched fault `name` on, to
// show that the tests catch that bug in the unmodified kernel.
#ifndef CLEF_FAULT
#define CLEF_FAULT(name, good, faulty) (good)
#endif
// A fault confined to a band of channels reads the band the test named with CLEF_FAULT_BAND_CONTAINS(c) in its
// `faulty` expression: the simulator's (tests/cuda_sim); real builds drop the expression unexpanded.
// The simulator checks the alignment a GPU would fault on; nothing to do on a GPU.
#ifndef CLEF_CHECK_ALIGNED
#define CLEF_CHECK_ALIGNED(ptr, bytes, what)
#endif
// A value every thread computes must be finite (padding rows included): the simulator checks it and throws
// naming `what`; nothing on a GPU.
#ifndef CLEF_CHECK_FINITE
#define CLEF_CHECK_FINITE(value, what)
#endif
// cp.async (sm_80 on): 16 bytes from global to shared memory without a register, landing once the thread has
// waited for its group. The simulator (tests/cuda_sim) defers each copy to that wait, so a read that comes
// before it sees the old bytes, as on a GPU.
#ifndef CLEF_CP_ASYNC16
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define CLEF_CP_ASYNC16(dst, src)                                                                              \
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(dst))), \
               "l"(src)                                                                                        \
               : "memory")
#define CLEF_CP_ASYNC_COMMIT() asm volatile("cp.async.commit_group;" ::: "memory")
#define CLEF_CP_ASYNC_WAIT(n) asm volatile("cp.async.wait_group %0;" ::"n"(n) : "memory")
#else  // the kernels that use it are launched from sm_80 only
#define CLEF_CP_ASYNC16(dst, src) __trap()
#define CLEF_CP_ASYNC_COMMIT() __trap()
#define CLEF_CP_ASYNC_WAIT(n) __trap()
#endif
#endif
// Named barrier: the simulator models it as a barrier of its own per (block, id). The id is an immediate
// ("n"): with an id from a register ptxas cannot tell which barriers a kernel uses and reserves all 16.
#ifndef CLEF_BAR_SYNC
#define CLEF_BAR_SYNC(id, threads) asm volatile("bar.sync %0, %1;" ::"n"(id), "r"(threads) : "memory")
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

// 16-byte copies (8 f16/bf16 elements) between 16-byte aligned addresses: cache or query rows to
// shared-memory tiles.
__device__ __forceinline__ void copy16(void* dst, const void* src) {
  CLEF_CHECK_ALIGNED(dst, 16, "16-byte store");
  CLEF_CHECK_ALIGNED(src, 16, "16-byte load");
  *static_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
}

__device__ __forceinline__ void zero16(void* dst) {
  CLEF_CHECK_ALIGNED(dst, 16, "16-byte store");
  *static_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
}

// The two halves of copy16, for a copy that waits in registers while other work runs.
__device__ __forceinline__ uint4 load16(const void* src) {
  CLEF_CHECK_ALIGNED(src, 16, "16-byte load");
  return *static_cast<const uint4*>(src);
}

__device__ __forceinline__ void store16(void* dst, uint4 value) {
  CLEF_CHECK_ALIGNED(dst, 16, "16-byte store");
  *static_cast<uint4*>(dst) = value;
}

// cp.async: a 16-byte copy from global to shared memory (both 16-byte aligned) in flight, a group of them
// closed, and a wait until at most N groups remain in flight (the copies of the others have landed, for this
// thread: a barrier makes them the CTA's).
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  CLEF_CHECK_ALIGNED(dst, 16, "cp.async store");
  CLEF_CHECK_ALIGNED(src, 16, "cp.async load");
  CLEF_CP_ASYNC16(dst, src);
}
__device__ __forceinline__ void cp_async_commit() { CLEF_CP_ASYNC_COMMIT(); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  CLEF_CP_ASYNC_WAIT(N);
}

// Barrier ID (1..15: 0 is __syncthreads') over `threads` threads, a multiple of 32: warps that share
// work wait for each other without holding up the rest of the CTA. Every participant passes the same
// count; the memory ordering is __syncthreads' among them.
template <int ID>
__device__ __forceinline__ void bar_sync(int threads) {
  static_assert(ID >= 1 && ID <= 15, "named barriers 1..15 (0 is __syncthreads')");
  CLEF_BAR_SYNC(ID, threads);
}

// Barrier 1 + group for warp group 0..3 (v2 attention's warp pairs), each id an immediate, so a kernel
// that runs up to 4 groups is seen to use barriers 0..4 and no more.
constexpr int kMaxBarrierGroups = 4;
__device__ __forceinline__ void group_bar_sync(int group, int threads) {
  switch (group) {
    case 0: bar_sync<1>(threads); break;
    case 1: bar_sync<2>(threads); break;
    case 2: bar_sync<3>(threads); break;
    default: bar_sync<4>(threads); break;
  }
}

}  // namespace clef
