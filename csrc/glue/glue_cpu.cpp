// CPU implementation of the glue family: parallel over rows (or tokens), fp32 math per element, the loops
// over a row's contiguous values vectorised by the compiler in each instruction-set variant.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "common/cpu_kernel.h"
#include "glue/glue_launch.h"

namespace clef {
namespace {

template <typename T>
CLEF_INLINE void add_rms_norm_rows(const AddRmsNormParams& p, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    float* x = p.x + r * p.cols;
    const T* delta = static_cast<const T*>(p.delta) + r * p.cols;
    T* out = static_cast<T*>(p.out) + r * p.cols;
    float ss = 0.0f;
    for (int c = 0; c < p.cols; ++c) {
      const float v = p.delta != nullptr ? x[c] + to_f32(delta[c]) : x[c];
      x[c] = v;
      ss += v * v;
    }
    const float factor = rms_factor(ss, p.cols, p.eps);
    for (int c = 0; c < p.cols; ++c) out[c] = from_f32<T>(x[c] * factor * p.scale[c]);
  }
}

// The SiLU and sigmoid loops run a vector at a time through exp_any: the scalar exp_vec's underflow branch
// kept the compiler from vectorising them (silu_mul took 2.8x eager torch's time at 2,048 x 128 in fp32, 5x in
// bf16). The tail runs the scalar function: the same polynomial.
template <typename T, typename V>
CLEF_INLINE void silu_mul_rows(const SiluMulParams& p, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* gate = static_cast<const T*>(p.gate_up) + r * 2 * p.cols;
    const T* up = gate + p.cols;
    T* out = static_cast<T*>(p.out) + r * p.cols;
    int c = 0;
    for (; c + lanes_of<V> <= p.cols; c += lanes_of<V>)
      store_from<V>(out + c, silu_any(load_as<V>(gate + c)) * load_as<V>(up + c));
    for (; c < p.cols; ++c) out[c] = from_f32<T>(silu_vec(to_f32(gate[c])) * to_f32(up[c]));
  }
}

template <typename T, typename V>
CLEF_INLINE void gated_rms_norm_rows(const GatedRmsNormParams& p, int64_t r0, int64_t r1) {
  for (int64_t row = r0; row < r1; ++row) {
    const int64_t token = row / p.heads;
    const int head = static_cast<int>(row % p.heads);
    const T* core = static_cast<const T*>(p.core) + row * p.dim;
    const T* z = static_cast<const T*>(p.z) + token * p.z_token_stride + static_cast<int64_t>(head) * p.dim;
    T* out = static_cast<T*>(p.out) + row * p.dim;
    float ss = 0.0f;
    for (int d = 0; d < p.dim; ++d) ss += to_f32(core[d]) * to_f32(core[d]);
    const float factor = rms_factor(ss, p.dim, p.eps);
    int d = 0;
    for (; d + lanes_of<V> <= p.dim; d += lanes_of<V>)
      store_from<V>(out + d, load_as<V>(core + d) * factor * load_v<V>(p.weight + d) * silu_any(load_as<V>(z + d)));
    for (; d < p.dim; ++d) out[d] = from_f32<T>(to_f32(core[d]) * factor * p.weight[d] * silu_vec(to_f32(z[d])));
  }
}

template <typename T>
CLEF_INLINE void rms_norm_rope_rows(const RmsNormRopeParams& p, int64_t r0, int64_t r1) {
  float normed[1024];  // a head (the host entry checks dim <= 1024)
  for (int64_t row = r0; row < r1; ++row) {
    const int64_t token = row / p.heads;
    const int head = static_cast<int>(row % p.heads);
    const T* x = static_cast<const T*>(p.x) + token * p.x_token_stride + head * p.x_head_stride;
    T* out = static_cast<T*>(p.out) + row * p.dim;
    float ss = 0.0f;
    for (int d = 0; d < p.dim; ++d) ss += to_f32(x[d]) * to_f32(x[d]);
    const float factor = rms_factor(ss, p.dim, p.eps);
    for (int d = 0; d < p.dim; ++d) normed[d] = to_f32(x[d]) * factor * p.scale[d];
    const int half = p.rotary_half;
    const float* cos = p.cos + token * half;
    const float* sin = p.sin + token * half;
    for (int j = 0; j < half; ++j) {
      out[j] = from_f32<T>(rope_value(normed[j], normed[j + half], j, half, cos[j], sin[j]));
      out[j + half] = from_f32<T>(rope_value(normed[j + half], normed[j], j + half, half, cos[j], sin[j]));
    }
    for (int d = 2 * half; d < p.dim; ++d) out[d] = from_f32<T>(normed[d]);
  }
}

template <typename T, typename V>
CLEF_INLINE void sigmoid_gate_rows(const SigmoidGateParams& p, int64_t t0, int64_t t1) {
  for (int64_t token = t0; token < t1; ++token)
    for (int head = 0; head < p.heads; ++head) {
      const int64_t at = (token * p.heads + head) * p.dim;
      const T* attn = static_cast<const T*>(p.attn) + at;
      const T* gate = static_cast<const T*>(p.gate) + token * p.gate_token_stride + head * p.gate_head_stride;
      T* out = static_cast<T*>(p.out) + at;
      int d = 0;
      for (; d + lanes_of<V> <= p.dim; d += lanes_of<V>)
        store_from<V>(out + d, load_as<V>(attn + d) / (1.0f + exp_any(-load_as<V>(gate + d))));
      for (; d < p.dim; ++d) out[d] = from_f32<T>(to_f32(attn[d]) / (1.0f + exp_vec(-to_f32(gate[d]))));
    }
}

}  // namespace

// The vectorised loops run vf16s on AVX-512 and baseline, vf8s on AVX2 (one register: see vf8 in
// common/cpu_kernel.h).
#define CLEF_GLUE_CPU_VECTOR_ENTRY(name, Params, rows, T)                                                       \
  CLEF_CPU_VARIANTS_EACH(name, (const Params& p, int64_t a, int64_t b), (p, a, b), (rows<T, vf16>), (rows<T, vf8>), \
                         (rows<T, vf16>))
#define CLEF_GLUE_CPU_ENTRIES(suffix, T)                                                                          \
  CLEF_CPU_VARIANTS(add_rms_norm_##suffix, (const AddRmsNormParams& p, int64_t a, int64_t b), (p, a, b),           \
                    add_rms_norm_rows<T>)                                                                         \
  CLEF_GLUE_CPU_VECTOR_ENTRY(silu_mul_##suffix, SiluMulParams, silu_mul_rows, T)                                  \
  CLEF_GLUE_CPU_VECTOR_ENTRY(gated_rms_norm_##suffix, GatedRmsNormParams, gated_rms_norm_rows, T)                 \
  CLEF_CPU_VARIANTS(rms_norm_rope_##suffix, (const RmsNormRopeParams& p, int64_t a, int64_t b), (p, a, b),         \
                    rms_norm_rope_rows<T>)                                                                        \
  CLEF_GLUE_CPU_VECTOR_ENTRY(sigmoid_gate_##suffix, SigmoidGateParams, sigmoid_gate_rows, T)
CLEF_GLUE_CPU_ENTRIES(f32, float)
CLEF_GLUE_CPU_ENTRIES(f16, c10::Half)
CLEF_GLUE_CPU_ENTRIES(bf16, c10::BFloat16)

// The dtype's variant of `name` for this CPU, run over [0, n) in parallel work items of `grain`.
#define CLEF_GLUE_CPU_RUN(name, p, n, grain, kind)                                                  \
  do {                                                                                              \
    const CpuIsa isa = cpu_isa();                                                                   \
    auto fn = kind == ScalarKind::F32   ? name##_f32_for(isa)                                       \
              : kind == ScalarKind::F16 ? name##_f16_for(isa)                                       \
                                        : name##_bf16_for(isa);                                     \
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) { fn(p, begin, end); });          \
  } while (0)

void add_rms_norm_cpu(const AddRmsNormParams& p, ScalarKind kind) { CLEF_GLUE_CPU_RUN(add_rms_norm, p, p.rows, 16, kind); }
void silu_mul_cpu(const SiluMulParams& p, ScalarKind kind) { CLEF_GLUE_CPU_RUN(silu_mul, p, p.rows, 8, kind); }
void gated_rms_norm_cpu(const GatedRmsNormParams& p, ScalarKind kind) {
  CLEF_GLUE_CPU_RUN(gated_rms_norm, p, p.tokens * p.heads, 64, kind);
}
void rms_norm_rope_cpu(const RmsNormRopeParams& p, ScalarKind kind) {
  CLEF_GLUE_CPU_RUN(rms_norm_rope, p, p.tokens * p.heads, 64, kind);
}
void sigmoid_gate_cpu(const SigmoidGateParams& p, ScalarKind kind) { CLEF_GLUE_CPU_RUN(sigmoid_gate, p, p.tokens, 16, kind); }

}  // namespace clef
