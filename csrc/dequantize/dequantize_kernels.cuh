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

// ---- int8_linear: the fused W8A16 GEMM for at most 64 rows ----------------------------------------------
// A CTA of 256 threads owns 64 output columns and every row of the step. It walks `in` in tiles of 128:
// the rows' x values (fp32) and the 64 columns' int8 weights staged in shared memory (33 + 8.3 KB, under
// the 48 KB every card gives), then thread (g = t / 64, n = t % 64) adds x[m] . w[n] for its 16 rows
// m = g, g + 4, ..., 4 values of k at a time: one 4-byte load of int8 weights and 16 16-byte loads of x
// (every lane of a warp reads the same x row: a broadcast) per 64 FMAs. Each weight byte is read from
// memory once; x is re-read per CTA, from L2.
constexpr int kInt8LinearThreads = 256;
constexpr int kInt8LinearColumns = 64;
constexpr int kInt8LinearTile = 128;                 // values of `in` per shared-memory tile
constexpr int kInt8LinearXStride = kInt8LinearTile + 4;   // floats a staged x row (16-byte rows)
constexpr int kInt8LinearQStride = kInt8LinearTile + 4;   // bytes a staged weight row: lane n's words in bank n
constexpr int kInt8LinearRowGroups = kInt8LinearThreads / kInt8LinearColumns;  // 4
constexpr int kInt8LinearRowsPerThread = kInt8LinearMaxRows / kInt8LinearRowGroups;  // 16

template <typename T>
__global__ void __launch_bounds__(kInt8LinearThreads) int8_linear_kernel(Int8LinearParams p) {
  __shared__ float x_s[kInt8LinearMaxRows * kInt8LinearXStride];
  __shared__ int8_t q_s[kInt8LinearColumns * kInt8LinearQStride];
  const int t = threadIdx.x, n_local = t % kInt8LinearColumns, group = t / kInt8LinearColumns;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kInt8LinearColumns;
  const T* x = static_cast<const T*>(p.x);
  float acc[kInt8LinearRowsPerThread];
#pragma unroll
  for (int i = 0; i < kInt8LinearRowsPerThread; ++i) acc[i] = 0.0f;

  for (int64_t k0 = 0; k0 < p.in_features; k0 += kInt8LinearTile) {
    const int width = p.in_features - k0 < kInt8LinearTile ? static_cast<int>(p.in_features - k0) : kInt8LinearTile;
    // Stage x[0:rows, k0:k0+128] as fp32 (zeros past `in`, so the inner loop needs no bound).
    for (int e = t; e < p.rows * kInt8LinearTile; e += kInt8LinearThreads) {
      const int m = e / kInt8LinearTile, k = e % kInt8LinearTile;
      x_s[m * kInt8LinearXStride + k] = k < width ? to_f32(x[m * p.x_row_stride + k0 + k]) : 0.0f;
    }
    // Stage the 64 columns' weights (zeros past `in` and past `out`), 4 bytes at a time.
    for (int e = t; e < kInt8LinearColumns * (kInt8LinearTile / 4); e += kInt8LinearThreads) {
      const int c = e / (kInt8LinearTile / 4), k = 4 * (e % (kInt8LinearTile / 4));
      const int64_t n = n0 + c;
      int8_t v[4] = {0, 0, 0, 0};
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (n < p.out_features && k + j < width) v[j] = p.qweight[n * p.in_features + k0 + k + j];
      int8_t* dst = q_s + c * kInt8LinearQStride + k;
#pragma unroll
      for (int j = 0; j < 4; ++j) dst[j] = v[j];
    }
    __syncthreads();
    const int8_t* w_row = q_s + n_local * kInt8LinearQStride;
    // (The fault: the tile's last 4 values of `in` left out of every sum.)
    const int tile_end = CLEF_FAULT(int8_linear_drops_tile_tail, kInt8LinearTile, kInt8LinearTile - 4);
    for (int k = 0; k < tile_end; k += 4) {
      const float w0 = w_row[k], w1 = w_row[k + 1], w2 = w_row[k + 2], w3 = w_row[k + 3];
#pragma unroll
      for (int i = 0; i < kInt8LinearRowsPerThread; ++i) {
        const int m = group + kInt8LinearRowGroups * i;
        if (m < p.rows) {  // uniform over the warp (a warp shares its row group)
          const float* xr = x_s + m * kInt8LinearXStride + k;
          acc[i] += xr[0] * w0 + xr[1] * w1 + xr[2] * w2 + xr[3] * w3;
        }
      }
    }
    __syncthreads();  // the tiles are restaged
  }
  const int64_t n = n0 + n_local;
  if (n >= p.out_features) return;
  // (The fault: the second column tile's outputs all scaled by its first column's scale.)
  const float scale = p.scale[CLEF_FAULT(int8_linear_column_tile_wrong_scale, n, blockIdx.x == 1 ? n0 : n)];
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int i = 0; i < kInt8LinearRowsPerThread; ++i) {
    const int m = group + kInt8LinearRowGroups * i;
    if (m < p.rows) out[m * p.out_features + n] = from_f32<T>(acc[i] * scale);
  }
}

}  // namespace clef
