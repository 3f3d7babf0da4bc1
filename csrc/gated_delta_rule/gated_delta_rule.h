// Gated delta rule over packed variable-length sequences: parameters and the index/math functions
// shared by the CUDA kernels (gated_delta_rule_kernels.cuh) and the CPU implementation.
//
// Per value head h (key head h / (Hv/Hk)), fp32 state S [Dk, Dv], for each token t:
//   S' = exp(g_t) S;  u_t = beta_t (v_t - S'^T k_t);  S = S' + k_t u_t^T;  o_t = S^T q_t
// with k, q optionally L2-normalised per head and q scaled. Column j of S evolves on its own (it only
// sees v_t[j]), which is how both the CPU and GPU split the work: by (sequence, value head, columns).
//
// Layout:
//   q, k   [num_tokens, Hk, Dk]  last dim contiguous, any token/head stride (views of the conv output)
//   v      [num_tokens, Hv, Dv]  likewise
//   g      [num_tokens, Hv] fp32 log decay (<= 0), contiguous
//   beta   [num_tokens, Hv] fp32, contiguous
//   states [num_slots, Hv, Dk, Dv] fp32, contiguous, read through state_indices and written back
//   out    [num_tokens, Hv, Dv]  contiguous, dtype of v
// cu_seqlens == null is the recurrent (decode) mode: sequence b is the single token b.
#pragma once

#include "common/hd.h"

namespace clef {

struct GatedDeltaRuleParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t q_token_stride = 0, q_head_stride = 0;
  int64_t k_token_stride = 0, k_head_stride = 0;
  int64_t v_token_stride = 0, v_head_stride = 0;
  const float* g = nullptr;
  const float* beta = nullptr;
  float* states = nullptr;
  void* out = nullptr;
  const int32_t* cu_seqlens = nullptr;      // [batch + 1]; null in recurrent mode
  const int32_t* state_indices = nullptr;   // [batch]
  const bool* has_initial_state = nullptr;  // [batch]; null means "read the slot" (recurrent mode)
  int64_t num_tokens = 0;
  int batch = 0;
  int num_k_heads = 0, num_v_heads = 0;
  int head_k_dim = 0, head_v_dim = 0;
  int num_slots = 0;
  float scale = 1.0f;
  bool l2norm_qk = true;
};

CLEF_HD PackedSeq gdr_sequence(const GatedDeltaRuleParams& p, int b) {
  return packed_sequence(p.cu_seqlens, p.num_tokens, p.state_indices, p.has_initial_state, p.num_slots, b);
}

// Grouped value heads: each key head serves Hv/Hk consecutive value heads (indexed, never repeated).
CLEF_HD int gdr_key_head(int value_head, int num_v_heads, int num_k_heads) {
  return value_head / (num_v_heads / num_k_heads);
}

CLEF_HD int64_t gdr_state_offset(int slot, int value_head, int i, int j, const GatedDeltaRuleParams& p) {
  return ((static_cast<int64_t>(slot) * p.num_v_heads + value_head) * p.head_k_dim + i) * p.head_v_dim + j;
}

CLEF_HD int64_t gdr_q_offset(int64_t token, int key_head, const GatedDeltaRuleParams& p) {
  return token * p.q_token_stride + key_head * p.q_head_stride;
}
CLEF_HD int64_t gdr_k_offset(int64_t token, int key_head, const GatedDeltaRuleParams& p) {
  return token * p.k_token_stride + key_head * p.k_head_stride;
}
CLEF_HD int64_t gdr_v_offset(int64_t token, int value_head, const GatedDeltaRuleParams& p) {
  return token * p.v_token_stride + value_head * p.v_head_stride;
}
CLEF_HD int64_t gdr_out_offset(int64_t token, int value_head, const GatedDeltaRuleParams& p) {
  return (token * p.num_v_heads + value_head) * p.head_v_dim;
}
CLEF_HD int64_t gdr_gate_offset(int64_t token, int value_head, const GatedDeltaRuleParams& p) {
  return token * p.num_v_heads + value_head;
}

// Factor that L2-normalises a key head vector with the given sum of squares (eps as FLA/transformers).
CLEF_HD float gdr_key_factor(float sum_squares, bool l2norm) { return l2norm ? rsqrt_f32(sum_squares + 1e-6f) : 1.0f; }
CLEF_HD float gdr_query_factor(float sum_squares, bool l2norm, float scale) {
  return gdr_key_factor(sum_squares, l2norm) * scale;
}

// One token's update of state column j, given the column's dot products with the (normalised) key and
// query, sk = S[:, j] . k and sq = S[:, j] . q, taken *before* this token's decay:
//   u = beta (v - decay sk),   o = S_new[:, j] . q = decay sq + u (k . q)
// V is float on the GPU (a thread per column) and a vector of columns on the CPU.
template <typename V>
struct GdrColumnStep {
  V u;  // the delta written into the column: S_new[:, j] = decay S[:, j] + k u
  V o;  // the output o_t[j]
};
template <typename V>
CLEF_HD GdrColumnStep<V> gdr_column_step(V sk, V sq, V v, float decay, float beta, float kq) {
  GdrColumnStep<V> r;
  r.u = beta * (v - decay * sk);
  r.o = decay * sq + r.u * kq;
  return r;
}

}  // namespace clef
