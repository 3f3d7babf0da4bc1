// CPU implementation of the paged KV cache ops.
//
// paged_attention: work items are (sequence, KV head, block of query tokens). An item's rows
// are its tokens x the query heads of the group, so every key tile read from the pages serves all of them.
// Everything is computed transposed, the rows along the vector lanes: scores^T [keys][rows] = K Q^T, then
// out^T [D][rows] += V^T P^T. So a tile's keys are read from the pages as they are stored (rows of D, converted
// to fp32 in a small tile: nothing of the context is gathered whole, and memory does not grow with its length);
// the online softmax's max, exp and sum run down the columns in full vectors (a row's running max and sum are
// lanes), and both products run through one register-blocked micro-kernel. An item's rows sum over the keys in
// one order whatever else is in the pack or however many threads run it: a record's answer does not depend on
// its neighbours.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "common/cpu_kernel.h"
#include "paged_attention/paged_attention_launch.h"

namespace clef {
namespace {

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

// The micro-kernel's register block: MR rows of A by NV vectors of B's columns. AVX-512 (32 registers): 8 x 32,
// 16 accumulators. AVX2 and SSE2 (16 registers): 6 x 2L, 12 accumulators + 2 loads + a broadcast = 15, and
// more independent accumulators than FMA latency x pipes (8), which the 4 x 2L block had only just.
template <int L>
struct Block {
  static constexpr int MR = L == 16 ? 8 : 6;
  static constexpr int NV = 2;
  static constexpr int COLS = NV * L;  // rows of attention are padded to a multiple of this
};

// C[MR][NV * L] (ACC: +=, else =) sum over k of A(i, k) B[k][:], where A(i, k) = A[i * sa + k * sk]: both
// products read their A (the K tile, the V tile) in place through the strides. Each step loads NV vectors of
// B and broadcasts MR values of A.
template <int L, int MR, int NV, bool ACC>
CLEF_INLINE void micro_kernel(const float* A, int64_t sa, int64_t sk, const float* B, int64_t ldb, int K, float* C,
                              int64_t ldc, float* col_max) {
  typename Lanes<L>::f acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = ACC ? load_v<L>(C + r * ldc + L * v) : typename Lanes<L>::f{};
  for (int k = 0; k < K; ++k) {
    typename Lanes<L>::f b[NV];
    for (int v = 0; v < NV; ++v) b[v] = load_v<L>(B + k * ldb + L * v);
    for (int r = 0; r < MR; ++r) {
      const float a = A[r * sa + k * sk];
      for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) store_v<L>(C + r * ldc + L * v, acc[r][v]);
  if (col_max != nullptr)  // the scores' tile max per column, while they are in registers
    for (int v = 0; v < NV; ++v) {
      typename Lanes<L>::f m = load_v<L>(col_max + L * v);
      for (int r = 0; r < MR; ++r) m = acc[r][v] > m ? acc[r][v] : m;
      store_v<L>(col_max + L * v, m);
    }
}

// The last m < MR rows of A: the micro-kernel of exactly m rows.
template <int L, int MR, int NV, bool ACC>
CLEF_INLINE void micro_tail(int m, const float* A, int64_t sa, int64_t sk, const float* B, int64_t ldb, int K, float* C,
                            int64_t ldc, float* col_max) {
  if constexpr (MR > 0) {
    if (m == MR) micro_kernel<L, MR, NV, ACC>(A, sa, sk, B, ldb, K, C, ldc, col_max);
    else micro_tail<L, MR - 1, NV, ACC>(m, A, sa, sk, B, ldb, K, C, ldc, col_max);
  }
}

// B and C are stored in panels of COLS columns, each panel contiguous ([K][COLS] and [M][COLS]): with the rows
// of a whole matrix between them, a panel's rows were 512 bytes apart at 128 columns and fell into 8 of L1's 64
// sets (a 16 KB panel thrashed a 32 KB L1). panel_offset(p, rows): where panel p of a matrix of `rows` rows starts.
template <int L>
CLEF_INLINE int64_t panel_offset(int p, int rows) { return static_cast<int64_t>(p) * rows * Block<L>::COLS; }

// C (+)= A(M x K) B, B [K x panels * COLS] and C [M x panels * COLS] in panels (above). Column panels outside,
// so a panel of B stays in L1 while A's rows stream by. Every element of C sums over k in order: the blocking
// changes no result. col_max (or nullptr): [panels * COLS], raised to each column's max of C.
template <int L, bool ACC>
CLEF_INLINE void gemm(const float* A, int64_t sa, int64_t sk, const float* B, int K, float* C, int M, int panels,
                      float* col_max = nullptr) {
  constexpr int MR = Block<L>::MR, NV = Block<L>::NV, COLS = Block<L>::COLS;
  for (int c = 0; c < panels; ++c) {
    const float* b = B + panel_offset<L>(c, K);
    float* out = C + panel_offset<L>(c, M);
    float* panel_max = col_max != nullptr ? col_max + c * COLS : nullptr;
    int i = 0;
    for (; i + MR <= M; i += MR) micro_kernel<L, MR, NV, ACC>(A + i * sa, sa, sk, b, COLS, K, out + i * COLS, COLS, panel_max);
    if (i < M) micro_tail<L, MR - 1, NV, ACC>(M - i, A + i * sa, sa, sk, b, COLS, K, out + i * COLS, COLS, panel_max);
  }
}

// Keys a tile: its K and V ([keys][D] fp32 each, 64 KB at D = 256) and scores ([keys][rows]) stay in L2 beside
// the item's Q^T and out^T; small heads take up to 256 keys so the per-tile bookkeeping (the running max's
// rescale of out^T) is amortised over more keys.
CLEF_INLINE int key_tile_for(int head_dim) { return std::clamp(16384 / head_dim / 16 * 16, 32, 256); }
constexpr int kRowsPerItem = 128;     // about this many rows (tokens x the group's query heads) an item

// One item: the rows of `tokens` query tokens from q0 over keys [0, k_end) of its sequence (the causal ones).
struct AttnItem {
  int b, kv_head, q0, tokens, k_end;
  int64_t cost() const { return static_cast<int64_t>(tokens) * k_end; }
};

struct AttnScratch {
  std::vector<float> qt, outt, scores, kt, vt, m, l, col_max;
  std::vector<int32_t> ok, pos;
};

// Keys [k0, k0 + n) of a (sequence, KV head) in fp32 rows; ok[k] = -1 (a lane mask) where its page is inside the
// cache, else 0 and the rows zero. Returns whether every key's page is.
// Asks for keys [k0, k0 + n)'s K and V rows into L2 (prefetcht1), to be read one tile later: the hardware
// prefetchers do not follow a block table, and without it a tile's read waited on memory for each page (18% of
// the time at head dim 16 and 64k keys, perf).
template <typename T>
CLEF_INLINE void prefetch_keys(const PagedAttentionParams& p, int b, int kv_head, int k0, int n) {
  const char* key_cache = static_cast<const char*>(p.key_cache);
  const char* value_cache = static_cast<const char*>(p.value_cache);
  const int64_t row_bytes = static_cast<int64_t>(p.head_dim) * sizeof(T);
  for (int kk = 0; kk < n; ++kk) {
    const int64_t off = paged_key_offset(p, b, k0 + kk, kv_head);
    if (off < 0) continue;
    for (int64_t line = 0; line < row_bytes; line += 64) {
      __builtin_prefetch(key_cache + off * static_cast<int64_t>(sizeof(T)) + line, 0, 2);
      __builtin_prefetch(value_cache + off * static_cast<int64_t>(sizeof(T)) + line, 0, 2);
    }
  }
}

template <typename T>
CLEF_INLINE bool read_keys(const PagedAttentionParams& p, int b, int kv_head, int k0, int n, float* kt, float* vt,
                           int32_t* ok) {
  const int D = p.head_dim;
  const T* key_cache = static_cast<const T*>(p.key_cache);
  const T* value_cache = static_cast<const T*>(p.value_cache);
  bool all = true;
  for (int kk = 0; kk < n; ++kk) {
    const int64_t off = paged_key_offset(p, b, k0 + kk, kv_head);
    float* krow = kt + static_cast<int64_t>(kk) * D;
    float* vrow = vt + static_cast<int64_t>(kk) * D;
    ok[kk] = off >= 0 ? -1 : 0;
    if (off < 0) {
      all = false;
      std::fill(krow, krow + D, 0.0f);
      std::fill(vrow, vrow + D, 0.0f);
      continue;
    }
    const T* ksrc = key_cache + off;
    const T* vsrc = value_cache + off;
    for (int d = 0; d < D; ++d) krow[d] = to_f32(ksrc[d]);
    for (int d = 0; d < D; ++d) vrow[d] = to_f32(vsrc[d]);
  }
  return all;
}

// The online softmax over one tile of scores^T ([n][rows_p], in place: scores become probabilities), a panel of
// COLS rows at a time: its tile max, the running max m and sum l (per row), and out^T's rescale by
// exp(m_old - m_new). masked: some key of the tile is dead for some row (past its position, or its page outside
// the cache): those scores are left out of the max and their probabilities are exactly 0. Else col_max holds
// the tile's max per row (the first product's epilogue) and the scores are read once.
template <int L>
CLEF_INLINE void softmax_tile(float* scores, int n, int rows_p, int k0, bool masked, const int32_t* ok,
                              const int32_t* pos, const float* col_max, float* m, float* l, float* outt, int D) {
  using V = typename Lanes<L>::f;
  using VI = typename Lanes<L>::i;
  constexpr int NV = Block<L>::NV, COLS = Block<L>::COLS;
  const V neg = V{} + kNegInf;
  for (int c = 0; c < rows_p; c += COLS) {
    float* panel_scores = scores + panel_offset<L>(c / COLS, n);
    float* panel_out = outt + panel_offset<L>(c / COLS, D);
    VI row_pos[NV];
    V tile_max[NV];
    for (int v = 0; v < NV; ++v) {
      row_pos[v] = *reinterpret_cast<const VI*>(pos + c + v * L);
      tile_max[v] = masked ? neg : load_v<L>(col_max + c + v * L);
    }
    for (int k = 0; k < n && masked; ++k) {
      const float* srow = panel_scores + static_cast<int64_t>(k) * COLS;
      for (int v = 0; v < NV; ++v) {
        const V score = ((row_pos[v] >= k0 + k) & ok[k]) ? load_v<L>(srow + v * L) : neg;
        tile_max[v] = score > tile_max[v] ? score : tile_max[v];
      }
    }
    V m_new[NV], alpha[NV], sum[NV];
    for (int v = 0; v < NV; ++v) {
      const V m_old = load_v<L>(m + c + v * L);
      m_new[v] = tile_max[v] > m_old ? tile_max[v] : m_old;
      alpha[v] = exp_v<V, VI>(m_old - m_new[v]);  // nothing seen yet (m_old = kNegInf): 0, or 1 if still nothing
      sum[v] = V{};
    }
    for (int k = 0; k < n; ++k) {
      float* srow = panel_scores + static_cast<int64_t>(k) * COLS;
      for (int v = 0; v < NV; ++v) {
        V prob = exp_v<V, VI>(load_v<L>(srow + v * L) - m_new[v]);
        if (masked) prob = ((row_pos[v] >= k0 + k) & ok[k]) ? prob : V{};
        store_v<L>(srow + v * L, prob);
        sum[v] += prob;
      }
    }
    for (int v = 0; v < NV; ++v) {
      store_v<L>(l + c + v * L, load_v<L>(l + c + v * L) * alpha[v] + sum[v]);
      store_v<L>(m + c + v * L, m_new[v]);
    }
    for (int d = 0; d < D; ++d)
      for (int v = 0; v < NV; ++v) {
        float* o = panel_out + static_cast<int64_t>(d) * COLS + v * L;
        store_v<L>(o, load_v<L>(o) * alpha[v]);
      }
  }
}

template <typename T, int L>
CLEF_INLINE void attend_item(const PagedAttentionParams& p, const AttnItem& item, int keys, AttnScratch& w) {
  const AttnSeq s = attn_sequence(p, item.b);
  const int group = p.num_q_heads / p.num_kv_heads;
  const int rows = item.tokens * group;
  const int rows_p = round_up(rows, Block<L>::COLS);
  const int D = p.head_dim;
  const T* query = static_cast<const T*>(p.query);
  w.qt.assign(static_cast<size_t>(D) * rows_p, 0.0f);
  w.outt.assign(static_cast<size_t>(D) * rows_p, 0.0f);
  w.scores.resize(static_cast<size_t>(keys) * rows_p);
  w.kt.resize(static_cast<size_t>(keys) * D);
  w.vt.resize(static_cast<size_t>(keys) * D);
  w.ok.resize(keys);
  w.m.assign(rows_p, kNegInf);
  w.l.assign(rows_p, 0.0f);
  w.col_max.resize(rows_p);
  w.pos.assign(rows_p, -1);  // padding rows: every key dead in a masked tile; finite and discarded otherwise
  // Row r: token q0 + r / group, query head kv_head * group + r % group (the GPU kernels' order). Q^T, the
  // scores and out^T are stored in panels of COLS rows (gemm): row r of out^T's d is at transposed(d, r).
  constexpr int COLS = Block<L>::COLS;
  const int panels = rows_p / COLS;
  auto transposed = [&](int d, int r) { return panel_offset<L>(r / COLS, D) + static_cast<int64_t>(d) * COLS + r % COLS; };
  for (int r = 0; r < rows; ++r) {
    const int qi = item.q0 + r / group;
    const T* src = query + attn_query_offset(s.q_start + qi, item.kv_head * group + r % group, p);
    for (int d = 0; d < D; ++d) w.qt[transposed(d, r)] = to_f32(src[d]) * p.scale;
    w.pos[r] = attn_query_position(s, qi);
  }
  const int first_pos = w.pos[0];  // rows' positions grow with r: every key up to it is causal for every row
  for (int k0 = 0; k0 < item.k_end; k0 += keys) {
    const int n = std::min(keys, item.k_end - k0);
    if (k0 + n < item.k_end) prefetch_keys<T>(p, item.b, item.kv_head, k0 + n, std::min(keys, item.k_end - k0 - n));
    const bool pages_ok = read_keys<T>(p, item.b, item.kv_head, k0, n, w.kt.data(), w.vt.data(), w.ok.data());
    const bool masked = !pages_ok || k0 + n - 1 > first_pos;
    std::fill(w.col_max.begin(), w.col_max.end(), kNegInf);
    gemm<L, false>(w.kt.data(), D, 1, w.qt.data(), D, w.scores.data(), n, panels, masked ? nullptr : w.col_max.data());
    softmax_tile<L>(w.scores.data(), n, rows_p, k0, masked, w.ok.data(), w.pos.data(), w.col_max.data(), w.m.data(),
                    w.l.data(), w.outt.data(), D);
    gemm<L, true>(w.vt.data(), 1, D, w.scores.data(), n, w.outt.data(), D, panels);
  }
  T* out = static_cast<T*>(p.out);
  for (int r = 0; r < rows; ++r) {
    const int qi = item.q0 + r / group;
    T* dst = out + attn_out_offset(s.q_start + qi, item.kv_head * group + r % group, p);
    const float inv = w.l[r] > 0.0f ? 1.0f / w.l[r] : 0.0f;  // no key seen: only with inconsistent metadata
    for (int d = 0; d < D; ++d) dst[d] = from_f32<T>(w.outt[transposed(d, r)] * inv);
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
#define CLEF_ATTN_CPU_ENTRIES(suffix, T)                                                                      \
  CLEF_CPU_VARIANTS_EACH(attend_item_##suffix,                                                                \
                         (const PagedAttentionParams& p, const AttnItem& item, int keys, AttnScratch& w),      \
                         (p, item, keys, w), (attend_item<T, 16>), (attend_item<T, 8>), (attend_item<T, 4>))
CLEF_ATTN_CPU_ENTRIES(f32, float)
CLEF_ATTN_CPU_ENTRIES(f16, c10::Half)
CLEF_ATTN_CPU_ENTRIES(bf16, c10::BFloat16)

namespace {

// The pack's items: each (sequence, KV head, block of about kRowsPerItem rows) over its causal keys.
std::vector<AttnItem> attention_items(const PagedAttentionParams& p) {
  const int group = p.num_q_heads / p.num_kv_heads;
  const int block_tokens = std::max(1, kRowsPerItem / group);
  std::vector<AttnItem> items;
  for (int b = 0; b < p.batch; ++b) {
    const AttnSeq s = attn_sequence(p, b);
    for (int q0 = 0; q0 < s.q_len; q0 += block_tokens) {
      const int tokens = std::min(block_tokens, s.q_len - q0);
      const int k_end = std::max(0, attn_query_position(s, q0 + tokens - 1) + 1);
      for (int h = 0; h < p.num_kv_heads; ++h) items.push_back({b, h, q0, tokens, k_end});
    }
  }
  return items;
}

}  // namespace

void paged_attention_cpu(const PagedAttentionParams& p, ScalarKind kind) {
  const bool f32 = kind == ScalarKind::F32, f16 = kind == ScalarKind::F16;
  const CpuIsa isa = cpu_isa();
  auto attend = f32 ? attend_item_f32_for(isa) : f16 ? attend_item_f16_for(isa) : attend_item_bf16_for(isa);
  const int keys = key_tile_for(p.head_dim);
  const std::vector<AttnItem> items = attention_items(p);
  // Dynamic scheduling, the most costly first: later query blocks attend more keys (causal).
  std::vector<int> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return items[a].cost() > items[b].cost(); });
  std::atomic<size_t> next{0};
  at::parallel_for(0, std::max(1, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    AttnScratch scratch;
    for (size_t i = next.fetch_add(1); i < order.size(); i = next.fetch_add(1)) attend(p, items[order[i]], keys, scratch);
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
