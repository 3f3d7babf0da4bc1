// Int8 weights with one fp32 scale per row (W8A16): parameters and the math shared by the CUDA kernel
// (dequantize_kernels.cuh) and the CPU implementation (dequantize_cpu.cpp).
//
// Layout:
//   qweight  [rows, cols] int8, contiguous: a linear layer's [out, in] weight (or embedding rows),
//            symmetric: w[r, c] ~= qweight[r, c] * scale[r], scale = absmax of row r / 127
//   scale    [rows] fp32
//   out      [rows, cols] contiguous, the serving dtype (fp32, f16 or bf16)
// Every element is one fp32 multiply rounded once to the output dtype, on both paths, so the CUDA, CPU
// and reference results are identical (the self-check compares them exactly).
#pragma once

#include "common/hd.h"

namespace clef {

struct DequantizeParams {
  const int8_t* qweight = nullptr;
  const float* scale = nullptr;
  void* out = nullptr;
  int64_t rows = 0, cols = 0;
};

CLEF_HD float dequantize_value(int8_t q, float scale) { return static_cast<float>(q) * scale; }

// Elements per CUDA thread: one 16-byte load of int8 values. Rows whose length is a multiple of it are
// loaded and stored in 16-byte words; others element by element.
constexpr int kDequantizeVector = 16;

// int8_linear: the fused W8A16 GEMM for small steps (prefix-cache hits, lone short records, decode packs),
// where dequantize + GEMM moves 5 bytes a weight (read 1, write 2, read 2) against a dense f16 GEMM's 2:
//   x      [rows, in] the serving dtype (last dim contiguous, rows x_row_stride apart), rows <= 64
//   qweight [out, in] int8 contiguous, scale [out] fp32
//   out    [rows, out] contiguous, the serving dtype
//   out[m, n] = (sum_k x[m, k] * qweight[n, k]) * scale[n]: the int8 values exact in fp32, the scale applied
//   once after the sum, rounded once. (dequantize + GEMM rounds each weight to the serving dtype first: the
//   two agree to that rounding.)
struct Int8LinearParams {
  const void* x = nullptr;
  int64_t x_row_stride = 0;
  const int8_t* qweight = nullptr;
  const float* scale = nullptr;
  void* out = nullptr;
  int rows = 0;
  int64_t in_features = 0, out_features = 0;
};

constexpr int kInt8LinearMaxRows = 64;  // the CUDA kernel keeps every row's sums in registers

}  // namespace clef
