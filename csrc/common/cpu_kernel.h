// Helpers for the CPU implementations (host only, never seen by nvcc or NVRTC).
#pragma once

#include <cstdint>
#include <cstring>

// Hot CPU loops are compiled three times (AVX-512, AVX2+FMA, baseline x86-64) and the loader picks the
// best one the machine has, so one wheel runs everywhere and still vectorises. Apply it only to
// non-template functions (GCC's target_clones does not support templates) that inline the body.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(CLEF_NO_TARGET_CLONES)
#define CLEF_CPU_KERNEL __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLEF_CPU_KERNEL
#endif
#define CLEF_INLINE inline __attribute__((always_inline))

namespace clef {

// exp for the CPU hot loops: libm's expf does not vectorise without -ffast-math, this does.
// Cephes' single-precision scheme (range reduction by ln2 split in two, degree-6 polynomial): ~1 ulp on
// the clamped range, which covers every value the callers feed it (softmax args <= 0, SiLU args).
CLEF_INLINE float exp_vec(float x) {
  x = x < -87.33654f ? -87.33654f : (x > 88.0f ? 88.0f : x);
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

}  // namespace clef
