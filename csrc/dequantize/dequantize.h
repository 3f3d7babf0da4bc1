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

}  // namespace clef
