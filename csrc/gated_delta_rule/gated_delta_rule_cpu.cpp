// CPU implementation of the gated delta rule: parallel over (sequence, value head, block of up to 32
// state columns: 16 on AVX2 and baseline); each work item keeps its [Dk, block] slice of the fp32 state hot
// in L1 and walks the tokens in order. One sweep over the slice per token: it applies token t's update and,
// in the same sweep, accumulates the dot products token t+1 needs. The column step (gated_delta_rule.h) is
// the one the GPU kernel uses, here applied to one vector of columns (16, or 8 on AVX2) at a time.
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

template <typename V>
CLEF_INLINE float hsum(V v) {
  float s = 0.0f;
  for (int i = 0; i < lanes_of<V>; ++i) s += v[i];
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

template <typename T, typename V>
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
  // Sums of squares and k.q in interleaved lanes, one vector V wide (vectorises; the order differs from the
  // GPU's warp reduction only in fp32 rounding).
  constexpr int L = lanes_of<V>;
  V ssk = {}, ssq = {}, kq = {};
  int d = 0;
  for (; d + L <= dk; d += L) {
    const V kv = load_v<V>(in.k.data() + d), qv = load_v<V>(in.q.data() + d);
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

// NV vectors V of lanes_of<V> columns each (NV lanes >= nc). Padding columns have v = 0 and a zero state, so
// their u is 0 and they stay exactly zero: no special case in the sweep.
template <typename T, typename V, int NV>
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

  constexpr int L = lanes_of<V>;
  // sk = S^T k_t and sq = S^T q_t for the current token, each in two halves (even / odd rows) so that
  // consecutive FMAs into one accumulator are two rows apart.
  V sk_even[NV], sk_odd[NV], sq_even[NV], sq_odd[NV];
  auto clear = [&] {
    for (int v = 0; v < NV; ++v) sk_even[v] = sk_odd[v] = sq_even[v] = sq_odd[v] = V{};
  };
  if (s.len > 0) {
    load_token<T, V>(p, s.start, hk, hv, c0, nc, cur);
    clear();
    for (int i = 0; i + 1 < dk; i += 2) {
      for (int v = 0; v < NV; ++v) {
        const V r0 = load_v<V>(S + i * ld + L * v);
        const V r1 = load_v<V>(S + (i + 1) * ld + L * v);
        sk_even[v] += r0 * cur.k[i];
        sq_even[v] += r0 * cur.q[i];
        sk_odd[v] += r1 * cur.k[i + 1];
        sq_odd[v] += r1 * cur.q[i + 1];
      }
    }
    if (dk % 2)
      for (int v = 0; v < NV; ++v) {
        const V r = load_v<V>(S + (dk - 1) * ld + L * v);
        sk_even[v] += r * cur.k[dk - 1];
        sq_even[v] += r * cur.q[dk - 1];
      }
  }
  for (int t = 0; t < s.len; ++t) {
    V u[NV];
    float o[kColumnBlock];
    for (int v = 0; v < NV; ++v) {
      const GdrColumnStep<V> step = gdr_column_step(sk_even[v] + sk_odd[v], sq_even[v] + sq_odd[v],
                                                    load_v<V>(cur.v + L * v), cur.decay, cur.beta, cur.kq);
      u[v] = step.u;
      store_v<V>(o + L * v, step.o);
    }
    T* dst = out + gdr_out_offset(s.start + t, hv, p) + c0;
    for (int j = 0; j < nc; ++j) dst[j] = from_f32<T>(o[j]);
    const float decay = cur.decay;
    const bool more = t + 1 < s.len;
    if (t + kPrefetchTokens < s.len) prefetch_token<T>(p, s.start + t + kPrefetchTokens, hk, hv, c0);
    if (more) load_token<T, V>(p, s.start + t + 1, hk, hv, c0, nc, next);
    clear();
    const std::vector<float>& nk = more ? next.k : cur.k;  // unused sums when this is the last token
    const std::vector<float>& nq = more ? next.q : cur.q;
    // Rows in pairs: even rows feed the *_even sums, odd rows the *_odd ones.
    auto sweep_row = [&](int i, V* sk, V* sq) {
      const float ki = cur.k[i], nki = nk[i], nqi = nq[i];
      for (int v = 0; v < NV; ++v) {
        float* row = S + i * ld + L * v;
        const V updated = decay * load_v<V>(row) + ki * u[v];
        store_v<V>(row, updated);
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

// A block is two vectors V wide (gated_delta_rule_cpu's width); one where the head has no more columns.
template <typename T, typename V>
CLEF_INLINE void gdr_block_any_width(const GatedDeltaRuleParams& p, int b, int hv, int c0, int width,
                                     std::vector<float>& state, TokenInputs& cur, TokenInputs& next) {
  if (width > lanes_of<V> && p.head_v_dim - c0 > lanes_of<V>)
    gdr_block<T, V, 2>(p, b, hv, c0, width, state, cur, next);
  else
    gdr_block<T, V, 1>(p, b, hv, c0, width, state, cur, next);
}

}  // namespace

// The vector each variant sweeps the state with: AVX-512 blocks of 32 columns in two vf16s (one register each),
// AVX2 blocks of 16 in two vf8s (one register each: in vf16s, 4.2x slower, measured 2026-12-06), baseline blocks
// of 16 in one vf16 (in vf8s it ran 5.8x slower).
#define CLEF_GDR_CPU_ENTRY(name, T)                                                                    \
  CLEF_CPU_VARIANTS_EACH(name,                                                                         \
                         (const GatedDeltaRuleParams& p, int b, int hv, int c0, int width,             \
                          std::vector<float>& state, TokenInputs& cur, TokenInputs& next),             \
                         (p, b, hv, c0, width, state, cur, next), (gdr_block_any_width<T, vf16>),      \
                         (gdr_block_any_width<T, vf8>), (gdr_block_any_width<T, vf16>))
CLEF_GDR_CPU_ENTRY(gdr_block_f32, float)
CLEF_GDR_CPU_ENTRY(gdr_block_f16, c10::Half)
CLEF_GDR_CPU_ENTRY(gdr_block_bf16, c10::BFloat16)

void gated_delta_rule_cpu(const GatedDeltaRuleParams& p, ScalarKind kind) {
  const CpuIsa isa = cpu_isa();
  auto block_fn = kind == ScalarKind::F32   ? gdr_block_f32_for(isa)
                  : kind == ScalarKind::F16 ? gdr_block_f16_for(isa)
                                            : gdr_block_bf16_for(isa);
  // 32 columns (two vf16s) keep 8 accumulators plus the update in registers with AVX-512; AVX2 has 16 256-bit
  // registers, where 32 columns spill on every row, so there a block is 16 columns (two vf8s; baseline one vf16).
  // Columns are independent: the width changes no result.
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
