// CUDA kernel of dequantize_int8 (device code only: compiled by nvcc through dequantize_launch.cu, by
// NVRTC for the compile checks, and by g++ under the test-only CUDA simulator).
//
// One thread turns 16 consecutive int8 values of a row into the output dtype: a 16-byte load, 16 fp32
// multiplies by the row's scale, 32 (f16/bf16) or 64 (fp32) bytes stored. Bandwidth-bound: 3 bytes
// moved per f16 element.
#pragma once

#include "common/cuda_utils.cuh"
#include "dequantize/dequantize.h"

namespace clef {

constexpr int kDequantizeThreads = 256;

template <typename T, bool VECTOR>
__global__ void __launch_bounds__(kDequantizeThreads) dequantize_int8_kernel(DequantizeParams p) {
  const int64_t chunks_per_row = (p.cols + kDequantizeVector - 1) / kDequantizeVector;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * kDequantizeThreads + threadIdx.x;
  if (chunk >= p.rows * chunks_per_row) return;
  const int64_t r = chunk / chunks_per_row;
  const int64_t c0 = (chunk % chunks_per_row) * kDequantizeVector;
  // (The fault: the last row scaled by the first row's scale.)
  const float scale = p.scale[CLEF_FAULT(dequantize_wrong_scale_row, r, r == p.rows - 1 ? 0 : r)];
  const int8_t* src = p.qweight + r * p.cols + c0;
  T* dst = static_cast<T*>(p.out) + r * p.cols + c0;
  if constexpr (VECTOR) {
    // Rows are a multiple of 16 elements long: every chunk starts 16-byte aligned in qweight (and
    // 32/64-byte aligned in out).
    alignas(16) int8_t q[kDequantizeVector];
    alignas(16) T values[kDequantizeVector];
    copy16(q, src);
#pragma unroll
    for (int i = 0; i < kDequantizeVector; ++i) values[i] = from_f32<T>(dequantize_value(q[i], scale));
#pragma unroll
    for (int w = 0; w < static_cast<int>(sizeof(values)) / 16; ++w)
      copy16(reinterpret_cast<char*>(dst) + 16 * w, reinterpret_cast<const char*>(values) + 16 * w);
  } else {
    const int n = p.cols - c0 < kDequantizeVector ? static_cast<int>(p.cols - c0) : kDequantizeVector;
    for (int i = 0; i < n; ++i) dst[i] = from_f32<T>(dequantize_value(src[i], scale));
  }
}

}  // namespace clef
