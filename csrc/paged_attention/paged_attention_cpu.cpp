// CPU implementation of the paged KV cache ops.
//
// paged_attention: parallel over (sequence, KV head, block of query tokens). A work item's rows are its
// tokens x the query heads of the group, so every key tile gathered from the pages serves all of them.
// Each sequence's context is first gathered from the pages into fp32 tiles of 64 keys (K transposed);
// then both products (scores = Q K^T and out += P V) run through one register-blocked 4 x 64
// micro-kernel, with an online softmax per row in between.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <vector>

#include "common/cpu_kernel.h"
#include "paged_attention/paged_attention_launch.h"

namespace clef {
namespace {

// Keys per tile: a K^T tile of ~32 KB stays in L1 while the rows stream by (32 keys at D = 256); small
// heads take up to 128 keys so the per-row softmax bookkeeping is amortised over more keys.
constexpr int kMaxKeyTile = 128;
CLEF_INLINE int key_tile_for(int Dp) { return std::clamp(8192 / Dp / 16 * 16, 32, kMaxKeyTile); }
constexpr int kRowBlock = 4;  // rows are padded to a multiple of this

CLEF_INLINE int round_up(int x, int m) { return (x + m - 1) / m * m; }

// Vectors of L floats, one register of the variant: L = 16 for AVX-512, 8 for AVX2, 4 for baseline SSE2.
// Generic 16-float vectors compiled for AVX2 went through the stack lane by lane in the masked softmax
// (perf: vmovq/vpinsrq on every element; 10x slower than AVX-512, slower than SSE2), and 8-float ones
// compiled for SSE2 did the same, so each variant is written in vectors its registers hold.
template <int L>
struct Lanes {
  typedef float f __attribute__((vector_size(4 * L), aligned(4)));
  typedef int32_t i __attribute__((vector_size(4 * L), aligned(4)));
};

template <int L>
CLEF_INLINE typename Lanes<L>::f load_v(const float* p) {
  return *reinterpret_cast<const typename Lanes<L>::f*>(p);
}
template <int L>
CLEF_INLINE void store_v(float* p, typename Lanes<L>::f v) {
  *reinterpret_cast<typename Lanes<L>::f*>(p) = v;
}

// C[MR][L*NV] += A[MR][K] * B[K][L*NV]; row strides lda, ldb, ldc (floats). MR * NV accumulators live in
// registers; each step loads NV vectors of B and broadcasts MR values of A.
template <int L, int MR, int NV>
CLEF_INLINE void micro_kernel(const float* A, int64_t lda, const float* B, int64_t ldb, int K, float* C, int64_t ldc) {
  typename Lanes<L>::f acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = load_v<L>(C + r * ldc + L * v);
  for (int k = 0; k < K; ++k) {
    typename Lanes<L>::f b[NV];
    for (int v = 0; v < NV; ++v) b[v] = load_v<L>(B + k * ldb + L * v);
    for (int r = 0; r < MR; ++r) {
      const float a = A[r * lda + k];
      for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) store_v<L>(C + r * ldc + L * v, acc[r][v]);
}

// C[rows][cols] += A[rows][K] * B[K][cols]; rows % 4 == 0, cols % 16 == 0 (callers pad with zeros).
// L = 16 (AVX-512): 8 x 32 blocks, 16 accumulators of its 32 registers, 2 loads and 8 broadcasts per 16 FMAs.
// L = 8 (AVX2): 4 x 16 blocks, 8 accumulators, 2 loads and a broadcast: 11 of its 16 registers; L = 4
// (baseline SSE2) the same shape in 4 x 8 blocks.
// The blocking changes no result: every element of C sums over k in the same order either way.
template <int L>
CLEF_INLINE void gemm_acc(const float* A, int64_t lda, const float* B, int64_t ldb, int K, float* C, int64_t ldc, int rows,
                          int cols) {
  if constexpr (L < 16) {
    for (int r = 0; r < rows; r += kRowBlock)
      for (int c = 0; c < cols; c += 2 * L) micro_kernel<L, 4, 2>(A + r * lda, lda, B + c, ldb, K, C + r * ldc + c, ldc);
  } else {
    int r = 0;
    for (; r + 8 <= rows; r += 8) {
      int c = 0;
      for (; c + 32 <= cols; c += 32) micro_kernel<16, 8, 2>(A + r * lda, lda, B + c, ldb, K, C + r * ldc + c, ldc);
      for (; c < cols; c += 16) micro_kernel<16, 8, 1>(A + r * lda, lda, B + c, ldb, K, C + r * ldc + c, ldc);
    }
    for (; r < rows; r += kRowBlock) {
      int c = 0;
      for (; c + 32 <= cols; c += 32) micro_kernel<16, 4, 2>(A + r * lda, lda, B + c, ldb, K, C + r * ldc + c, ldc);
      for (; c < cols; c += 16) micro_kernel<16, 4, 1>(A + r * lda, lda, B + c, ldb, K, C + r * ldc + c, ldc);
    }
  }
}

// A tile of `keys` context keys in fp32: K transposed ([Dp][keys], so scores vectorise over keys)
// followed by V ([keys][Dp]), plus a flag per key (-1: its page is inside the cache, 0: not).
CLEF_INLINE int64_t tile_floats(int Dp, int keys) { return 2LL * Dp * keys; }

// When a (sequence, KV head) has several query blocks, its context is gathered once into such tiles and
// every block reads contiguous, L2-friendly memory; with a single query block (decode, short chunks) each
// tile is gathered on the fly into the work item's scratch instead, which stays in cache.
struct GatheredContexts {
  int Dp = 0;
  int keys = 0;  // per tile
  std::vector<int64_t> base;  // [batch * Hkv]: first float of each region, -1 when gathered on the fly
  std::vector<float> data;
  std::vector<int32_t> key_ok;

  bool has(int region) const { return base[region] >= 0; }
  const float* tile(int region, int t) const { return data.data() + base[region] + t * tile_floats(Dp, keys); }
  const int32_t* ok(int region, int t) const { return key_ok.data() + base[region] / (2 * Dp) + t * keys; }
};

template <typename T>
CLEF_INLINE void gather_tile(const PagedAttentionParams& p, int b, int kv_head, int tile, int context_len, int Dp,
                             int keys, float* kt, int32_t* ok) {
  const int D = p.head_dim;
  float* v = kt + static_cast<int64_t>(Dp) * keys;
  const T* key_cache = static_cast<const T*>(p.key_cache);
  const T* value_cache = static_cast<const T*>(p.value_cache);
  std::fill(kt, kt + tile_floats(Dp, keys), 0.0f);
  const int k0 = tile * keys;
  // Consecutive keys of one head are Hkv * D elements apart (a page apart for clef-flash): prefetch ahead.
  constexpr int kAhead = 4;
  for (int kk = 0; kk < keys; ++kk) {
    const int pos = k0 + kk;
    if (pos + kAhead < context_len && kk + kAhead < keys) {
      const int64_t ahead = paged_key_offset(p, b, pos + kAhead, kv_head);
      if (ahead >= 0)
        for (int off = 0; off < D * static_cast<int>(sizeof(T)); off += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(key_cache + ahead) + off);
          __builtin_prefetch(reinterpret_cast<const char*>(value_cache + ahead) + off);
        }
    }
    const int64_t off = pos < context_len ? paged_key_offset(p, b, pos, kv_head) : -1;
    ok[kk] = off >= 0 ? -1 : 0;
    if (off < 0) continue;
    const T* ksrc = key_cache + off;
    const T* vsrc = value_cache + off;
    float* vrow = v + static_cast<int64_t>(kk) * Dp;
    for (int d = 0; d < D; ++d) {
      kt[static_cast<int64_t>(d) * keys + kk] = to_f32(ksrc[d]);
      vrow[d] = to_f32(vsrc[d]);
    }
  }
}

struct AttnScratch {
  std::vector<float> q, scores, out, m, l, tile;
  std::vector<int32_t> tile_ok;
  std::vector<int> pos;
};

// Horizontal max / sum of a vector's lanes (once per row and tile: not on the hot path).
template <typename V, int L>
CLEF_INLINE float hmax(V v) {
  float m = v[0];
  for (int i = 1; i < L; ++i) m = m > v[i] ? m : v[i];
  return m;
}
template <typename V, int L>
CLEF_INLINE float hsum(V v) {
  float s = 0.0f;
  for (int i = 0; i < L; ++i) s += v[i];
  return s;
}

template <typename T, int L>
CLEF_INLINE void attention_block(const PagedAttentionParams& p, int b, int kv_head, int q0, int block_tokens,
                                 const GatheredContexts& g, AttnScratch& w) {
  using V = typename Lanes<L>::f;
  using VI = typename Lanes<L>::i;
  const AttnSeq s = attn_sequence(p, b);
  const int group = p.num_q_heads / p.num_kv_heads;
  const int tokens = std::min(block_tokens, s.q_len - q0);
  if (tokens <= 0) return;
  const int rows = tokens * group;
  const int rows_p = round_up(rows, kRowBlock);
  const int D = p.head_dim;
  const int Dp = g.Dp;
  const int region = b * p.num_kv_heads + kv_head;
  const T* query = static_cast<const T*>(p.query);

  w.q.assign(static_cast<size_t>(rows_p) * Dp, 0.0f);
  w.out.assign(static_cast<size_t>(rows_p) * Dp, 0.0f);
  const int keys = g.keys;
  w.scores.resize(static_cast<size_t>(rows_p) * keys);
  w.m.assign(rows, kNegInf);
  w.l.assign(rows, 0.0f);
  w.pos.resize(rows);
  // Row r: token q0 + r / group, query head kv_head * group + r % group (the GPU kernel's order).
  for (int r = 0; r < rows; ++r) {
    const int qi = q0 + r / group;
    const T* src = query + attn_query_offset(s.q_start + qi, kv_head * group + r % group, p);
    for (int d = 0; d < D; ++d) w.q[static_cast<size_t>(r) * Dp + d] = to_f32(src[d]) * p.scale;
    w.pos[r] = attn_query_position(s, qi);
  }
  VI lane;
  for (int i = 0; i < L; ++i) lane[i] = i;
  const int kv_end = attn_query_position(s, q0 + tokens - 1) + 1;
  for (int k0 = 0; k0 < kv_end; k0 += keys) {
    const int tile = k0 / keys;
    const int nk = std::min(keys, kv_end - k0);
    const float* kt;
    const int32_t* ok;
    if (g.has(region)) {
      kt = g.tile(region, tile);
      ok = g.ok(region, tile);
    } else {
      w.tile.resize(tile_floats(Dp, keys));
      w.tile_ok.resize(keys);
      gather_tile<T>(p, b, kv_head, tile, kv_end, Dp, keys, w.tile.data(), w.tile_ok.data());
      kt = w.tile.data();
      ok = w.tile_ok.data();
    }
    const float* vt = kt + static_cast<int64_t>(Dp) * keys;
    std::fill(w.scores.begin(), w.scores.end(), 0.0f);
    gemm_acc<L>(w.q.data(), Dp, kt, keys, Dp, w.scores.data(), keys, rows_p, keys);
    for (int r = 0; r < rows; ++r) {
      float* srow = w.scores.data() + static_cast<size_t>(r) * keys;
      const int last = w.pos[r] - k0;  // keys kk <= last are causal for this row
      // Two passes over the row, in memory: dead keys (past the row's position, outside the cache) become
      // kNegInf, whose exp is exactly 0; then exp and sum. (Keeping the row in registers between the passes
      // needs keys / L vectors: more than AVX2 has.)
      const int vectors = keys / L;
      const V neg = V{} + kNegInf;
      V running = neg;
      for (int c = 0; c < vectors; ++c) {
        const VI live = ((lane + c * L) <= last) & *reinterpret_cast<const VI*>(ok + c * L);
        const V masked = live ? load_v<L>(srow + c * L) : neg;
        store_v<L>(srow + c * L, masked);
        running = masked > running ? masked : running;
      }
      const SoftmaxStep step = softmax_step(w.m[r], hmax<V, L>(running));
      V sum = {};
      for (int c = 0; c < vectors; ++c) {
        const V prob = exp_v<V, VI>(load_v<L>(srow + c * L) - step.m);
        store_v<L>(srow + c * L, prob);
        sum += prob;
      }
      const float total = hsum<V, L>(sum);
      w.l[r] = w.l[r] * step.alpha + total;
      w.m[r] = step.m;
      float* orow = w.out.data() + static_cast<size_t>(r) * Dp;
      if (step.alpha != 1.0f)
        for (int d = 0; d < Dp; ++d) orow[d] *= step.alpha;
    }
    gemm_acc<L>(w.scores.data(), keys, vt, Dp, nk, w.out.data(), Dp, rows_p, Dp);
  }
  T* out = static_cast<T*>(p.out);
  for (int r = 0; r < rows; ++r) {
    const int qi = q0 + r / group;
    T* dst = out + attn_out_offset(s.q_start + qi, kv_head * group + r % group, p);
    const float inv = w.l[r] > 0.0f ? 1.0f / w.l[r] : 0.0f;  // no key seen: only with inconsistent metadata
    for (int d = 0; d < D; ++d) dst[d] = from_f32<T>(w.out[static_cast<size_t>(r) * Dp + d] * inv);
  }
}

template <typename T>
CLEF_INLINE void cache_write_token(const CacheWriteParams& p, int64_t token) {
  const int64_t slot = p.slot_mapping[token];
  if (!cache_slot_valid(slot, p.num_blocks, p.block_size)) return;
  const T* key = static_cast<const T*>(p.key);
  const T* value = static_cast<const T*>(p.value);
  T* key_cache = static_cast<T*>(p.key_cache);
  T* value_cache = static_cast<T*>(p.value_cache);
  for (int h = 0; h < p.num_kv_heads; ++h) {
    const int64_t dst = cache_slot_offset(slot, h, p.num_kv_heads, p.head_dim);
    const T* ksrc = key + token * p.key_token_stride + h * p.key_head_stride;
    const T* vsrc = value + token * p.value_token_stride + h * p.value_head_stride;
    std::copy(ksrc, ksrc + p.head_dim, key_cache + dst);
    std::copy(vsrc, vsrc + p.head_dim, value_cache + dst);
  }
}

}  // namespace

// Each variant in vectors of its register width (Lanes above).
#define CLEF_ATTN_CPU_ENTRIES(suffix, T)                                                                  \
  CLEF_CPU_VARIANTS(gather_tile_##suffix,                                                                 \
                    (const PagedAttentionParams& p, int b, int h, int tile, int ctx, int Dp, int keys, float* kt, \
                     int32_t* ok),                                                                        \
                    (p, b, h, tile, ctx, Dp, keys, kt, ok), gather_tile<T>)                               \
  CLEF_CPU_VARIANTS_EACH(attention_block_##suffix,                                                        \
                         (const PagedAttentionParams& p, int b, int h, int q0, int n, const GatheredContexts& g, \
                          AttnScratch& w),                                                                \
                         (p, b, h, q0, n, g, w), (attention_block<T, 16>), (attention_block<T, 8>),       \
                         (attention_block<T, 4>))
CLEF_ATTN_CPU_ENTRIES(f32, float)
CLEF_ATTN_CPU_ENTRIES(f16, c10::Half)
CLEF_ATTN_CPU_ENTRIES(bf16, c10::BFloat16)

void paged_attention_cpu(const PagedAttentionParams& p, ScalarKind kind) {
  const bool f32 = kind == ScalarKind::F32, f16 = kind == ScalarKind::F16;
  const CpuIsa isa = cpu_isa();
  auto gather_fn = f32 ? gather_tile_f32_for(isa) : f16 ? gather_tile_f16_for(isa) : gather_tile_bf16_for(isa);
  auto block_fn = f32 ? attention_block_f32_for(isa) : f16 ? attention_block_f16_for(isa) : attention_block_bf16_for(isa);
  const int group = p.num_q_heads / p.num_kv_heads;

  // Pass 1: gather the context of every (sequence, KV head) with several query blocks (see GatheredContexts).
  const int block_tokens = std::max(1, 128 / group);  // about 128 rows per work item
  GatheredContexts g;
  g.Dp = round_up(p.head_dim, 16);  // a multiple of both vector widths
  g.keys = key_tile_for(g.Dp);
  const int regions = p.batch * p.num_kv_heads;
  g.base.assign(regions, -1);
  std::vector<int> needed(p.batch), tile_start(regions + 1, 0);
  int64_t floats = 0;
  for (int b = 0; b < p.batch; ++b) {
    const AttnSeq s = attn_sequence(p, b);
    needed[b] = s.q_len > 0 ? std::max(0, attn_query_position(s, s.q_len - 1) + 1) : 0;
    const int tiles = s.q_len > block_tokens ? (needed[b] + g.keys - 1) / g.keys : 0;
    for (int h = 0; h < p.num_kv_heads; ++h) {
      const int region = b * p.num_kv_heads + h;
      if (tiles > 0) g.base[region] = floats;
      tile_start[region + 1] = tile_start[region] + tiles;
      floats += tiles * tile_floats(g.Dp, g.keys);
    }
  }
  g.data.resize(floats);
  g.key_ok.resize(floats / (2 * g.Dp));
  at::parallel_for(0, tile_start[regions], 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int region = static_cast<int>(std::upper_bound(tile_start.begin(), tile_start.end(), i) - tile_start.begin()) - 1;
      const int b = region / p.num_kv_heads, t = static_cast<int>(i - tile_start[region]);
      gather_fn(p, b, region % p.num_kv_heads, t, needed[b], g.Dp, g.keys, const_cast<float*>(g.tile(region, t)),
                const_cast<int32_t*>(g.ok(region, t)));
    }
  });

  // Pass 2: attention per (sequence, query block, KV head).
  std::vector<int64_t> item_start(p.batch + 1, 0);
  for (int b = 0; b < p.batch; ++b) {
    const AttnSeq s = attn_sequence(p, b);
    item_start[b + 1] = item_start[b] + static_cast<int64_t>((s.q_len + block_tokens - 1) / block_tokens) * p.num_kv_heads;
  }
  const int64_t items = item_start[p.batch];
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    AttnScratch scratch;
    for (int64_t i = begin; i < end; ++i) {
      // Later query blocks attend more keys (causal); zig-zag so each thread's contiguous share of the
      // range mixes cheap and expensive items.
      const int64_t item = i % 2 == 0 ? i / 2 : items - 1 - i / 2;
      const int b = static_cast<int>(std::upper_bound(item_start.begin(), item_start.end(), item) - item_start.begin()) - 1;
      const int64_t local = item - item_start[b];
      const int kv_head = static_cast<int>(local % p.num_kv_heads);
      const int q0 = static_cast<int>(local / p.num_kv_heads) * block_tokens;
      block_fn(p, b, kv_head, q0, block_tokens, g, scratch);
    }
  });
}

void reshape_and_cache_cpu(const CacheWriteParams& p, ScalarKind kind) {
  at::parallel_for(0, p.num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (kind == ScalarKind::F32) cache_write_token<float>(p, t);
      else if (kind == ScalarKind::F16) cache_write_token<c10::Half>(p, t);
      else cache_write_token<c10::BFloat16>(p, t);
    }
  });
}

}  // namespace clef
