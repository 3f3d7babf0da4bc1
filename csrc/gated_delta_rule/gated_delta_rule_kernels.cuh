// CUDA kernels for the gated delta rule (device code only; see conv1d_kernels.cuh for who compiles it): the
// token-serial kernel here, the chunked tensor-core one in gated_delta_rule_chunked.cuh (included below).
//
// Serial: one CTA owns (sequence, value head, block of BV state columns) and walks the sequence's tokens in
// order. Thread (rg, j) keeps rows [rg*R, rg*R + R) of column j of the fp32 state in registers; per
// token the RG row groups' partial dot products meet in shared memory (double-buffered, one barrier
// per token). The same kernel serves prefill chunks (cu_seqlens) and decode (one token per sequence).
#pragma once

#include "common/cuda_utils.cuh"
#include "gated_delta_rule/gated_delta_rule.h"

namespace clef {

constexpr int kGdrThreads = 128;
constexpr int kGdrTileTokens = 8;

template <int DV>
struct GdrTiling {
  static constexpr int kColumns = DV < 32 ? DV : 32;            // BV: state columns per CTA
  static constexpr int kRowGroups = kGdrThreads / kColumns;     // RG
};

// Min 1 block per SM: without it ptxas aims at an occupancy target and spilled 16 bytes on sm_70 at
// Dk = Dv = 32 in f16/bf16 (8 on sm_90 at 128 with a 5-block target). With it no arch spills (85-150
// registers: 3 CTAs per SM at Dk = 128), and occupancy is not what bounds this kernel: clef-flash's grid
// is Dv / 32 x Hv = 128 CTAs a record, under two per SM on a V100.
template <typename T, int DK, int DV>
__global__ void __launch_bounds__(kGdrThreads, 1) gated_delta_rule_kernel(GatedDeltaRuleParams p) {
  constexpr int BV = GdrTiling<DV>::kColumns;
  constexpr int RG = GdrTiling<DV>::kRowGroups;
  constexpr int R = DK / RG;  // state rows per thread
  constexpr int TT = kGdrTileTokens;
  static_assert(DK % RG == 0 && R >= 1, "head_k_dim must split evenly over the row groups");
  static_assert(kGdrThreads % 32 == 0 && TT % (kGdrThreads / 32) == 0, "token tile must split over warps");

  __shared__ float k_s[TT][DK];
  __shared__ float q_s[TT][DK];
  __shared__ float v_s[TT][BV];
  __shared__ float decay_s[TT];
  __shared__ float beta_s[TT];
  __shared__ float kq_s[TT];
  __shared__ float red_k[2][RG][BV];
  __shared__ float red_q[2][RG][BV];

  const int j = threadIdx.x % BV;
  const int rg = threadIdx.x / BV;
  const int col0 = blockIdx.x * BV;
  const int col = col0 + j;
  const int hv = blockIdx.y;
  const int b = blockIdx.z;
  const int hk = gdr_key_head(hv, p.num_v_heads, p.num_k_heads);
  const PackedSeq s = gdr_sequence(p, b);
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  T* out = static_cast<T*>(p.out);

  float S[R];
#pragma unroll
  for (int m = 0; m < R; ++m) S[m] = s.read_state ? p.states[gdr_state_offset(s.slot, hv, rg * R + m, col, p)] : 0.0f;

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  for (int t0 = 0; t0 < s.len; t0 += TT) {
    const int n = min_int(TT, s.len - t0);
    // Stage this tile's q, k (all Dk), v (this CTA's columns), decay and beta; coalesced along Dk.
    for (int e = threadIdx.x; e < TT * DK; e += kGdrThreads) {
      const int tt = e / DK, d = e % DK;
      const bool live = tt < n;
      k_s[tt][d] = live ? to_f32(k[gdr_k_offset(s.start + t0 + tt, hk, p) + d]) : 0.0f;
      q_s[tt][d] = live ? to_f32(q[gdr_q_offset(s.start + t0 + tt, hk, p) + d]) : 0.0f;
    }
    for (int e = threadIdx.x; e < TT * BV; e += kGdrThreads) {
      const int tt = e / BV, jj = e % BV;
      v_s[tt][jj] = tt < n ? to_f32(v[gdr_v_offset(s.start + t0 + tt, hv, p) + col0 + jj]) : 0.0f;
    }
    if (threadIdx.x < TT) {
      const int tt = threadIdx.x;
      const int64_t gate = gdr_gate_offset(s.start + t0 + tt, hv, p);
      decay_s[tt] = tt < n ? exp_f32(p.g[gate]) : 1.0f;
      beta_s[tt] = tt < n ? p.beta[gate] : 0.0f;
    }
    __syncthreads();
    // Normalise k and q per token (a warp per token), and keep k.q for the output formula.
    for (int tt = warp; tt < TT; tt += kGdrThreads / 32) {
      float ssk = 0.0f, ssq = 0.0f, kq = 0.0f;
      for (int d = lane; d < DK; d += 32) {
        ssk += k_s[tt][d] * k_s[tt][d];
        ssq += q_s[tt][d] * q_s[tt][d];
        kq += k_s[tt][d] * q_s[tt][d];
      }
      ssk = group_sum<32>(ssk);
      ssq = group_sum<32>(ssq);
      kq = group_sum<32>(kq);
      const float kf = gdr_key_factor(ssk, p.l2norm_qk);
      const float qf = gdr_query_factor(ssq, p.l2norm_qk, p.scale);
      for (int d = lane; d < DK; d += 32) {
        k_s[tt][d] *= kf;
        q_s[tt][d] *= qf;
      }
      if (lane == 0) kq_s[tt] = kq * kf * qf;
    }
    __syncthreads();

    for (int tt = 0; tt < n; ++tt) {
      float sk = 0.0f, sq = 0.0f;
#pragma unroll
      for (int m = 0; m < R; ++m) {
        sk += S[m] * k_s[tt][rg * R + m];
        sq += S[m] * q_s[tt][rg * R + m];
      }
      // Double buffer: a thread can only get two tokens ahead after every thread passed the next barrier.
      const int buf = tt & 1;
      red_k[buf][rg][j] = sk;
      red_q[buf][rg][j] = sq;
      __syncthreads();
      float col_k = 0.0f, col_q = 0.0f;
#pragma unroll
      for (int r = 0; r < RG; ++r) {
        col_k += red_k[buf][r][j];
        col_q += red_q[buf][r][j];
      }
      const GdrColumnStep<float> step = gdr_column_step(col_k, col_q, v_s[tt][j], decay_s[tt], beta_s[tt], kq_s[tt]);
      if (rg == 0) out[gdr_out_offset(s.start + t0 + tt, hv, p) + col] = from_f32<T>(step.o);
#pragma unroll
      for (int m = 0; m < R; ++m) S[m] = decay_s[tt] * S[m] + k_s[tt][rg * R + m] * step.u;
    }
    __syncthreads();  // the next tile overwrites the staged rows
  }

  if (s.slot >= 0) {
#pragma unroll
    for (int m = 0; m < R; ++m) p.states[gdr_state_offset(s.slot, hv, rg * R + m, col, p)] = S[m];
  }
}

}  // namespace clef

#include "gated_delta_rule/gated_delta_rule_chunked.cuh"  // the chunked kernel's three passes
