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

constexpr int kKeyTile = 64;
constexpr int kRowBlock = 4;

CLEF_INLINE int round_up(int x, int m) { return (x + m - 1) / m * m; }

// C[4][16*NV] += A[4][K] * B[K][16*NV]; row strides lda, ldb, ldc (floats).
template <int NV>
CLEF_INLINE void micro_kernel(const float* A, int64_t lda, const float* B, int64_t ldb, int K, float* C, int64_t ldc) {
  vf16 acc[kRowBlock][NV];
  for (int r = 0; r < kRowBlock; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = load_vf16(C + r * ldc + kLanes * v);
  for (int k = 0; k < K; ++k) {
    vf16 b[NV];
    for (int v = 0; v < NV; ++v) b[v] = load_vf16(B + k * ldb + kLanes * v);
    for (int r = 0; r < kRowBlock; ++r) {
      const float a = A[r * lda + k];
      for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < kRowBlock; ++r)
    for (int v = 0; v < NV; ++v) store_vf16(C + r * ldc + kLanes * v, acc[r][v]);
}

// C[rows][cols] += A[rows][K] * B[K][cols]; rows % 4 == 0, cols % 16 == 0 (callers pad with zeros).
CLEF_INLINE void gemm_acc(const float* A, int64_t lda, const float* B, int64_t ldb, int K, float* C, int64_t ldc, int rows,
                          int cols) {
  for (int r = 0; r < rows; r += kRowBlock) {
    int c = 0;
    for (; c + 4 * kLanes <= cols; c += 4 * kLanes) micro_kernel<4>(A + r * lda, lda, B + c, ldb, K, C + r * ldc + c, ldc);
    for (; c < cols; c += kLanes) micro_kernel<1>(A + r * lda, lda, B + c, ldb, K, C + r * ldc + c, ldc);
  }
}

// Each (sequence, KV head)'s context, gathered once from the pages into fp32 tiles of kKeyTile keys:
// K transposed ([Dp][kKeyTile], so scores vectorise over keys) followed by V ([kKeyTile][Dp]). Every query
// block of that sequence and head then reads contiguous, L2-friendly memory instead of re-gathering.
struct GatheredContexts {
  int Dp = 0;
  std::vector<int64_t> base;     // [batch * Hkv]: first float of each (sequence, head) region
  std::vector<int64_t> ok_base;  // [batch * Hkv]: first flag of each region in key_ok
  std::vector<float> data;
  std::vector<int32_t> key_ok;   // per gathered key: 1 when its page is inside the cache (-1 lanes: never)

  int64_t tile_floats() const { return 2LL * Dp * kKeyTile; }
  const float* kt(int region, int tile) const { return data.data() + base[region] + tile * tile_floats(); }
  const float* v(int region, int tile) const { return kt(region, tile) + static_cast<int64_t>(Dp) * kKeyTile; }
};

template <typename T>
CLEF_INLINE void gather_tile(const PagedAttentionParams& p, int b, int kv_head, int tile, int context_len,
                             GatheredContexts& g) {
  const int region = b * p.num_kv_heads + kv_head;
  const int D = p.head_dim, Dp = g.Dp;
  float* kt = g.data.data() + g.base[region] + tile * g.tile_floats();
  float* v = kt + static_cast<int64_t>(Dp) * kKeyTile;
  int32_t* ok = g.key_ok.data() + g.ok_base[region] + tile * kKeyTile;
  const T* key_cache = static_cast<const T*>(p.key_cache);
  const T* value_cache = static_cast<const T*>(p.value_cache);
  std::fill(kt, kt + g.tile_floats(), 0.0f);
  const int k0 = tile * kKeyTile;
  // Consecutive keys of one head are Hkv * D elements apart (a page apart for clef-flash): prefetch ahead.
  constexpr int kAhead = 4;
  for (int kk = 0; kk < kKeyTile; ++kk) {
    const int pos = k0 + kk;
    if (pos + kAhead < context_len && kk + kAhead < kKeyTile) {
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
      kt[static_cast<int64_t>(d) * kKeyTile + kk] = to_f32(ksrc[d]);
      vrow[d] = to_f32(vsrc[d]);
    }
  }
}

struct AttnScratch {
  std::vector<float> q, scores, out, m, l;
  std::vector<int> pos;
};

CLEF_INLINE float hmax(vf16 v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

template <typename T>
CLEF_INLINE void attention_block(const PagedAttentionParams& p, int b, int kv_head, int q0, int block_tokens,
                                 const GatheredContexts& g, AttnScratch& w) {
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
  w.scores.resize(static_cast<size_t>(rows_p) * kKeyTile);
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
  vi16 lane;
  for (int i = 0; i < kLanes; ++i) lane[i] = i;
  const int kv_end = attn_query_position(s, q0 + tokens - 1) + 1;
  for (int k0 = 0; k0 < kv_end; k0 += kKeyTile) {
    const int tile = k0 / kKeyTile;
    const int nk = std::min(kKeyTile, kv_end - k0);
    const int32_t* ok = g.key_ok.data() + g.ok_base[region] + tile * kKeyTile;
    std::fill(w.scores.begin(), w.scores.end(), 0.0f);
    gemm_acc(w.q.data(), Dp, g.kt(region, tile), kKeyTile, Dp, w.scores.data(), kKeyTile, rows_p, kKeyTile);
    for (int r = 0; r < rows; ++r) {
      float* srow = w.scores.data() + static_cast<size_t>(r) * kKeyTile;
      const int last = w.pos[r] - k0;  // keys kk <= last are causal for this row
      vi16 live[kKeyTile / kLanes];
      vf16 tile_max = broadcast(kNegInf);
      for (int c = 0; c < kKeyTile / kLanes; ++c) {
        const vi16 kk = lane + c * kLanes;
        live[c] = (kk <= last) & *reinterpret_cast<const vi16*>(ok + c * kLanes);
        const vf16 sv = load_vf16(srow + c * kLanes);
        tile_max = live[c] ? (sv > tile_max ? sv : tile_max) : tile_max;
      }
      const SoftmaxStep step = softmax_step(w.m[r], hmax(tile_max));
      vf16 sum = {};
      for (int c = 0; c < kKeyTile / kLanes; ++c) {
        const vf16 prob = live[c] ? exp_vf16(load_vf16(srow + c * kLanes) - step.m) : vf16{};
        store_vf16(srow + c * kLanes, prob);
        sum += prob;
      }
      float total = 0.0f;
      for (int i = 0; i < kLanes; ++i) total += sum[i];
      w.l[r] = w.l[r] * step.alpha + total;
      w.m[r] = step.m;
      float* orow = w.out.data() + static_cast<size_t>(r) * Dp;
      if (step.alpha != 1.0f)
        for (int d = 0; d < Dp; ++d) orow[d] *= step.alpha;
    }
    gemm_acc(w.scores.data(), kKeyTile, g.v(region, tile), Dp, nk, w.out.data(), Dp, rows_p, Dp);
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

#define CLEF_ATTN_CPU_ENTRIES(suffix, T)                                                                        \
  CLEF_CPU_KERNEL void gather_tile_##suffix(const PagedAttentionParams& p, int b, int h, int tile, int ctx,       \
                                            GatheredContexts& g) {                                                \
    gather_tile<T>(p, b, h, tile, ctx, g);                                                                       \
  }                                                                                                               \
  CLEF_CPU_KERNEL void attention_block_##suffix(const PagedAttentionParams& p, int b, int h, int q0, int n,       \
                                                const GatheredContexts& g, AttnScratch& w) {                      \
    attention_block<T>(p, b, h, q0, n, g, w);                                                                    \
  }
CLEF_ATTN_CPU_ENTRIES(f32, float)
CLEF_ATTN_CPU_ENTRIES(f16, c10::Half)
CLEF_ATTN_CPU_ENTRIES(bf16, c10::BFloat16)

void paged_attention_cpu(const PagedAttentionParams& p, ScalarKind kind) {
  const bool f32 = kind == ScalarKind::F32, f16 = kind == ScalarKind::F16;
  auto gather_fn = f32 ? gather_tile_f32 : f16 ? gather_tile_f16 : gather_tile_bf16;
  auto block_fn = f32 ? attention_block_f32 : f16 ? attention_block_f16 : attention_block_bf16;
  const int group = p.num_q_heads / p.num_kv_heads;

  // Pass 1: gather each (sequence, KV head)'s context keys, up to its last query's position.
  GatheredContexts g;
  g.Dp = round_up(p.head_dim, kLanes);
  const int regions = p.batch * p.num_kv_heads;
  g.base.resize(regions);
  g.ok_base.resize(regions);
  std::vector<int> needed(p.batch), tile_start(regions + 1, 0);
  int64_t floats = 0, flags = 0;
  for (int b = 0; b < p.batch; ++b) {
    const AttnSeq s = attn_sequence(p, b);
    needed[b] = s.q_len > 0 ? std::max(0, attn_query_position(s, s.q_len - 1) + 1) : 0;
    const int tiles = (needed[b] + kKeyTile - 1) / kKeyTile;
    for (int h = 0; h < p.num_kv_heads; ++h) {
      const int region = b * p.num_kv_heads + h;
      g.base[region] = floats;
      g.ok_base[region] = flags;
      tile_start[region + 1] = tile_start[region] + tiles;
      floats += tiles * g.tile_floats();
      flags += static_cast<int64_t>(tiles) * kKeyTile;
    }
  }
  g.data.resize(floats);
  g.key_ok.resize(flags);
  at::parallel_for(0, tile_start[regions], 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int region = static_cast<int>(std::upper_bound(tile_start.begin(), tile_start.end(), i) - tile_start.begin()) - 1;
      const int b = region / p.num_kv_heads;
      gather_fn(p, b, region % p.num_kv_heads, static_cast<int>(i - tile_start[region]), needed[b], g);
    }
  });

  // Pass 2: attention per (sequence, query block, KV head); about 64 rows per item to amortise each tile.
  const int block_tokens = std::max(1, 64 / group);
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
