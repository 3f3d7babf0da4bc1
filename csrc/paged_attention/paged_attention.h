// Paged KV cache and attention over it: parameters and the index/math functions shared by the CUDA
// kernels (paged_attention_kernels.cuh) and the CPU implementation (paged_attention_cpu.cpp).
//
// Layout:
//   key_cache, value_cache  [num_blocks, block_size, Hkv, D]  contiguous, dtype of the queries
//   slot_mapping            [N] int32: cache slot (block * block_size + offset) of each new token; < 0 skips
//   query                   [N, Hq, D]  last dim contiguous, any token/head stride
//   cu_seqlens_q            [B + 1] int32: sequence b's queries are tokens [cu[b], cu[b+1])
//   context_lens            [B] int32: keys in sequence b's context, the new tokens included (already cached)
//   block_tables            [B, max_blocks] int32: physical block of each logical block of sequence b
//   out                     [N, Hq, D] contiguous
// Query i of sequence b sits at position context_len - q_len + i and attends keys [0, that position]:
// causal inside the new chunk, everything in the cached prefix. One op serves prefill chunks, prefix-cache
// hits (short q_len, long context) and decode (q_len = 1). Query head h reads KV head h / (Hq / Hkv).
#pragma once

#include "common/hd.h"

namespace clef {

struct CacheWriteParams {
  const void* key = nullptr;
  const void* value = nullptr;
  int64_t key_token_stride = 0, key_head_stride = 0;
  int64_t value_token_stride = 0, value_head_stride = 0;
  void* key_cache = nullptr;
  void* value_cache = nullptr;
  const int32_t* slot_mapping = nullptr;
  int64_t num_tokens = 0;
  int num_kv_heads = 0, head_dim = 0, block_size = 0, num_blocks = 0;
};

struct PagedAttentionParams {
  const void* query = nullptr;
  int64_t query_token_stride = 0, query_head_stride = 0;
  const void* key_cache = nullptr;
  const void* value_cache = nullptr;
  void* out = nullptr;
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* context_lens = nullptr;
  const int32_t* block_tables = nullptr;
  int64_t block_table_stride = 0;
  int64_t num_tokens = 0;
  int batch = 0;
  int num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
  int block_size = 0, num_blocks = 0, max_blocks_per_seq = 0;
  float scale = 1.0f;
};

// Offset of (slot, kv head, d = 0) in a cache laid out [num_blocks, block_size, Hkv, D]; a slot is
// block * block_size + offset-in-block, so the flat slot index is also the row of the [slots, Hkv, D] view.
CLEF_HD int64_t cache_slot_offset(int64_t slot, int kv_head, int num_kv_heads, int head_dim) {
  return (slot * num_kv_heads + kv_head) * static_cast<int64_t>(head_dim);
}

CLEF_HD bool cache_slot_valid(int64_t slot, int num_blocks, int block_size) {
  return slot >= 0 && slot < static_cast<int64_t>(num_blocks) * block_size;
}

struct AttnSeq {
  int64_t q_start;
  int q_len;
  int context_len;
};

// Inconsistent metadata (the CPU entry rejects it; the CUDA kernels cannot afford to look) becomes an
// empty sequence or a shorter context, never a read outside the tensors.
CLEF_HD AttnSeq attn_sequence(const PagedAttentionParams& p, int b) {
  AttnSeq s;
  s.q_start = p.cu_seqlens_q[b];
  int64_t end = p.cu_seqlens_q[b + 1];
  if (s.q_start < 0 || end > p.num_tokens || end < s.q_start) end = s.q_start = 0;
  s.q_len = static_cast<int>(end - s.q_start);
  int ctx = p.context_lens[b];
  const int capacity = p.max_blocks_per_seq * p.block_size;
  s.context_len = ctx < 0 ? 0 : (ctx > capacity ? capacity : ctx);
  return s;
}

// Position of query i of the chunk: the last key it may attend (inclusive). Negative: attends nothing.
CLEF_HD int attn_query_position(const AttnSeq& s, int i) { return s.context_len - s.q_len + i; }

CLEF_HD int attn_kv_head(int q_head, int num_q_heads, int num_kv_heads) {
  return q_head / (num_q_heads / num_kv_heads);
}

// Offset of key `pos` of sequence b (kv head h, d = 0) in the caches, or -1 if its block-table entry
// points outside the cache.
CLEF_HD int64_t paged_key_offset(const PagedAttentionParams& p, int b, int pos, int kv_head) {
  const int32_t block = p.block_tables[b * p.block_table_stride + pos / p.block_size];
  if (block < 0 || block >= p.num_blocks) return -1;
  const int64_t slot = static_cast<int64_t>(block) * p.block_size + pos % p.block_size;
  return cache_slot_offset(slot, kv_head, p.num_kv_heads, p.head_dim);
}

CLEF_HD int64_t attn_query_offset(int64_t token, int q_head, const PagedAttentionParams& p) {
  return token * p.query_token_stride + q_head * p.query_head_stride;
}
CLEF_HD int64_t attn_out_offset(int64_t token, int q_head, const PagedAttentionParams& p) {
  return (token * p.num_q_heads + q_head) * static_cast<int64_t>(p.head_dim);
}

// Online softmax: a row's running max m and sum l meet a new tile whose max is tile_max.
struct SoftmaxStep {
  float m;      // new running max
  float alpha;  // factor for what was accumulated so far
};
CLEF_HD SoftmaxStep softmax_step(float m_old, float tile_max) {
  SoftmaxStep s;
  s.m = max_f32(m_old, tile_max);
  s.alpha = exp_f32(m_old - s.m);  // m_old = kNegInf (nothing seen yet) gives 0, or 1 if still nothing
  return s;
}

}  // namespace clef
