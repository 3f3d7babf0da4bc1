// CPU implementation of dequantize_int8: parallel over rows, the inner loop over a row's contiguous
// values (vectorised: int8 -> fp32 -> the output dtype, one multiply each).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

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
