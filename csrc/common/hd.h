// Torch-free helpers shared by the CUDA kernels (nvcc, NVRTC) and the CPU implementations (g++).
//
// Everything that decides *where* a value lives (which channel, band, head, slot, page) or *how* it is
// combined (SiLU, decay, the delta-rule column update, softmax rescaling) is written once here or in a
// family's params header as CLEF_HD functions, so the CPU tests run the same index math the GPU runs.
#pragma once

#if defined(__CUDACC_RTC__)
// NVRTC has no C++ standard library; cuda/std gives the fixed-width integers.
#include <cuda/std/cstdint>
#elif !defined(__CUDACC__)
#include <cmath>
#include <cstdint>
#else
#include <cstdint>
#endif

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define CLEF_HD __host__ __device__ __forceinline__
#define CLEF_DEVICE_CODE 1
#else
#define CLEF_HD inline
#endif

namespace clef {

#if defined(__CUDACC_RTC__)
using cuda::std::int32_t;
using cuda::std::int64_t;
using cuda::std::int8_t;
using cuda::std::uint8_t;
#else
using std::int32_t;
using std::int64_t;
using std::int8_t;
using std::uint8_t;
#endif

// Element types the ops accept for activations. Math is always fp32.
enum class ScalarKind : int { F32 = 0, F16 = 1, BF16 = 2 };

// ---- conversions ---------------------------------------------------------------------------------
CLEF_HD float to_f32(float x) { return x; }
template <typename T>
CLEF_HD T from_f32(float x);
template <>
CLEF_HD float from_f32<float>(float x) {
  return x;
}

#if defined(CLEF_DEVICE_CODE)
// torch builds .cu files with __CUDA_NO_HALF_CONVERSIONS__, so convert through the intrinsics.
CLEF_HD float to_f32(__half x) { return __half2float(x); }
CLEF_HD float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
CLEF_HD __half from_f32<__half>(float x) {
  return __float2half_rn(x);
}
template <>
CLEF_HD __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
#else
// Host: c10::Half / c10::BFloat16 (and the CUDA simulator's aliases of them) convert themselves,
// rounding to nearest even like __float2half_rn.
template <typename T>
inline float to_f32(T x) {
  return static_cast<float>(x);
}
template <typename T>
inline T from_f32(float x) {
  return T(x);
}
#endif

// ---- math ----------------------------------------------------------------------------------------
CLEF_HD float exp_f32(float x) {
#if defined(CLEF_DEVICE_CODE)
  return expf(x);
#else
  return std::exp(x);
#endif
}

CLEF_HD float rsqrt_f32(float x) {
#if defined(CLEF_DEVICE_CODE)
  return rsqrtf(x);
#else
  return 1.0f / std::sqrt(x);
#endif
}

// x = m 2^e with m in [0.5, 1) (x = 0: m = e = 0), and m 2^e: how a power-of-two scale is picked and applied
// exactly.
CLEF_HD float frexp_f32(float x, int* e) {
#if defined(CLEF_DEVICE_CODE)
  return frexpf(x, e);
#else
  return std::frexp(x, e);
#endif
}

CLEF_HD float ldexp_f32(float m, int e) {
#if defined(CLEF_DEVICE_CODE)
  return ldexpf(m, e);
#else
  return std::ldexp(m, e);
#endif
}

CLEF_HD float silu_f32(float x) { return x / (1.0f + exp_f32(-x)); }

CLEF_HD float max_f32(float a, float b) { return a > b ? a : b; }

CLEF_HD int min_int(int a, int b) { return a < b ? a : b; }

CLEF_HD int max_int(int a, int b) { return a > b ? a : b; }

CLEF_HD int ceil_div(int a, int b) { return (a + b - 1) / b; }

CLEF_HD bool aligned_16_bytes(const void* ptr) { return reinterpret_cast<unsigned long long>(ptr) % 16 == 0; }

// A very negative finite stand-in for -inf: keeps exp(m_old - m_new) finite when a softmax row has seen
// no key yet, and behaves identically under fast-math and NVRTC (no INFINITY macro needed).
constexpr float kNegInf = -1.0e30f;

// ---- packed batches with per-sequence state slots -------------------------------------------------
// Sequence b of a pack owns tokens [cu_seqlens[b], cu_seqlens[b+1]); cu_seqlens == null means one token
// per sequence (decode: sequence b is token b). state_indices[b] < 0: no slot (start from zeros, save
// nothing). has_initial_state == null means "read the slot". Out-of-range metadata yields an empty
// sequence or no slot, so a kernel can never read or write outside its tensors.
struct PackedSeq {
  int64_t start;
  int len;
  int slot;         // -1: no slot
  bool read_state;  // the initial state comes from the slot (else zeros)
};

CLEF_HD PackedSeq packed_sequence(const int32_t* cu_seqlens, int64_t num_tokens, const int32_t* state_indices,
                                  const bool* has_initial_state, int num_slots, int b) {
  PackedSeq s;
  if (cu_seqlens != nullptr) {
    s.start = cu_seqlens[b];
    int64_t end = cu_seqlens[b + 1];
    if (s.start < 0 || end > num_tokens || end < s.start) end = s.start = 0;
    s.len = static_cast<int>(end - s.start);
  } else {
    s.start = b;
    s.len = 1;
  }
  const int slot = state_indices[b];
  s.slot = (slot >= 0 && slot < num_slots) ? slot : -1;
  s.read_state = s.slot >= 0 && (has_initial_state == nullptr || has_initial_state[b]);
  return s;
}

}  // namespace clef
