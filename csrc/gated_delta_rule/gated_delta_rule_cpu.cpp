// CPU implementation of the gated delta rule: parallel over (sequence, value head, block of up to 32
// state columns); each work item keeps its [Dk, <=32] slice of the fp32 state hot in L1 and walks the
// tokens in order. One pass over the slice per token: it applies token t's update and, in the same
// sweep, takes the dot products token t+1 needs (the column step in gated_delta_rule.h is shared with
// the GPU kernel).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <vector>

#include "common/cpu_kernel.h"
#include "gated_delta_rule/gated_delta_rule_launch.h"

namespace clef {
namespace {

constexpr int kColumnBlock = 32;

struct TokenInputs {
  std::vector<float> k, q;
  float v[kColumnBlock];
  float decay = 1.0f, beta = 0.0f, kq = 0.0f;
};

template <typename T>
CLEF_INLINE void load_token(const GatedDeltaRuleParams& p, int64_t token, int hk, int hv, int c0, int nc,
                            TokenInputs& in) {
  const T* k = static_cast<const T*>(p.k) + gdr_k_offset(token, hk, p);
  const T* q = static_cast<const T*>(p.q) + gdr_q_offset(token, hk, p);
  const T* v = static_cast<const T*>(p.v) + gdr_v_offset(token, hv, p) + c0;
  const int dk = p.head_k_dim;
  float ssk = 0.0f, ssq = 0.0f, kq = 0.0f;
  for (int d = 0; d < dk; ++d) {
    const float kd = to_f32(k[d]), qd = to_f32(q[d]);
    in.k[d] = kd;
    in.q[d] = qd;
    ssk += kd * kd;
    ssq += qd * qd;
    kq += kd * qd;
  }
  const float kf = gdr_key_factor(ssk, p.l2norm_qk);
  const float qf = gdr_query_factor(ssq, p.l2norm_qk, p.scale);
  for (int d = 0; d < dk; ++d) {
    in.k[d] *= kf;
    in.q[d] *= qf;
  }
  in.kq = kq * kf * qf;
  for (int j = 0; j < nc; ++j) in.v[j] = to_f32(v[j]);
  const int64_t gate = gdr_gate_offset(token, hv, p);
  in.decay = exp_vec(p.g[gate]);
  in.beta = p.beta[gate];
}

template <typename T>
CLEF_INLINE void gdr_block(const GatedDeltaRuleParams& p, int b, int hv, int c0, std::vector<float>& state) {
  const GdrSeq s = gdr_sequence(p, b);
  const int hk = gdr_key_head(hv, p.num_v_heads, p.num_k_heads);
  const int dk = p.head_k_dim;
  const int nc = std::min(kColumnBlock, p.head_v_dim - c0);
  float* S = state.data();  // [dk][kColumnBlock], row i = S[i, c0 : c0 + nc]
  for (int i = 0; i < dk; ++i)
    for (int j = 0; j < nc; ++j) S[i * kColumnBlock + j] = s.read_state ? p.states[gdr_state_offset(s.slot, hv, i, c0 + j, p)] : 0.0f;

  TokenInputs cur, next;
  cur.k.resize(dk);
  cur.q.resize(dk);
  next.k.resize(dk);
  next.q.resize(dk);
  // sk[j] = S[:, j] . k_t and sq[j] = S[:, j] . q_t, accumulated in two interleaved halves (even and odd
  // rows) so consecutive FMAs do not wait on each other.
  float sk[2][kColumnBlock], sq[2][kColumnBlock], u[kColumnBlock];
  T* out = static_cast<T*>(p.out);

  if (s.len > 0) {
    load_token<T>(p, s.start, hk, hv, c0, nc, cur);
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < kColumnBlock; ++j) sk[h][j] = sq[h][j] = 0.0f;
    for (int i = 0; i < dk; ++i) {
      const float* row = S + i * kColumnBlock;
      const int h = i & 1;
      for (int j = 0; j < nc; ++j) {
        sk[h][j] += row[j] * cur.k[i];
        sq[h][j] += row[j] * cur.q[i];
      }
    }
  }
  for (int t = 0; t < s.len; ++t) {
    T* o = out + gdr_out_offset(s.start + t, hv, p) + c0;
    for (int j = 0; j < nc; ++j) {
      const GdrColumnStep step = gdr_column_step(sk[0][j] + sk[1][j], sq[0][j] + sq[1][j], cur.v[j], cur.decay, cur.beta, cur.kq);
      u[j] = step.u;
      o[j] = from_f32<T>(step.o);
    }
    const float decay = cur.decay;
    if (t + 1 < s.len) {
      load_token<T>(p, s.start + t + 1, hk, hv, c0, nc, next);
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < kColumnBlock; ++j) sk[h][j] = sq[h][j] = 0.0f;
      for (int i = 0; i < dk; ++i) {
        float* row = S + i * kColumnBlock;
        const float ki = cur.k[i], nk = next.k[i], nq = next.q[i];
        const int h = i & 1;
        for (int j = 0; j < nc; ++j) {
          const float updated = decay * row[j] + ki * u[j];
          row[j] = updated;
          sk[h][j] += updated * nk;
          sq[h][j] += updated * nq;
        }
      }
      std::swap(cur, next);
    } else {
      for (int i = 0; i < dk; ++i) {
        float* row = S + i * kColumnBlock;
        const float ki = cur.k[i];
        for (int j = 0; j < nc; ++j) row[j] = decay * row[j] + ki * u[j];
      }
    }
  }
  if (s.slot >= 0)
    for (int i = 0; i < dk; ++i)
      for (int j = 0; j < nc; ++j) p.states[gdr_state_offset(s.slot, hv, i, c0 + j, p)] = S[i * kColumnBlock + j];
}

}  // namespace

CLEF_CPU_KERNEL void gdr_block_f32(const GatedDeltaRuleParams& p, int b, int hv, int c0, std::vector<float>& state) {
  gdr_block<float>(p, b, hv, c0, state);
}
CLEF_CPU_KERNEL void gdr_block_f16(const GatedDeltaRuleParams& p, int b, int hv, int c0, std::vector<float>& state) {
  gdr_block<c10::Half>(p, b, hv, c0, state);
}
CLEF_CPU_KERNEL void gdr_block_bf16(const GatedDeltaRuleParams& p, int b, int hv, int c0, std::vector<float>& state) {
  gdr_block<c10::BFloat16>(p, b, hv, c0, state);
}

void gated_delta_rule_cpu(const GatedDeltaRuleParams& p, ScalarKind kind) {
  auto block_fn = kind == ScalarKind::F32 ? gdr_block_f32 : kind == ScalarKind::F16 ? gdr_block_f16 : gdr_block_bf16;
  const int column_blocks = (p.head_v_dim + kColumnBlock - 1) / kColumnBlock;
  const int64_t items = static_cast<int64_t>(p.batch) * p.num_v_heads * column_blocks;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> state(static_cast<size_t>(p.head_k_dim) * kColumnBlock);
    for (int64_t item = begin; item < end; ++item) {
      const int cb = static_cast<int>(item % column_blocks);
      const int hv = static_cast<int>((item / column_blocks) % p.num_v_heads);
      const int b = static_cast<int>(item / (static_cast<int64_t>(column_blocks) * p.num_v_heads));
      block_fn(p, b, hv, cb * kColumnBlock, state);
    }
  });
}

}  // namespace clef
