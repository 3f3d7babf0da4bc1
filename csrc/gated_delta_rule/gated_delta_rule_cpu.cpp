// CPU implementation of the gated delta rule: parallel over (sequence, value head, block of up to 32
// state columns); each work item keeps its [Dk, 32] slice of the fp32 state hot in L1 and walks the
// tokens in order. One sweep over the slice per token: it applies token t's update and, in the same
// sweep, accumulates the dot products token t+1 needs. The column step (gated_delta_rule.h) is the one
// the GPU kernel uses, here applied to 16 columns at a time.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <vector>

#include "common/cpu_kernel.h"
#include "gated_delta_rule/gated_delta_rule_launch.h"

namespace clef {
namespace {

constexpr int kColumnBlock = 32;  // two vectors of 16 columns; a partial block is zero-padded

struct TokenInputs {
  std::vector<float> k, q;    // normalised key, normalised and scaled query: [Dk]
  float v[kColumnBlock] = {};  // this block's value columns (zero past the head's last column)
  float decay = 1.0f, beta = 0.0f, kq = 0.0f;
};

CLEF_INLINE float hsum(vf16 v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// Rows of consecutive tokens are a head-stride apart (8-16 KB for clef-flash), so every token starts a
// new page and the hardware prefetchers, which stop at page boundaries, miss them all: fetch ahead.
constexpr int kPrefetchTokens = 4;

template <typename T>
CLEF_INLINE void prefetch_token(const GatedDeltaRuleParams& p, int64_t token, int hk, int hv, int c0) {
  const char* k = reinterpret_cast<const char*>(static_cast<const T*>(p.k) + gdr_k_offset(token, hk, p));
  const char* q = reinterpret_cast<const char*>(static_cast<const T*>(p.q) + gdr_q_offset(token, hk, p));
  const int bytes = p.head_k_dim * static_cast<int>(sizeof(T));
  for (int off = 0; off < bytes; off += 64) {
    __builtin_prefetch(k + off);
    __builtin_prefetch(q + off);
  }
  const char* v = reinterpret_cast<const char*>(static_cast<const T*>(p.v) + gdr_v_offset(token, hv, p) + c0);
  for (int off = 0; off < kColumnBlock * static_cast<int>(sizeof(T)); off += 64) __builtin_prefetch(v + off);
}

template <typename T>
CLEF_INLINE void load_token(const GatedDeltaRuleParams& p, int64_t token, int hk, int hv, int c0, int nc,
                            TokenInputs& in) {
  const T* k = static_cast<const T*>(p.k) + gdr_k_offset(token, hk, p);
  const T* q = static_cast<const T*>(p.q) + gdr_q_offset(token, hk, p);
  const T* v = static_cast<const T*>(p.v) + gdr_v_offset(token, hv, p) + c0;
  const int dk = p.head_k_dim;
  for (int d = 0; d < dk; ++d) {
    in.k[d] = to_f32(k[d]);
    in.q[d] = to_f32(q[d]);
  }
  // Sums of squares and k.q in 16 interleaved lanes (vectorises; the order differs from the GPU's warp
  // reduction only in fp32 rounding).
  vf16 ssk = {}, ssq = {}, kq = {};
  int d = 0;
  for (; d + kLanes <= dk; d += kLanes) {
    const vf16 kv = load_vf16(in.k.data() + d), qv = load_vf16(in.q.data() + d);
    ssk += kv * kv;
    ssq += qv * qv;
    kq += kv * qv;
  }
  float ssk_s = hsum(ssk), ssq_s = hsum(ssq), kq_s = hsum(kq);
  for (; d < dk; ++d) {
    ssk_s += in.k[d] * in.k[d];
    ssq_s += in.q[d] * in.q[d];
    kq_s += in.k[d] * in.q[d];
  }
  const float kf = gdr_key_factor(ssk_s, p.l2norm_qk);
  const float qf = gdr_query_factor(ssq_s, p.l2norm_qk, p.scale);
  for (d = 0; d < dk; ++d) {
    in.k[d] *= kf;
    in.q[d] *= qf;
  }
  in.kq = kq_s * kf * qf;
  for (int j = 0; j < kColumnBlock; ++j) in.v[j] = j < nc ? to_f32(v[j]) : 0.0f;
  const int64_t gate = gdr_gate_offset(token, hv, p);
  in.decay = exp_vec(p.g[gate]);
  in.beta = p.beta[gate];
}

// NV vectors of 16 columns (NV * 16 >= nc). Padding columns have v = 0 and a zero state, so their
// u is 0 and they stay exactly zero: no special case in the sweep.
template <typename T, int NV>
CLEF_INLINE void gdr_block(const GatedDeltaRuleParams& p, int b, int hv, int c0, int width, std::vector<float>& state,
                           TokenInputs& cur, TokenInputs& next) {
  const PackedSeq s = gdr_sequence(p, b);
  const int hk = gdr_key_head(hv, p.num_v_heads, p.num_k_heads);
  const int dk = p.head_k_dim;
  const int nc = std::min(width, p.head_v_dim - c0);
  // A full block of a sequence with a slot is updated in place in the state pool (rows Dv apart); a
  // partial block (zero-padded to `width` columns) or a sequence without a slot works on the scratch copy.
  const bool in_place = s.slot >= 0 && nc == width;
  float* S = in_place ? p.states + gdr_state_offset(s.slot, hv, 0, c0, p) : state.data();
  const int64_t ld = in_place ? p.head_v_dim : width;
  if (!in_place || !s.read_state)
    for (int i = 0; i < dk; ++i)
      for (int j = 0; j < width; ++j)
        S[i * ld + j] = (j < nc && s.read_state) ? p.states[gdr_state_offset(s.slot, hv, i, c0 + j, p)] : 0.0f;
  T* out = static_cast<T*>(p.out);

  // sk = S^T k_t and sq = S^T q_t for the current token, each in two halves (even / odd rows) so that
  // consecutive FMAs into one accumulator are two rows apart.
  vf16 sk_even[NV], sk_odd[NV], sq_even[NV], sq_odd[NV];
  auto clear = [&] {
    for (int v = 0; v < NV; ++v) sk_even[v] = sk_odd[v] = sq_even[v] = sq_odd[v] = vf16{};
  };
  if (s.len > 0) {
    load_token<T>(p, s.start, hk, hv, c0, nc, cur);
    clear();
    for (int i = 0; i + 1 < dk; i += 2) {
      for (int v = 0; v < NV; ++v) {
        const vf16 r0 = load_vf16(S + i * ld + kLanes * v);
        const vf16 r1 = load_vf16(S + (i + 1) * ld + kLanes * v);
        sk_even[v] += r0 * cur.k[i];
        sq_even[v] += r0 * cur.q[i];
        sk_odd[v] += r1 * cur.k[i + 1];
        sq_odd[v] += r1 * cur.q[i + 1];
      }
    }
    if (dk % 2)
      for (int v = 0; v < NV; ++v) {
        const vf16 r = load_vf16(S + (dk - 1) * ld + kLanes * v);
        sk_even[v] += r * cur.k[dk - 1];
        sq_even[v] += r * cur.q[dk - 1];
      }
  }
  for (int t = 0; t < s.len; ++t) {
    vf16 u[NV];
    float o[kColumnBlock];
    for (int v = 0; v < NV; ++v) {
      const GdrColumnStep<vf16> step = gdr_column_step(sk_even[v] + sk_odd[v], sq_even[v] + sq_odd[v],
                                                       load_vf16(cur.v + kLanes * v), cur.decay, cur.beta, cur.kq);
      u[v] = step.u;
      store_vf16(o + kLanes * v, step.o);
    }
    T* dst = out + gdr_out_offset(s.start + t, hv, p) + c0;
    for (int j = 0; j < nc; ++j) dst[j] = from_f32<T>(o[j]);
    const float decay = cur.decay;
    const bool more = t + 1 < s.len;
    if (t + kPrefetchTokens < s.len) prefetch_token<T>(p, s.start + t + kPrefetchTokens, hk, hv, c0);
    if (more) load_token<T>(p, s.start + t + 1, hk, hv, c0, nc, next);
    clear();
    const std::vector<float>& nk = more ? next.k : cur.k;  // unused sums when this is the last token
    const std::vector<float>& nq = more ? next.q : cur.q;
    // Rows in pairs: even rows feed the *_even sums, odd rows the *_odd ones.
    auto sweep_row = [&](int i, vf16* sk, vf16* sq) {
      const float ki = cur.k[i], nki = nk[i], nqi = nq[i];
      for (int v = 0; v < NV; ++v) {
        float* row = S + i * ld + kLanes * v;
        const vf16 updated = decay * load_vf16(row) + ki * u[v];
        store_vf16(row, updated);
        sk[v] += updated * nki;
        sq[v] += updated * nqi;
      }
    };
    int i = 0;
    for (; i + 1 < dk; i += 2) {
      sweep_row(i, sk_even, sq_even);
      sweep_row(i + 1, sk_odd, sq_odd);
    }
    if (i < dk) sweep_row(i, sk_even, sq_even);
    if (more) std::swap(cur, next);
  }
  if (s.slot >= 0 && !in_place)
    for (int i = 0; i < dk; ++i)
      for (int j = 0; j < nc; ++j) p.states[gdr_state_offset(s.slot, hv, i, c0 + j, p)] = S[i * ld + j];
}

template <typename T>
CLEF_INLINE void gdr_block_any_width(const GatedDeltaRuleParams& p, int b, int hv, int c0, int width,
                                     std::vector<float>& state, TokenInputs& cur, TokenInputs& next) {
  if (width > kLanes && p.head_v_dim - c0 > kLanes)
    gdr_block<T, 2>(p, b, hv, c0, width, state, cur, next);
  else
    gdr_block<T, 1>(p, b, hv, c0, width, state, cur, next);
}

}  // namespace

#define CLEF_GDR_CPU_ENTRY(name, T)                                                                \
  CLEF_CPU_VARIANTS(name,                                                                          \
                    (const GatedDeltaRuleParams& p, int b, int hv, int c0, int width, std::vector<float>& state, \
                     TokenInputs& cur, TokenInputs& next),                                         \
                    (p, b, hv, c0, width, state, cur, next), gdr_block_any_width<T>)
CLEF_GDR_CPU_ENTRY(gdr_block_f32, float)
CLEF_GDR_CPU_ENTRY(gdr_block_f16, c10::Half)
CLEF_GDR_CPU_ENTRY(gdr_block_bf16, c10::BFloat16)

void gated_delta_rule_cpu(const GatedDeltaRuleParams& p, ScalarKind kind) {
  const CpuIsa isa = cpu_isa();
  auto block_fn = kind == ScalarKind::F32   ? gdr_block_f32_for(isa)
                  : kind == ScalarKind::F16 ? gdr_block_f16_for(isa)
                                            : gdr_block_bf16_for(isa);
  // 32 columns keep 8 vf16 accumulators plus the update in registers with AVX-512; with AVX2 (two 256-bit
  // registers per vf16, 16 in all) they spill on every row, so there a block is 16 columns. Columns are
  // independent: the width changes no result.
  const int width = has_512bit_registers(isa) ? kColumnBlock : kLanes;
  const int column_blocks = (p.head_v_dim + width - 1) / width;
  const int64_t items = static_cast<int64_t>(p.batch) * p.num_v_heads * column_blocks;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> state(static_cast<size_t>(p.head_k_dim) * kColumnBlock);
    TokenInputs cur, next;
    for (TokenInputs* in : {&cur, &next}) {
      in->k.resize(p.head_k_dim);
      in->q.resize(p.head_k_dim);
    }
    for (int64_t item = begin; item < end; ++item) {
      const int cb = static_cast<int>(item % column_blocks);
      const int hv = static_cast<int>((item / column_blocks) % p.num_v_heads);
      const int b = static_cast<int>(item / (static_cast<int64_t>(column_blocks) * p.num_v_heads));
      block_fn(p, b, hv, cb * width, width, state, cur, next);
    }
  });
}

}  // namespace clef
