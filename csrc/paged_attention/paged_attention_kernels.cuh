// CUDA kernels for the paged KV cache (device code only; see conv1d_kernels.cuh for who compiles it).
//
// paged_attention_kernel: one CTA owns (sequence, KV head, tile of query tokens). Its 16 rows are the
// tile's tokens x the G = Hq/Hkv query heads that share the KV head, so each K/V tile read from the
// cache serves the whole group (GQA). Keys stream through shared memory a tile at a time with an online
// softmax; tiles past the tile's last causal position are never read. fp32 SIMT math: correctness
// first, a tensor-core version is future work measured against this one.
#pragma once

#include "common/cuda_utils.cuh"
#include "paged_attention/paged_attention.h"

namespace clef {

constexpr int kCacheWriteThreads = 128;
constexpr int kAttnThreads = 128;
constexpr int kAttnRows = 16;                            // query rows (token x head) per CTA
constexpr int kAttnRowLanes = kAttnThreads / kAttnRows;  // lanes scoring one row: 8

// Keys per shared-memory tile: 16 for D = 256 keeps the CTA under sm_75's 64 KB of shared memory.
template <int D>
struct AttnTiling {
  static constexpr int kKeys = D >= 256 ? 16 : 32;
  static constexpr int kKeysPerLane = kKeys / kAttnRowLanes;
};

template <typename T>
__global__ void __launch_bounds__(kCacheWriteThreads) reshape_and_cache_kernel(CacheWriteParams p) {
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  if (!cache_slot_valid(slot, p.num_blocks, p.block_size)) return;
  const T* key = static_cast<const T*>(p.key);
  const T* value = static_cast<const T*>(p.value);
  T* key_cache = static_cast<T*>(p.key_cache);
  T* value_cache = static_cast<T*>(p.value_cache);
  for (int e = threadIdx.x; e < p.num_kv_heads * p.head_dim; e += kCacheWriteThreads) {
    const int h = e / p.head_dim, d = e % p.head_dim;
    const int64_t dst = cache_slot_offset(slot, h, p.num_kv_heads, p.head_dim) + d;
    key_cache[dst] = key[token * p.key_token_stride + h * p.key_head_stride + d];
    value_cache[dst] = value[token * p.value_token_stride + h * p.value_head_stride + d];
  }
}

template <int D>
CLEF_HD constexpr int paged_attention_smem_floats() {
  // q (padded rows) + k (padded rows) + v + probabilities + alpha + l, then the key offsets (int64).
  constexpr int keys = AttnTiling<D>::kKeys;
  return kAttnRows * (D + 1) + keys * (D + 1) + keys * D + kAttnRows * keys + 2 * kAttnRows + 2 * keys;
}

template <typename T, int D>
__global__ void __launch_bounds__(kAttnThreads) paged_attention_kernel(PagedAttentionParams p) {
  constexpr int QS = D + 1;  // padded row strides: lanes reading different rows hit different banks
  constexpr int KS = D + 1;
  constexpr int OUT_PER_THREAD = kAttnRows * D / kAttnThreads;
  constexpr int KEYS = AttnTiling<D>::kKeys;
  constexpr int KEYS_PER_LANE = AttnTiling<D>::kKeysPerLane;
  static_assert((kAttnRows * D) % kAttnThreads == 0, "output tile must split evenly over the threads");

  const int group = p.num_q_heads / p.num_kv_heads;  // divides kAttnRows (checked by the host entry)
  const int tile_tokens = kAttnRows / group;
  const int kv_head = blockIdx.y;
  const int b = blockIdx.z;
  const AttnSeq s = attn_sequence(p, b);
  const int q0 = blockIdx.x * tile_tokens;
  if (q0 >= s.q_len) return;  // uniform over the CTA: no barrier is skipped by part of it

  CLEF_DYNAMIC_SHARED(float, smem);
  float* q_s = smem;                        // [rows][QS], pre-scaled
  float* k_s = q_s + kAttnRows * QS;        // [keys][KS]
  float* v_s = k_s + KEYS * KS;        // [keys][D]
  float* p_s = v_s + KEYS * D;         // [rows][keys]
  float* alpha_s = p_s + kAttnRows * KEYS;
  float* l_s = alpha_s + kAttnRows;
  int64_t* key_off_s = reinterpret_cast<int64_t*>(l_s + kAttnRows);  // 8-byte aligned: every size above is even

  const T* query = static_cast<const T*>(p.query);
  const T* key_cache = static_cast<const T*>(p.key_cache);
  const T* value_cache = static_cast<const T*>(p.value_cache);
  T* out = static_cast<T*>(p.out);
  const int tid = threadIdx.x;

  // Row r of the tile is query token q0 + r / group, query head kv_head * group + r % group.
  for (int e = tid; e < kAttnRows * D; e += kAttnThreads) {
    const int r = e / D, d = e % D;
    const int qi = q0 + r / group;
    const int head = kv_head * group + r % group;
    q_s[r * QS + d] = qi < s.q_len ? to_f32(query[attn_query_offset(s.q_start + qi, head, p) + d]) * p.scale : 0.0f;
  }
  // Keys this tile may need: up to the causal position of its last token.
  const int kv_end = attn_query_position(s, min_int(q0 + tile_tokens, s.q_len) - 1) + 1;

  // Scoring layout: row sr, keys sl + 8 m.
  const int sr = tid / kAttnRowLanes;
  const int sl = tid % kAttnRowLanes;
  const int s_qi = q0 + sr / group;
  const int s_pos = s_qi < s.q_len ? attn_query_position(s, s_qi) : -1;
  float m_run = kNegInf, l_run = 0.0f;
  float acc[OUT_PER_THREAD];
#pragma unroll
  for (int i = 0; i < OUT_PER_THREAD; ++i) acc[i] = 0.0f;

  for (int k0 = 0; k0 < kv_end; k0 += KEYS) {
    if (tid < KEYS) {
      const int pos = k0 + tid;
      key_off_s[tid] = pos < kv_end ? paged_key_offset(p, b, pos, kv_head) : -1;
    }
    __syncthreads();  // also orders the previous tile's reads of k_s/v_s/p_s before these writes
    for (int e = tid; e < KEYS * D; e += kAttnThreads) {
      const int kk = e / D, d = e % D;
      const int64_t off = key_off_s[kk];
      k_s[kk * KS + d] = off >= 0 ? to_f32(key_cache[off + d]) : 0.0f;
      v_s[kk * D + d] = off >= 0 ? to_f32(value_cache[off + d]) : 0.0f;
    }
    __syncthreads();

    float score[KEYS_PER_LANE];
    bool live[KEYS_PER_LANE];
    float tile_max = kNegInf;
#pragma unroll
    for (int m = 0; m < KEYS_PER_LANE; ++m) {
      const int kk = sl + kAttnRowLanes * m;
      float dot = 0.0f;
#pragma unroll 8
      for (int d = 0; d < D; ++d) dot += q_s[sr * QS + d] * k_s[kk * KS + d];
      live[m] = k0 + kk <= s_pos && key_off_s[kk] >= 0;
      score[m] = dot;
      if (live[m]) tile_max = max_f32(tile_max, dot);
    }
    tile_max = group_max<kAttnRowLanes>(tile_max);
    const SoftmaxStep step = softmax_step(m_run, tile_max);
    float tile_sum = 0.0f;
#pragma unroll
    for (int m = 0; m < KEYS_PER_LANE; ++m) {
      const float prob = live[m] ? exp_f32(score[m] - step.m) : 0.0f;
      p_s[sr * KEYS + sl + kAttnRowLanes * m] = prob;
      tile_sum += prob;
    }
    tile_sum = group_sum<kAttnRowLanes>(tile_sum);
    l_run = l_run * step.alpha + tile_sum;
    m_run = step.m;
    if (sl == 0) alpha_s[sr] = step.alpha;
    __syncthreads();

#pragma unroll
    for (int i = 0; i < OUT_PER_THREAD; ++i) {
      const int e = tid + kAttnThreads * i;
      const int r = e / D, d = e % D;
      float a = acc[i] * alpha_s[r];
#pragma unroll 8
      for (int kk = 0; kk < KEYS; ++kk) a += p_s[r * KEYS + kk] * v_s[kk * D + d];
      acc[i] = a;
    }
  }
  if (sl == 0) l_s[sr] = l_run;
  __syncthreads();
#pragma unroll
  for (int i = 0; i < OUT_PER_THREAD; ++i) {
    const int e = tid + kAttnThreads * i;
    const int r = e / D, d = e % D;
    const int qi = q0 + r / group;
    if (qi >= s.q_len) continue;
    const int head = kv_head * group + r % group;
    // A row that saw no key (only possible with inconsistent metadata) is written as zeros.
    const float value = l_s[r] > 0.0f ? acc[i] / l_s[r] : 0.0f;
    out[attn_out_offset(s.q_start + qi, head, p) + d] = from_f32<T>(value);
  }
}

}  // namespace clef
