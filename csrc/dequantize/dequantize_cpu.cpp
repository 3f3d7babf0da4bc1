// CPU implementations of the int8 family. dequantize_int8: parallel over rows, the inner loop over a row's
// contiguous values (vectorised: int8 -> fp32 -> the output dtype, one multiply each). int8_linear: the fused
// small-step GEMM, a block of weight rows at a time: its int8 values turned to fp32 in a buffer that stays
// in cache (about 2 MiB), one GEMM of the step's rows against it, the scales applied to the block's sums.
// The int8 weights are read from memory once and no full-size scratch is written, as on the GPU.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <type_traits>

#include "common/cpu_kernel.h"
#include "dequantize/dequantize_launch.h"

namespace clef {
namespace {

template <typename T>
CLEF_INLINE void dequantize_rows(const DequantizeParams& p, int64_t r0, int64_t r1) {
  T* out = static_cast<T*>(p.out);
  for (int64_t r = r0; r < r1; ++r) {
    const float scale = p.scale[r];
    const int8_t* src = p.qweight + r * p.cols;
    T* dst = out + r * p.cols;
    for (int64_t c = 0; c < p.cols; ++c) dst[c] = from_f32<T>(dequantize_value(src[c], scale));
  }
}

}  // namespace

#define CLEF_DEQUANTIZE_CPU_ENTRY(name, T) \
  CLEF_CPU_VARIANTS(name, (const DequantizeParams& p, int64_t r0, int64_t r1), (p, r0, r1), dequantize_rows<T>)
CLEF_DEQUANTIZE_CPU_ENTRY(dequantize_rows_f32, float)
CLEF_DEQUANTIZE_CPU_ENTRY(dequantize_rows_f16, c10::Half)
CLEF_DEQUANTIZE_CPU_ENTRY(dequantize_rows_bf16, c10::BFloat16)

namespace {

template <typename T>
CLEF_INLINE void int8_rows_to_f32(const int8_t* q, int64_t count, float* out) {
  for (int64_t i = 0; i < count; ++i) out[i] = static_cast<float>(q[i]);
}
CLEF_CPU_VARIANTS(int8_to_f32, (const int8_t* q, int64_t count, float* out), (q, count, out), int8_rows_to_f32<float>)

template <typename T>
void int8_linear_typed(const Int8LinearParams& p) {
  const int64_t rows = p.rows, in = p.in_features, n_out = p.out_features;
  // The step's rows as one contiguous fp32 matrix (a copy unless they already are one).
  at::Tensor x;
  if constexpr (std::is_same_v<T, float>) {
    x = at::from_blob(const_cast<void*>(p.x), {rows, in}, {p.x_row_stride, 1}, at::kFloat).contiguous();
  } else {
    x = at::empty({rows, in}, at::kFloat);
    const T* src = static_cast<const T*>(p.x);
    float* dst = x.data_ptr<float>();
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t k = 0; k < in; ++k) dst[m * in + k] = static_cast<float>(src[m * p.x_row_stride + k]);
  }
  int64_t block = (2 * 1024 * 1024) / (4 * (in > 0 ? in : 1));
  block = block < 16 ? 16 : (block > 512 ? 512 : block);
  const auto to_f32 = int8_to_f32_for(cpu_isa());
  T* out = static_cast<T*>(p.out);
  at::parallel_for(0, (n_out + block - 1) / block, 1, [&](int64_t b0, int64_t b1) {
    at::Tensor w = at::empty({block, in}, at::kFloat);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * block, nb = n_out - n0 < block ? n_out - n0 : block;
      to_f32(p.qweight + n0 * in, nb * in, w.data_ptr<float>());
      const at::Tensor sums = at::mm(x, w.narrow(0, 0, nb).t());  // [rows, nb]
      const float* s = sums.data_ptr<float>();
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t j = 0; j < nb; ++j) out[m * n_out + n0 + j] = from_f32<T>(s[m * nb + j] * p.scale[n0 + j]);
    }
  });
}

}  // namespace

void int8_linear_cpu(const Int8LinearParams& p, ScalarKind kind) {
  if (p.rows == 0 || p.out_features == 0) return;
  switch (kind) {
    case ScalarKind::F32: return int8_linear_typed<float>(p);
    case ScalarKind::F16: return int8_linear_typed<c10::Half>(p);
    case ScalarKind::BF16: return int8_linear_typed<c10::BFloat16>(p);
  }
}

void dequantize_int8_cpu(const DequantizeParams& p, ScalarKind kind) {
  const CpuIsa isa = cpu_isa();
  auto rows_fn = kind == ScalarKind::F32   ? dequantize_rows_f32_for(isa)
                 : kind == ScalarKind::F16 ? dequantize_rows_f16_for(isa)
                                           : dequantize_rows_bf16_for(isa);
  // About 64 KB of int8 per work item.
  const int64_t grain = p.cols > 0 ? (65536 + p.cols - 1) / p.cols : 1;
  at::parallel_for(0, p.rows, grain, [&](int64_t begin, int64_t end) { rows_fn(p, begin, end); });
}

}  // namespace clef
