// The trunk's glue between the GEMMs and the mixer kernels, fused: residual add + RMSNorm, SiLU(gate) x up,
// the delta net's gated RMSNorm x SiLU(z), q/k RMSNorm + RoPE (M-RoPE through per-token cos/sin) + cast,
// and the attention output's sigmoid gate. Parameters and the per-element math shared by the CUDA kernels
// (glue_kernels.cuh) and the CPU implementation (glue_cpu.cpp). Math in fp32, each output rounded once to
// the serving dtype T; eager torch rounded after every step.
//
// Layouts (T: the serving dtype; rows are tokens unless said):
//   add_rms_norm    x [rows, cols] fp32 in/out (x += delta), delta [rows, cols] T or none, scale [cols] fp32,
//                   out [rows, cols] T = x * rsqrt(mean(x^2) + eps) * scale
//   silu_mul        gate_up [rows, 2 I] T (gate | up), out [rows, I] T = silu(gate) * up
//   gated_rms_norm  core [tokens, heads * dim] T, z [tokens, heads * dim] T (rows z_token_stride apart),
//                   weight [dim] fp32, out [tokens, heads * dim] T = rmsnorm(core head) * weight * silu(z)
//   rms_norm_rope   x [tokens, heads, dim] T (any token/head stride), scale [dim] fp32, cos/sin [tokens,
//                   rotary/2] fp32, out [tokens, heads, dim] T: rmsnorm * scale, then NeoX rotate-half on the
//                   first `rotary` dims
//   sigmoid_gate    attn [tokens, heads, dim] T, gate [tokens, heads, dim] T (any token/head stride),
//                   out [tokens, heads * dim] T = attn * sigmoid(gate)
#pragma once

#include "common/hd.h"

namespace clef {

struct AddRmsNormParams {
  float* x = nullptr;
  const void* delta = nullptr;  // null: no residual add (the first layer's input norm)
  void* out = nullptr;
  const float* scale = nullptr;
  int64_t rows = 0;
  int cols = 0;
  float eps = 1e-6f;
};

struct SiluMulParams {
  const void* gate_up = nullptr;
  void* out = nullptr;
  int64_t rows = 0;
  int cols = 0;  // I: half of gate_up's row
};

struct GatedRmsNormParams {
  const void* core = nullptr;
  const void* z = nullptr;
  int64_t z_token_stride = 0;
  void* out = nullptr;
  const float* weight = nullptr;
  int64_t tokens = 0;
  int heads = 0, dim = 0;
  float eps = 1e-6f;
};

struct RmsNormRopeParams {
  const void* x = nullptr;
  int64_t x_token_stride = 0, x_head_stride = 0;
  void* out = nullptr;
  const float* scale = nullptr;
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t tokens = 0;
  int heads = 0, dim = 0, rotary_half = 0;
  float eps = 1e-6f;
};

struct SigmoidGateParams {
  const void* attn = nullptr;
  const void* gate = nullptr;
  int64_t gate_token_stride = 0, gate_head_stride = 0;
  void* out = nullptr;
  int64_t tokens = 0;
  int heads = 0, dim = 0;
};

CLEF_HD float rms_factor(float sum_of_squares, int n, float eps) { return rsqrt_f32(sum_of_squares / n + eps); }

CLEF_HD float sigmoid_f32(float x) { return 1.0f / (1.0f + exp_f32(-x)); }

// NeoX rotate-half: element d of a head (normed value xd, its partner xp) at rotary frequency j = d mod half.
CLEF_HD float rope_value(float xd, float xp, int d, int half, float c, float s) {
  return d < half ? xd * c - xp * s : xd * c + xp * s;
}

}  // namespace clef
