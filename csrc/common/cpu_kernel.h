// Helpers for the CPU implementations (host only, never seen by nvcc or NVRTC).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>

// Hot CPU loops are compiled three times (AVX-512, AVX2+FMA, baseline x86-64) and cpu_isa() picks which
// one runs: the best the machine has, or the one CLEF_CPU_ISA / clef_cuda.ops.set_cpu_isa asks for, so
// one wheel runs everywhere, still vectorises, and an AVX-512 machine can run (and test) the AVX2 code.
// CLEF_CPU_VARIANTS defines name_avx512, name_avx2 and name_baseline from one body (a call `impl args`
// that inlines: GCC's target attributes do not apply to templates, so impl is a template the three
// non-template variants instantiate) and name_for(isa), which returns the one to call;
// CLEF_CPU_VARIANTS_EACH takes one body per variant (e.g. vectors of the variant's register width).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(CLEF_NO_CPU_VARIANTS)
#define CLEF_CPU_HAS_VARIANTS 1
#define CLEF_TARGET_AVX512 __attribute__((target("arch=x86-64-v4")))
#define CLEF_TARGET_AVX2 __attribute__((target("arch=x86-64-v3")))
#else
#define CLEF_CPU_HAS_VARIANTS 0
#define CLEF_TARGET_AVX512
#define CLEF_TARGET_AVX2
#endif
#define CLEF_INLINE inline __attribute__((always_inline))

#define CLEF_CPU_VARIANTS_EACH(name, params, args, impl512, impl2, impl_base)     \
  static CLEF_TARGET_AVX512 void name##_avx512 params { impl512 args; }             \
  static CLEF_TARGET_AVX2 void name##_avx2 params { impl2 args; }                   \
  static void name##_baseline params { impl_base args; }                            \
  inline auto name##_for(::clef::CpuIsa isa) {                                      \
    ::clef::count_cpu_isa_call(isa);                                                \
    return isa == ::clef::CpuIsa::Avx512 ? name##_avx512                            \
           : isa == ::clef::CpuIsa::Avx2 ? name##_avx2 : name##_baseline;           \
  }
#define CLEF_CPU_VARIANTS(name, params, args, impl) CLEF_CPU_VARIANTS_EACH(name, params, args, impl, impl, impl)

namespace clef {

// Ordered: a machine that runs one runs every one below it.
enum class CpuIsa : int { Baseline = 0, Avx2 = 1, Avx512 = 2 };

inline const char* cpu_isa_name(CpuIsa isa) {
  return isa == CpuIsa::Avx512 ? "avx512" : isa == CpuIsa::Avx2 ? "avx2" : "baseline";
}

// avx512: x86-64-v4 (AVX-512 F/BW/CD/DQ/VL); avx2: x86-64-v3 (AVX2, FMA, F16C, BMI); baseline: anything.
// Without variants (another compiler or architecture) the three are the same code: only baseline is offered.
inline bool cpu_supports(CpuIsa isa) {
  if (isa == CpuIsa::Baseline) return true;
#if CLEF_CPU_HAS_VARIANTS
  return isa == CpuIsa::Avx512 ? __builtin_cpu_supports("x86-64-v4") : __builtin_cpu_supports("x86-64-v3");
#else
  return false;
#endif
}

inline CpuIsa best_cpu_isa() {
  for (CpuIsa isa : {CpuIsa::Avx512, CpuIsa::Avx2})
    if (cpu_supports(isa)) return isa;
  return CpuIsa::Baseline;
}

// The process-wide choice (set_cpu_isa in cpu_isa_ops.cpp changes it). An op reads it once at its start,
// so a change never mixes two variants inside one op.
inline std::atomic<int>& cpu_isa_setting() {
  static std::atomic<int> setting{static_cast<int>(best_cpu_isa())};
  return setting;
}
inline CpuIsa cpu_isa() { return static_cast<CpuIsa>(cpu_isa_setting().load(std::memory_order_relaxed)); }

// How many times each variant was picked (name##_for, once per op call, outside the parallel loops), so a
// test can see which variant the kernels really ran: that CLEF_CPU_ISA reaches them, not just cpu_isa().
inline std::atomic<int64_t>* cpu_isa_call_counts() {
  static std::atomic<int64_t> counts[3];  // by CpuIsa
  return counts;
}
inline void count_cpu_isa_call(CpuIsa isa) {
  cpu_isa_call_counts()[static_cast<int>(isa)].fetch_add(1, std::memory_order_relaxed);
}

// 16 floats: one AVX-512 register, two AVX2 ones, four SSE ones. aligned(4) lets it load from any float
// address (load_v / store_v below). Used where the compiler's auto-vectoriser would not keep accumulators in
// registers.
typedef float vf16 __attribute__((vector_size(64), aligned(4)));
constexpr int kLanes = 16;

// Whether the variant in use has 32 512-bit vector registers. A vf16 takes one register there and two
// on AVX2 (16 256-bit registers), so a register block that fits AVX-512 spills to the stack on AVX2 on
// every step: callers with large register blocks pick a smaller one without it (measured 2026-12-01 on an
// AVX2 EPYC: attention prefill 11x slower than eager torch with the AVX-512 block).
inline bool has_512bit_registers(CpuIsa isa) { return isa == CpuIsa::Avx512; }

// 8 floats: one AVX2 register. Where a kernel's AVX2 variant holds its vectors in registers across a loop,
// vf16 is the wrong unit there: GCC splits each 64-byte vector into halves it moves through the stack (and
// general registers), measured 2026-12-06 in the delta rule's AVX2 sweep (4x-5x slower than the same sweep
// in AVX-512 on a Zen 4 core, whose 512-bit FMAs run at the 256-bit rate); a vf8 is one register.
typedef float vf8 __attribute__((vector_size(32), aligned(4)));
template <typename V>
constexpr int lanes_of = static_cast<int>(sizeof(V) / sizeof(float));
// Unaligned loads and stores of any float vector type: memcpy, since a typedef's aligned(4) does not survive as a
// template argument (GCC drops it: a plain dereference there assumes the vector's own alignment and faults).
template <typename V>
CLEF_INLINE V load_v(const float* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof(V));
  return v;
}
template <typename V>
CLEF_INLINE void store_v(float* p, V v) {
  __builtin_memcpy(p, &v, sizeof(V));
}

// exp for the CPU hot loops: libm's expf does not vectorise without -ffast-math, this does.
// Cephes' single-precision scheme (range reduction by ln2 split in two, degree-6 polynomial): ~1 ulp on
// the clamped range, which covers every value the callers feed it (softmax args <= 0, SiLU args);
// below -87.3 it returns 0.
CLEF_INLINE float exp_vec(float x) {
  if (x < -87.33654f) return 0.0f;  // below the smallest normal result: underflow to 0, like expf
  x = x > 88.0f ? 88.0f : x;
  float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float poly = 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  float y = poly * r * r + r + 1.0f;
  // Scale by 2^n; n + 127 stays in [1, 254] on the clamped range. memcpy, not a union, to stay defined.
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

CLEF_INLINE float silu_vec(float x) { return x / (1.0f + exp_vec(-x)); }

// exp_vec on a vector of any width, branch-free: the same reduction and polynomial, rounding n to nearest
// with the 1.5 * 2^23 trick (exact for |x log2 e| < 2^22, which the clamp guarantees). Below -88 the clamp
// gives n = -127, an all-zero scale, so the result is exactly 0 without a compare-and-select (the select
// version compiled to per-lane scalar compares inside the cloned kernels). V: a float vector, VI: the
// int32 vector of the same lanes.
template <typename V, typename VI>
CLEF_INLINE V exp_v(V x) {
  const V magic = V{} + 12582912.0f;
  x = x < V{} - 88.0f ? V{} - 88.0f : x;
  x = x > V{} + 88.0f ? V{} + 88.0f : x;
  const V n = (x * 1.44269504088896341f + magic) - magic;
  V r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V poly = V{} + 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  const V y = poly * r * r + r + 1.0f;
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;  // n = -127: 0.0f
  V scale;  // the bits as floats: memcpy, since a reinterpret_cast of the int vector broke strict aliasing
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}
// For any float vector V (vf16, vf8; a kernel's AVX2 variant instantiates them with vf8): exp, SiLU, and
// lanes_of<V> values of any storage type to/from fp32 lanes (the conversion loops vectorise: F16C, shifts).
template <typename V>
CLEF_INLINE V exp_any(V x) {
  typedef int32_t VI __attribute__((vector_size(sizeof(V))));
  return exp_v<V, VI>(x);
}
template <typename V>
CLEF_INLINE V silu_any(V x) {
  return x / (1.0f + exp_any(-x));
}
template <typename V, typename T>
CLEF_INLINE V load_as(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return load_v<V>(p);
  } else {
    V v;
    for (int i = 0; i < lanes_of<V>; ++i) v[i] = static_cast<float>(p[i]);
    return v;
  }
}
template <typename V, typename T>
CLEF_INLINE void store_from(T* p, V v) {
  if constexpr (std::is_same_v<T, float>) {
    store_v<V>(p, v);
  } else {
    for (int i = 0; i < lanes_of<V>; ++i) p[i] = T(v[i]);
  }
}

}  // namespace clef
