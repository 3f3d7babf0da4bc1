// CPU implementation of the paged KV cache ops.
//
// paged_attention: parallel over (sequence, KV head, block of query tokens). A work item's rows are its
// tokens x the query heads of the group, so every key tile gathered from the pages serves all of them.
// Keys are gathered 64 at a time into fp32 tiles (K transposed), then both products (scores = Q K^T and
// out += P V) run through one register-blocked 4 x 64 micro-kernel; the softmax is online, per row.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <vector>

#include "common/cpu_kernel.h"
#include "paged_attention/paged_attention_launch.h"

namespace clef {
namespace {

// 16 floats: one AVX-512 register, two AVX2 ones; aligned(4) allows loads from any float address.
typedef float vf16 __attribute__((vector_size(64), aligned(4)));

constexpr int kKeyTile = 64;
constexpr int kRowBlock = 4;
constexpr int kLanes = 16;

CLEF_INLINE int round_up(int x, int m) { return (x + m - 1) / m * m; }

// C[4][16*NV] += A[4][K] * B[K][16*NV]; row strides lda, ldb, ldc (floats).
template <int NV>
CLEF_INLINE void micro_kernel(const float* A, int64_t lda, const float* B, int64_t ldb, int K, float* C, int64_t ldc) {
  vf16 acc[kRowBlock][NV];
  for (int r = 0; r < kRowBlock; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = *reinterpret_cast<const vf16*>(C + r * ldc + kLanes * v);
  for (int k = 0; k < K; ++k) {
    vf16 b[NV];
    for (int v = 0; v < NV; ++v) b[v] = *reinterpret_cast<const vf16*>(B + k * ldb + kLanes * v);
    for (int r = 0; r < kRowBlock; ++r) {
      const float a = A[r * lda + k];
      for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < kRowBlock; ++r)
    for (int v = 0; v < NV; ++v) *reinterpret_cast<vf16*>(C + r * ldc + kLanes * v) = acc[r][v];
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

struct AttnScratch {
  std::vector<float> q, kt, v, scores, out, m, l;
  std::vector<int> pos;
};

template <typename T>
CLEF_INLINE void attention_block(const PagedAttentionParams& p, int b, int kv_head, int q0, int block_tokens,
                                 AttnScratch& w) {
  const AttnSeq s = attn_sequence(p, b);
  const int group = p.num_q_heads / p.num_kv_heads;
  const int tokens = std::min(block_tokens, s.q_len - q0);
  if (tokens <= 0) return;
  const int rows = tokens * group;
  const int rows_p = round_up(rows, kRowBlock);
  const int D = p.head_dim;
  const int Dp = round_up(D, kLanes);
  const T* query = static_cast<const T*>(p.query);
  const T* key_cache = static_cast<const T*>(p.key_cache);
  const T* value_cache = static_cast<const T*>(p.value_cache);

  w.q.assign(static_cast<size_t>(rows_p) * Dp, 0.0f);
  w.out.assign(static_cast<size_t>(rows_p) * Dp, 0.0f);
  w.kt.resize(static_cast<size_t>(Dp) * kKeyTile);
  w.v.resize(static_cast<size_t>(kKeyTile) * Dp);
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
  const int kv_end = attn_query_position(s, q0 + tokens - 1) + 1;
  for (int k0 = 0; k0 < kv_end; k0 += kKeyTile) {
    const int nk = std::min(kKeyTile, kv_end - k0);
    bool key_ok[kKeyTile];
    std::fill(w.kt.begin(), w.kt.end(), 0.0f);
    for (int kk = 0; kk < kKeyTile; ++kk) {
      const int64_t off = kk < nk ? paged_key_offset(p, b, k0 + kk, kv_head) : -1;
      key_ok[kk] = off >= 0;
      float* vrow = w.v.data() + static_cast<size_t>(kk) * Dp;
      std::fill(vrow, vrow + Dp, 0.0f);
      if (off < 0) continue;
      for (int d = 0; d < D; ++d) {
        w.kt[static_cast<size_t>(d) * kKeyTile + kk] = to_f32(key_cache[off + d]);
        vrow[d] = to_f32(value_cache[off + d]);
      }
    }
    std::fill(w.scores.begin(), w.scores.end(), 0.0f);
    gemm_acc(w.q.data(), Dp, w.kt.data(), kKeyTile, Dp, w.scores.data(), kKeyTile, rows_p, kKeyTile);
    for (int r = 0; r < rows; ++r) {
      float* srow = w.scores.data() + static_cast<size_t>(r) * kKeyTile;
      const int last = w.pos[r] - k0;  // keys kk <= last are causal for this row
      float tile_max = kNegInf;
      for (int kk = 0; kk < kKeyTile; ++kk) {
        const bool live = kk <= last && key_ok[kk];
        if (live) tile_max = std::max(tile_max, srow[kk]);
      }
      const SoftmaxStep step = softmax_step(w.m[r], tile_max);
      float sum = 0.0f;
      for (int kk = 0; kk < kKeyTile; ++kk) {
        const bool live = kk <= last && key_ok[kk];
        const float prob = live ? exp_vec(srow[kk] - step.m) : 0.0f;
        srow[kk] = prob;
        sum += prob;
      }
      w.l[r] = w.l[r] * step.alpha + sum;
      w.m[r] = step.m;
      float* orow = w.out.data() + static_cast<size_t>(r) * Dp;
      if (step.alpha != 1.0f)
        for (int d = 0; d < Dp; ++d) orow[d] *= step.alpha;
    }
    gemm_acc(w.scores.data(), kKeyTile, w.v.data(), Dp, nk, w.out.data(), Dp, rows_p, Dp);
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

CLEF_CPU_KERNEL void attention_block_f32(const PagedAttentionParams& p, int b, int h, int q0, int n, AttnScratch& w) {
  attention_block<float>(p, b, h, q0, n, w);
}
CLEF_CPU_KERNEL void attention_block_f16(const PagedAttentionParams& p, int b, int h, int q0, int n, AttnScratch& w) {
  attention_block<c10::Half>(p, b, h, q0, n, w);
}
CLEF_CPU_KERNEL void attention_block_bf16(const PagedAttentionParams& p, int b, int h, int q0, int n, AttnScratch& w) {
  attention_block<c10::BFloat16>(p, b, h, q0, n, w);
}

void paged_attention_cpu(const PagedAttentionParams& p, ScalarKind kind) {
  auto block_fn = kind == ScalarKind::F32   ? attention_block_f32
                  : kind == ScalarKind::F16 ? attention_block_f16
                                            : attention_block_bf16;
  const int group = p.num_q_heads / p.num_kv_heads;
  // About 64 rows per work item: enough to amortise each gathered key tile over many queries.
  const int block_tokens = std::max(1, 64 / group);
  // Work items: (sequence, query block, kv head), listed per sequence so items stay balanced by length.
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
      block_fn(p, b, kv_head, q0, block_tokens, scratch);
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
