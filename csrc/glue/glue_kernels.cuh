// CUDA kernels of the glue family (device code only; see conv1d_kernels.cuh for who compiles it).
//
// Row reductions (the RMSNorms) take a CTA per row for add_rms_norm (a 4,096-wide hidden row) and a warp
// per row for the per-head norms (64-256 wide); the elementwise ones a thread per element. Every value is
// read once and written once in the serving dtype (the residual stream in fp32).
#pragma once

#include "common/cuda_utils.cuh"
#include "glue/glue.h"

namespace clef {

constexpr int kGlueThreads = 256;
constexpr int kGlueWarps = kGlueThreads / 32;

// Sum over the CTA (kGlueThreads threads); every thread gets the total.
__device__ __forceinline__ float block_sum(float v, float* shared) {
  v = group_sum<32>(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kGlueWarps; ++w) total += shared[w];
  __syncthreads();  // the shared slots may be reused
  return total;
}

template <typename T>
__global__ void __launch_bounds__(kGlueThreads) add_rms_norm_kernel(AddRmsNormParams p) {
  __shared__ float partial[kGlueWarps];
  const int64_t row = blockIdx.x;
  float* x = p.x + row * p.cols;
  const T* delta = static_cast<const T*>(p.delta) + row * p.cols;
  T* out = static_cast<T*>(p.out) + row * p.cols;
  float ss = 0.0f;
  for (int c = threadIdx.x; c < p.cols; c += kGlueThreads) {
    // (The fault: the sum written out but not kept: the residual stream never moves.)
    const float v = p.delta != nullptr ? x[c] + to_f32(delta[c]) : x[c];
    if (CLEF_FAULT(glue_residual_not_kept, true, false)) x[c] = v;
    ss += v * v;
  }
  const float factor = rms_factor(block_sum(ss, partial), p.cols, p.eps);
  for (int c = threadIdx.x; c < p.cols; c += kGlueThreads) {
    const float v = CLEF_FAULT(glue_residual_not_kept, x[c], p.delta != nullptr ? x[c] + to_f32(delta[c]) : x[c]);
    out[c] = from_f32<T>(v * factor * p.scale[c]);
  }
}

template <typename T>
__global__ void __launch_bounds__(kGlueThreads) silu_mul_kernel(SiluMulParams p) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kGlueThreads + threadIdx.x;
  if (e >= p.rows * p.cols) return;
  const int64_t row = e / p.cols;
  const int c = static_cast<int>(e % p.cols);
  const T* in = static_cast<const T*>(p.gate_up) + row * 2 * p.cols;
  // (The fault: gate and up swapped.)
  const float gate = to_f32(in[CLEF_FAULT(glue_swapped_gate_up, c, p.cols + c)]);
  const float up = to_f32(in[CLEF_FAULT(glue_swapped_gate_up, p.cols + c, c)]);
  static_cast<T*>(p.out)[e] = from_f32<T>(silu_f32(gate) * up);
}

// A warp per (token, head) row of `dim` values.
template <typename T>
__global__ void __launch_bounds__(kGlueThreads) gated_rms_norm_kernel(GatedRmsNormParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kGlueWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= p.tokens * p.heads) return;  // uniform over the warp
  const int64_t token = row / p.heads;
  const int head = static_cast<int>(row % p.heads);
  const T* core = static_cast<const T*>(p.core) + row * p.dim;
  const T* z = static_cast<const T*>(p.z) + token * p.z_token_stride + static_cast<int64_t>(head) * p.dim;
  T* out = static_cast<T*>(p.out) + row * p.dim;
  float ss = 0.0f;
  for (int d = lane; d < p.dim; d += 32) ss += to_f32(core[d]) * to_f32(core[d]);
  const float factor = rms_factor(group_sum<32>(ss), p.dim, p.eps);
  for (int d = lane; d < p.dim; d += 32) {
    // (The fault: the SiLU(z) gate left out.)
    const float gate = CLEF_FAULT(glue_gate_skipped, silu_f32(to_f32(z[d])), 1.0f);
    out[d] = from_f32<T>(to_f32(core[d]) * factor * p.weight[d] * gate);
  }
}

// A warp per (token, head): RMSNorm over the head, then rotate-half on the first 2 * rotary_half dims.
// Every value of the row is read (the element and its rotation partner, which another lane may own) and
// its result held in registers before any is written: so out may be x itself (in place), which the
// schema allows. PER_LANE (>= dim / 32) bounds the registers: 8 up to head dim 256, 32 up to 1024.
template <typename T, int PER_LANE>
__global__ void __launch_bounds__(kGlueThreads) rms_norm_rope_kernel(RmsNormRopeParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kGlueWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= p.tokens * p.heads) return;  // uniform over the warp
  const int64_t token = row / p.heads;
  const int head = static_cast<int>(row % p.heads);
  const T* x = static_cast<const T*>(p.x) + token * p.x_token_stride + head * p.x_head_stride;
  T* out = static_cast<T*>(p.out) + row * p.dim;
  float ss = 0.0f;
  for (int d = lane; d < p.dim; d += 32) ss += to_f32(x[d]) * to_f32(x[d]);
  const float factor = rms_factor(group_sum<32>(ss), p.dim, p.eps);
  const int half = p.rotary_half;
  float values[PER_LANE];
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int d = lane + 32 * i;
    if (d >= p.dim) break;
    const float xd = to_f32(x[d]) * factor * p.scale[d];
    float value = xd;
    if (d < 2 * half) {
      const int j = d < half ? d : d - half;
      const int partner = d < half ? d + half : d - half;
      const float xp = to_f32(x[partner]) * factor * p.scale[partner];
      // (The fault: the sine's sign flipped, a rotation the other way.)
      const float s = CLEF_FAULT(glue_rope_backwards, p.sin[token * half + j], -p.sin[token * half + j]);
      value = rope_value(xd, xp, d, half, p.cos[token * half + j], s);
    }
    values[i] = value;
    // (The fault: the old kernel's write as soon as a value is ready; in place, a later element of this
    // lane, or another lane's, then reads its rotation partner already overwritten.)
    if (CLEF_FAULT(glue_rope_writes_before_reads, false, true)) out[d] = from_f32<T>(value);
  }
  __syncwarp();  // every lane's reads of the row are done: in place, out[d] may now replace x[d]
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int d = lane + 32 * i;
    if (d >= p.dim) break;
    out[d] = from_f32<T>(values[i]);
  }
}

template <typename T>
__global__ void __launch_bounds__(kGlueThreads) sigmoid_gate_kernel(SigmoidGateParams p) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kGlueThreads + threadIdx.x;
  const int64_t per_token = static_cast<int64_t>(p.heads) * p.dim;
  if (e >= p.tokens * per_token) return;
  const int64_t token = e / per_token;
  const int head = static_cast<int>(e % per_token / p.dim);
  const int d = static_cast<int>(e % p.dim);
  // (The fault: the next head's gate.)
  const int gate_head = CLEF_FAULT(glue_gate_of_next_head, head, (head + 1) % p.heads);
  const float gate =
      to_f32(static_cast<const T*>(p.gate)[token * p.gate_token_stride + gate_head * p.gate_head_stride + d]);
  static_cast<T*>(p.out)[e] = from_f32<T>(to_f32(static_cast<const T*>(p.attn)[e]) * sigmoid_f32(gate));
}

}  // namespace clef
