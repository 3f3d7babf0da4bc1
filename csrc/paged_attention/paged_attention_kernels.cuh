// CUDA kernels for the paged KV cache (device code only; see conv1d_kernels.cuh for who compiles it).
//
// paged_attention_wmma_kernel (tensor cores; f16 from sm_70, bf16 from sm_80): one CTA of 4 warps owns
// (sequence, KV head, tile of 64 query rows). Its rows are the tile's tokens x the G = Hq/Hkv query heads
// that share the KV head (clef-flash: 16 tokens x 4 heads), so each K/V tile read from the cache serves
// the whole group. Keys stream through shared memory, in the cache dtype, a tile of 32 or 64 at a time,
// the block table walked per tile; tiles past the CTA's last causal position are never read. Each warp
// owns 16 rows: S = Q K^T and O += P V through nvcuda::wmma 16x16x16 (fp32 accumulation), the online
// softmax in fp32 between them, P rounded once to the cache dtype for the second product. O stays in
// accumulator fragments for the whole context.
//
// paged_attention_kernel (SIMT, fp32 math): one CTA per 16 rows. The fallback for fp32 caches, head dims
// the tensor-core kernel does not tile, and decode packs (paged_attention_choose_kernel decides).
//
// paged_attention_wmma2_kernel (tensor cores v2, forced with kernel="wmma2"; see its section below): v1's
// CTA over 8 warps, O's columns split over warp pairs, the next K/V tile prefetched into registers, and
// a split-context pass (with paged_attention_split_combine_kernel) when the grid is smaller than the GPU.
#pragma once

#include "common/cuda_utils.cuh"
#include "common/wmma_utils.cuh"
#include "paged_attention/paged_attention.h"

namespace clef {

constexpr int kCacheWriteThreads = 128;
constexpr int kAttnThreads = 128;                        // kAttnRows (16) query rows per CTA
constexpr int kAttnRowLanes = kAttnThreads / kAttnRows;  // lanes scoring one row: 8
constexpr int kWmmaThreads = 32 * kWmmaWarps;

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

// KEYS: keys per shared-memory tile (paged_attention_simt_keys picks it from the device's limit). The ", 1"
// (one CTA an SM is enough): without it ptxas for sm_120 squeezes the fp32 tiles into 64-72 registers and
// spills 12-40 bytes; the other archs' register counts are the same either way (check_archs).
template <typename T, int D, int KEYS>
__global__ void __launch_bounds__(kAttnThreads, 1) paged_attention_kernel(PagedAttentionParams p) {
  constexpr int QS = D + 1;  // padded row strides: lanes reading different rows hit different banks
  constexpr int KS = D + 1;
  constexpr int OUT_PER_THREAD = kAttnRows * D / kAttnThreads;
  constexpr int KEYS_PER_LANE = KEYS / kAttnRowLanes;
  static_assert((kAttnRows * D) % kAttnThreads == 0, "output tile must split evenly over the threads");
  static_assert(KEYS % kAttnRowLanes == 0 && KEYS <= kAttnThreads, "a key tile must split over a row's lanes");

  const int group = p.num_q_heads / p.num_kv_heads;  // at most kAttnRows (checked by the host entry)
  const int tile_tokens = kAttnRows / group;  // a group that does not divide the tile leaves rows dead (tile_row_token)
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
    const int qi = tile_row_token(q0, r, group, tile_tokens);
    const int head = kv_head * group + r % group;
    q_s[r * QS + d] = qi < s.q_len ? to_f32(query[attn_query_offset(s.q_start + qi, head, p) + d]) * p.scale : 0.0f;
  }
  // Keys this tile may need: up to the causal position of its last token.
  const int kv_end = attn_query_position(s, min_int(q0 + tile_tokens, s.q_len) - 1) + 1;

  // Scoring layout: row sr, keys sl + 8 m.
  const int sr = tid / kAttnRowLanes;
  const int sl = tid % kAttnRowLanes;
  const int s_qi = tile_row_token(q0, sr, group, tile_tokens);
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
    const int qi = tile_row_token(q0, r, group, tile_tokens);
    if (qi >= s.q_len) continue;
    const int head = kv_head * group + r % group;
    // A row that saw no key (only possible with inconsistent metadata) is written as zeros.
    const float value = l_s[r] > 0.0f ? acc[i] / l_s[r] : 0.0f;
    out[attn_out_offset(s.q_start + qi, head, p) + d] = from_f32<T>(value);
  }
}

// ---- tensor cores ------------------------------------------------------------------------------
// (CLEF_WMMA_ARCH and WmmaCompiled: common/wmma_utils.cuh.)
#if defined(CLEF_WMMA_ARCH)

// Query tiles are handed out last first: CTAs start roughly in index order, and under the causal mask a
// sequence's last tile attends the most keys, so the longest CTAs do not trail at the end of the grid.
// (The grid is bounded by the whole pack; a tile past a sequence's queries exits at once.)
CLEF_HD int wmma_query_tile(int grid_x, int block_x) { return grid_x - 1 - block_x; }

// Both tensor-core kernels' pieces that do the same job the same way.

// Row r of the CTA's 64 query rows is query token q0 + r / group, query head kv_head * group + r % group;
// rows past the sequence's queries are zeros (and are never written out). THREADS: the CTA's.
template <typename T, int D, int ROW_STRIDE, int THREADS>
__device__ __forceinline__ void stage_query_rows(T* q_s, const PagedAttentionParams& p, const AttnSeq& s, int q0,
                                                 int group, int kv_head) {
  constexpr int VEC = 8;  // elements per 16-byte copy
  const T* query = static_cast<const T*>(p.query);
  const int tile_tokens = kWmmaRows / group;
  for (int e = threadIdx.x; e < kWmmaRows * (D / VEC); e += THREADS) {
    const int r = e / (D / VEC), c = (e % (D / VEC)) * VEC;
    const int qi = tile_row_token(q0, r, group, tile_tokens);
    T* dst = q_s + r * ROW_STRIDE + c;
    if (qi < s.q_len)
      copy16(dst, query + attn_query_offset(s.q_start + qi, kv_head * group + r % group, p) + c);
    else
      zero16(dst);
  }
}

// The mapping of accumulator elements to lanes is unspecified, but load, mma and store agree on it: a
// fragment loaded from a tile holding each element's row index tells every lane the row of each of its
// elements, which the per-row softmax rescaling of O needs. Kept as 4 bits per element (one register on
// a GPU: D = 256 needs every other one for O).
template <int ELEMS>
struct AccumulatorRows {
  unsigned packed[(ELEMS + 7) / 8];
  __device__ __forceinline__ unsigned operator[](int i) const { return (packed[i / 8] >> (4 * (i % 8))) & 15u; }
};

// Learnt in `scratch` (256 floats of the warp's own, 32-byte aligned; free again after a __syncwarp).
template <typename Accumulator>
__device__ __forceinline__ AccumulatorRows<Accumulator::num_elements> accumulator_rows(float* scratch, int lane) {
  for (int e = lane; e < 256; e += 32) scratch[e] = static_cast<float>(e / 16);
  __syncwarp();
  AccumulatorRows<Accumulator::num_elements> rows = {};
  Accumulator row_index;
  nvcuda::wmma::load_matrix_sync(row_index, scratch, 16, nvcuda::wmma::mem_row_major);
#pragma unroll
  for (int i = 0; i < Accumulator::num_elements; ++i)
    rows.packed[i / 8] |= static_cast<unsigned>(row_index.x[i]) << (4 * (i % 8));
  return rows;
}

// One tile of the online softmax for the row that lanes 2r and 2r+1 share (keys `parity` + 2 m), in fp32:
// the scale is applied to the fp32 scores, not to the 2-byte queries. A key the row may not attend
// (live(kk) false) scores kNegInf (-1e30), which the exp pass turns into 0; real scores are assumed above
// it, as the running max's starting value (hd.h) already assumes in every kernel. The probabilities may
// overwrite the scores (the same row bytes). Updates l_run; the caller keeps m_run (the step's m).
template <typename T, int KEYS, typename Live>
__device__ __forceinline__ SoftmaxStep softmax_row_tile(const float* score_row, T* prob_row, float scale, Live live,
                                                        float m_run, float& l_run, int parity) {
  constexpr int KEYS_PER_LANE = KEYS / 2;
  float score[KEYS_PER_LANE];
  float tile_max = kNegInf;
#pragma unroll
  for (int m = 0; m < KEYS_PER_LANE; ++m) {
    const int kk = parity + 2 * m;
    score[m] = live(kk) ? score_row[kk] * scale : kNegInf;
    tile_max = max_f32(tile_max, score[m]);
  }
  tile_max = group_max<2>(tile_max);
  const SoftmaxStep step = softmax_step(m_run, tile_max);
  __syncwarp();  // both lanes of a row have read its scores before its probabilities overwrite them
  float tile_sum = 0.0f;
#pragma unroll
  for (int m = 0; m < KEYS_PER_LANE; ++m) {
    // Rounded once to the cache dtype for the tensor cores; the row sum adds the rounded values, so
    // the weights that multiply V are exactly the ones that normalise the row.
    const T prob = from_f32<T>(score[m] > kNegInf ? exp_f32(score[m] - step.m) : 0.0f);
    prob_row[parity + 2 * m] = prob;
    tile_sum += to_f32(prob);
  }
  tile_sum = group_sum<2>(tile_sum);
  l_run = l_run * step.alpha + tile_sum;
  return step;
}

// KEYS: keys per K/V tile (paged_attention_wmma_keys picks it from the device's limit).
template <typename T, int D, int KEYS>
__device__ __forceinline__ void paged_attention_wmma_tile(const PagedAttentionParams& p) {
  namespace wmma = nvcuda::wmma;
  using Layout = WmmaLayout<D, KEYS>;
  using Accumulator = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
  constexpr int RS = Layout::kRowStride;
  constexpr int SS = Layout::kScoreStride;
  constexpr int PS = 2 * SS;        // probabilities (2-byte) written over the score rows: same row bytes
  constexpr int D_TILES = D / 16;   // 16-column tiles of a head
  constexpr int K_TILES = KEYS / 16;
  constexpr int VEC = 8;            // elements per 16-byte copy
  constexpr int ELEMS = Accumulator::num_elements;

  const int group = p.num_q_heads / p.num_kv_heads;  // at most kMaxGroup (paged_attention_wmma_unsupported)
  const int tile_tokens = kWmmaRows / group;  // a group that does not divide the tile leaves rows dead (tile_row_token)
  const int kv_head = blockIdx.y;
  const int b = blockIdx.z;
  const AttnSeq s = attn_sequence(p, b);
  const int q0 = wmma_query_tile(gridDim.x, blockIdx.x) * tile_tokens;
  if (q0 >= s.q_len) return;  // uniform over the CTA

  CLEF_DYNAMIC_SHARED_ALIGNED(unsigned char, wmma_smem, 128);
  T* q_s = reinterpret_cast<T*>(wmma_smem + Layout::kQ);  // [64 rows][RS], unscaled
  T* k_s = reinterpret_cast<T*>(wmma_smem + Layout::kK);  // [KEYS][RS]
  T* v_s = reinterpret_cast<T*>(wmma_smem + Layout::kV);  // [KEYS][RS]
  float* s_s = reinterpret_cast<float*>(wmma_smem + Layout::kScores);  // [64 rows][SS]
  float* alpha_s = reinterpret_cast<float*>(wmma_smem + Layout::kAlpha);
  int64_t* key_off_s = reinterpret_cast<int64_t*>(wmma_smem + Layout::kKeyOffsets);  // [2][KEYS]

  const T* key_cache = static_cast<const T*>(p.key_cache);
  const T* value_cache = static_cast<const T*>(p.value_cache);
  T* out = static_cast<T*>(p.out);
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;

  stage_query_rows<T, D, RS, kWmmaThreads>(q_s, p, s, q0, group, kv_head);

  // Each lane's accumulator elements' rows, learnt in the warp's own score rows.
  float* warp_s = s_s + 16 * warp * SS;
  const AccumulatorRows<ELEMS> rows_of = accumulator_rows<Accumulator>(warp_s, lane);
  __syncwarp();

  // Keys the CTA may need (up to the causal position of its last token) and the ones this warp's rows
  // may need: a warp skips the products of a tile wholly past its rows' positions.
  const int kv_end = attn_query_position(s, min_int(q0 + tile_tokens, s.q_len) - 1) + 1;
  const int warp_first_token = tile_row_token(q0, 16 * warp, group, tile_tokens);
  const bool warp_live = warp_first_token < s.q_len;
  const int warp_kv_end =
      warp_live ? attn_query_position(s, min_int(tile_row_token(q0, 16 * warp + 15, group, tile_tokens), s.q_len - 1)) + 1
                : 0;

  // Softmax layout: lanes 2r and 2r+1 share row 16 warp + r, keys half + 2 m.
  const int row = 16 * warp + lane / 2;
  const int half = lane % 2;
  const int row_token = tile_row_token(q0, row, group, tile_tokens);
  const int row_pos = row_token < s.q_len ? attn_query_position(s, row_token) : -1;
  float m_run = kNegInf, l_run = 0.0f;

  Accumulator acc[D_TILES];
#pragma unroll
  for (int j = 0; j < D_TILES; ++j) wmma::fill_fragment(acc[j], 0.0f);

  for (int k0 = 0, tile = 0; k0 < kv_end; k0 += KEYS, ++tile) {
    int64_t* offsets = key_off_s + (tile % 2) * KEYS;
    for (int kk = tid; kk < KEYS; kk += kWmmaThreads)
      offsets[kk] = k0 + kk < kv_end ? paged_key_offset(p, b, k0 + kk, kv_head) : -1;
    __syncthreads();  // also: every warp is done with the previous tile's K and V (and Q is staged)
    for (int e = tid; e < KEYS * (D / VEC); e += kWmmaThreads) {
      const int kk = e / (D / VEC), c = (e % (D / VEC)) * VEC;
      const int64_t off = offsets[kk];
      // Keys outside the context are zeros, never cache contents: a NaN there would survive P = 0.
      if (off >= 0) {
        copy16(k_s + kk * RS + c, key_cache + off + c);
        copy16(v_s + kk * RS + c, value_cache + off + c);
      } else {
        zero16(k_s + kk * RS + c);
        zero16(v_s + kk * RS + c);
      }
    }
    __syncthreads();
    if (!warp_live || k0 >= warp_kv_end) continue;  // uniform over the warp

    // S = Q K^T for the warp's 16 rows: K is [key][d] in shared memory, i.e. K^T read column-major. One
    // 16-key tile at a time, so that next to O (128 registers at D = 256) only one score tile is live.
#pragma unroll 1
    for (int j = 0; j < K_TILES; ++j) {
      Accumulator scores;
      wmma::fill_fragment(scores, 0.0f);
#pragma unroll 4
      for (int t = 0; t < D_TILES; ++t) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> q_frag;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> k_frag;
        wmma::load_matrix_sync(q_frag, q_s + 16 * warp * RS + 16 * t, RS);
        wmma::load_matrix_sync(k_frag, k_s + 16 * j * RS + 16 * t, RS);
        wmma::mma_sync(scores, q_frag, k_frag, scores);
      }
      wmma::store_matrix_sync(warp_s + 16 * j, scores, SS, wmma::mem_row_major);
    }
    __syncwarp();

    // Online softmax in fp32, the probabilities written over the row's scores.
    auto live = [&](int kk) {
      const bool in_tile = offsets[kk] >= 0;
      return CLEF_FAULT(wmma_skip_causal_mask, in_tile && k0 + kk <= row_pos, in_tile);
    };
    T* p_row = reinterpret_cast<T*>(s_s + row * SS);
    const SoftmaxStep step = softmax_row_tile<T, KEYS>(s_s + row * SS, p_row, p.scale, live, m_run, l_run, half);
    m_run = step.m;
    if (half == 0) alpha_s[row] = step.alpha;
    __syncwarp();

    float alpha[ELEMS];
#pragma unroll
    for (int i = 0; i < ELEMS; ++i) {
      // (The fault: assuming the simulator's 256 elements are in row-major order, as no GPU lays them out.)
      const unsigned r = CLEF_FAULT(wmma_assumes_element_order, rows_of[i], static_cast<unsigned>(i / 16));
      alpha[i] = alpha_s[16 * warp + r];
    }
#pragma unroll
    for (int j = 0; j < D_TILES; ++j) {
#pragma unroll
      for (int i = 0; i < ELEMS; ++i) acc[j].x[i] *= alpha[i];
    }

    // O += P V: P [16 rows][KEYS] from the warp's score rows, V [key][d] row-major; one 16-key slice of P
    // live at a time (an f16 fragment takes 8 registers on every arch).
    const T* p_warp = reinterpret_cast<const T*>(warp_s);
#pragma unroll 1
    for (int t = 0; t < K_TILES; ++t) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> p_frag;
      wmma::load_matrix_sync(p_frag, p_warp + 16 * t, PS);
      const T* v_rows = v_s + 16 * CLEF_FAULT(wmma_tile_offset, t, t ^ 1) * RS;
#pragma unroll
      for (int j = 0; j < D_TILES; ++j) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> v_frag;
        wmma::load_matrix_sync(v_frag, v_rows + 16 * j, RS);
        wmma::mma_sync(acc[j], p_frag, v_frag, acc[j]);
      }
    }
  }
  if (!warp_live) return;  // after the last barrier of the CTA
  // (The fault: the tile's last warp's rows doubled.)
  if (CLEF_FAULT(wmma_last_warp_rows_doubled, false, warp == kWmmaThreads / 32 - 1)) {
#pragma unroll
    for (int j = 0; j < D_TILES; ++j)
      for (int i = 0; i < ELEMS; ++i) acc[j].x[i] *= 2.0f;
  }

  // Each 16 x 16 accumulator tile goes out through the warp's score rows as fp32 staging; lanes 2r, 2r+1
  // (which hold row r's l) normalise and write 8 columns of row r each.
  const int out_row = 16 * warp + lane / 2;
  const int out_token = tile_row_token(q0, out_row, group, tile_tokens);
  const int out_head = kv_head * group + out_row % group;
#pragma unroll
  for (int j = 0; j < D_TILES; ++j) {
    __syncwarp();  // the previous tile's staging (or the last P) has been read
    wmma::store_matrix_sync(warp_s, acc[j], 16, wmma::mem_row_major);
    __syncwarp();
    if (out_token < s.q_len) {
      T* dst = out + attn_out_offset(s.q_start + out_token, out_head, p) + 16 * j + 8 * half;
      const float* src = warp_s + (lane / 2) * 16 + 8 * half;
#pragma unroll
      for (int c = 0; c < 8; ++c) dst[c] = from_f32<T>(l_run > 0.0f ? src[c] / l_run : 0.0f);  // no key: zeros
    }
  }
}

#endif  // CLEF_WMMA_ARCH

template <typename T, int D, int KEYS>
__global__ void __launch_bounds__(kWmmaThreads) paged_attention_wmma_kernel(PagedAttentionParams p) {
#if defined(CLEF_WMMA_ARCH)
  if constexpr (WmmaCompiled<T>::value) {
    paged_attention_wmma_tile<T, D, KEYS>(p);
  } else {
    __trap();
  }
#else
  (void)p;
  __trap();
#endif
}

// ---- tensor cores, v2 ----------------------------------------------------------------------------
// paged_attention_wmma2_kernel: v1's CTA (sequence, KV head, 64 query rows) over 8 warps. Warps 2w and 2w+1
// (a pair) own rows 16w..16w+15 together. Per K/V tile:
//   S:  each warp of the pair computes every other 16-key sub-tile of the pair's scores into shared
//       memory, then one named barrier over the pair. Splitting S (rather than both warps computing all
//       of it) keeps the tensor-core work of v1; sharing the fp32 scores (rather than probabilities
//       computed by one warp) lets each warp run the whole rows' softmax itself, so the pair needs that
//       one barrier a tile and no second one before P V. The softmax is SIMT work small next to the
//       products (16 rows x 32 keys a warp), and both warps compute bit-identical m, l and P.
//   PV: each warp multiplies its own P by its half of V's columns into its half of O.
// The next tile's K/V is loaded into registers (16-byte loads from the paged cache) while this tile
// computes and stored to shared memory after the barrier that ends it; the tile after that has its key
// offsets walked from the block table before that barrier too. O is rescaled only when a row's max rose.
// With few CTAs (paged_attention_wmma2_splits), blockIdx.z also names a part of the CTA's keys, and the
// part's unnormalised rows go to a workspace that paged_attention_split_combine_kernel merges.
constexpr int kWmma2Threads = 32 * kWmma2Warps;
constexpr int kWmma2PairThreads = 64;
constexpr int kSplitCombineThreads = 256;

#if defined(CLEF_WMMA_ARCH)

template <typename T, int D, int KEYS>
__device__ __forceinline__ void paged_attention_wmma2_tile(const PagedAttentionParams& p) {
  namespace wmma = nvcuda::wmma;
  using Layout = Wmma2Layout<D, KEYS>;
  using Accumulator = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
  constexpr int RS = Layout::kRowStride;
  constexpr int SS = Layout::kScoreStride;
  constexpr int PS = Layout::kProbStride;
  constexpr int D_TILES = D / 16;
  constexpr int HALF_TILES = D_TILES / 2;  // output column tiles a warp holds
  constexpr int K_TILES = KEYS / 16;
  constexpr int VEC = 8;                   // elements per 16-byte copy
  constexpr int ELEMS = Accumulator::num_elements;
  constexpr int CHUNKS_PER_THREAD = KEYS * (D / VEC) / kWmma2Threads;  // 16-byte pieces of K (and of V)
  static_assert(KEYS * (D / VEC) % kWmma2Threads == 0, "a K/V tile must split evenly over the threads");
  static_assert(KEYS <= kWmma2Threads, "one thread walks the block table per key");
  static_assert(2 * Layout::kKeys * RS * 2 >= kWmma2Warps * 256 * 4, "the row-index scratch lives in K/V");
  static_assert(16 * RS * 2 >= 2 * 256 * 4, "a pair's Q rows hold both warps' output staging");
  static_assert(kWmma2Warps / 2 <= kMaxBarrierGroups, "a named barrier (group_bar_sync) per warp pair");

  const int group = p.num_q_heads / p.num_kv_heads;  // at most kMaxGroup (paged_attention_wmma2_unsupported)
  const int tile_tokens = kWmmaRows / group;  // a group that does not divide the tile leaves rows dead (tile_row_token)
  const int kv_head = blockIdx.y;
  const int b = blockIdx.z / p.splits;
  const int split = blockIdx.z % p.splits;
  const AttnSeq s = attn_sequence(p, b);
  const int query_tile = wmma_query_tile(gridDim.x, blockIdx.x);
  const int q0 = query_tile * tile_tokens;
  if (q0 >= s.q_len) return;  // uniform over the CTA
  const int kv_end = attn_query_position(s, min_int(q0 + tile_tokens, s.q_len) - 1) + 1;
  const int num_tiles = kv_end > 0 ? ceil_div(kv_end, KEYS) : 0;
  const int active_splits = p.splits > 1 ? wmma2_active_splits(num_tiles, p.splits) : 1;
  if (split >= active_splits) return;  // uniform: this CTA's context fills fewer parts
  const int first_tile = wmma2_split_first_tile(num_tiles, active_splits, split);
  const int tiles = wmma2_split_first_tile(num_tiles, active_splits, split + 1) - first_tile;

  CLEF_DYNAMIC_SHARED_ALIGNED(unsigned char, wmma2_smem, 128);
  T* q_s = reinterpret_cast<T*>(wmma2_smem + Layout::kQ);  // [64 rows][RS], unscaled
  T* k_s = reinterpret_cast<T*>(wmma2_smem + Layout::kK);  // [KEYS][RS]
  T* v_s = reinterpret_cast<T*>(wmma2_smem + Layout::kV);  // [KEYS][RS]
  int64_t* key_off_s = reinterpret_cast<int64_t*>(wmma2_smem + Layout::kKeyOffsets);  // [2][KEYS]

  const T* key_cache = static_cast<const T*>(p.key_cache);
  const T* value_cache = static_cast<const T*>(p.value_cache);
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int pair = warp / 2;
  const int half = warp % 2;  // which half of the output columns (and which key sub-tiles of S)
  float* pair_s = reinterpret_cast<float*>(wmma2_smem + Layout::kScores) + 16 * pair * SS;  // [16][SS]
  T* p_warp = reinterpret_cast<T*>(wmma2_smem + Layout::kProbs) + 16 * warp * PS;         // [16][PS]
  float* alpha_w = reinterpret_cast<float*>(wmma2_smem + Layout::kAlpha) + 16 * warp;

  auto key_offset = [&](int tile, int kk) -> int64_t {
    const int pos = tile * KEYS + kk;
    return pos < kv_end ? paged_key_offset(p, b, pos, kv_head) : -1;
  };
  if (tid < KEYS && tiles > 0) key_off_s[tid] = key_offset(first_tile, tid);
  if (tid < KEYS && tiles > 1) key_off_s[KEYS + tid] = key_offset(first_tile + 1, tid);

  stage_query_rows<T, D, RS, kWmma2Threads>(q_s, p, s, q0, group, kv_head);

  // Each lane's accumulator elements' rows, learnt in scratch space of the K/V tiles that the first
  // barrier below protects.
  const AccumulatorRows<ELEMS> rows_of =
      accumulator_rows<Accumulator>(reinterpret_cast<float*>(wmma2_smem + Layout::kK) + 256 * warp, lane);

  // The pair's keys: a pair skips the products of a tile wholly past its rows' positions.
  const int pair_first_token = tile_row_token(q0, 16 * pair, group, tile_tokens);
  const bool pair_live = pair_first_token < s.q_len;
  const int pair_kv_end =
      pair_live ? attn_query_position(s, min_int(tile_row_token(q0, 16 * pair + 15, group, tile_tokens), s.q_len - 1)) + 1
                : 0;

  // Softmax layout: lanes 2r and 2r+1 of both warps share row 16 pair + r, keys key_lane + 2 m.
  const int row = 16 * pair + lane / 2;
  const int key_lane = lane % 2;
  const int row_token = tile_row_token(q0, row, group, tile_tokens);
  const int row_pos = row_token < s.q_len ? attn_query_position(s, row_token) : -1;
  float m_run = kNegInf, l_run = 0.0f;

  Accumulator acc[HALF_TILES];
#pragma unroll
  for (int j = 0; j < HALF_TILES; ++j) wmma::fill_fragment(acc[j], 0.0f);
  const int first_column_tile = half * HALF_TILES;

  // The next K/V tile in flight: this thread's 16-byte pieces of it, loaded before a tile's products and
  // stored to shared memory after the barrier that ends them. Keys outside the context are zeros, never
  // cache contents: a NaN there would survive P = 0.
  uint4 k_next[CHUNKS_PER_THREAD], v_next[CHUNKS_PER_THREAD];
  auto load_tile = [&](const int64_t* offsets) {
#pragma unroll
    for (int c = 0; c < CHUNKS_PER_THREAD; ++c) {
      const int e = tid + kWmma2Threads * c;
      const int kk = e / (D / VEC), col = (e % (D / VEC)) * VEC;
      const int64_t off = offsets[kk];
      k_next[c] = off >= 0 ? load16(key_cache + off + col) : make_uint4(0u, 0u, 0u, 0u);
      v_next[c] = off >= 0 ? load16(value_cache + off + col) : make_uint4(0u, 0u, 0u, 0u);
    }
  };
  auto store_tile = [&]() {
#pragma unroll
    for (int c = 0; c < CHUNKS_PER_THREAD; ++c) {
      const int e = tid + kWmma2Threads * c;
      const int kk = e / (D / VEC), col = (e % (D / VEC)) * VEC;
      store16(k_s + kk * RS + col, k_next[c]);
      store16(v_s + kk * RS + col, v_next[c]);
    }
  };

  __syncthreads();  // Q, the first offsets and every warp's row-index scratch
  if (tiles > 0) {
    load_tile(key_off_s);
    store_tile();
  }
  __syncthreads();

  for (int i = 0; i < tiles; ++i) {
    const int k0 = (first_tile + i) * KEYS;
    const int64_t* offsets = key_off_s + (i % 2) * KEYS;
    const bool more = i + 1 < tiles;
    // (The fault: the registers filled from this tile's offsets again, so the next tile is a stale copy.)
    if (more) load_tile(key_off_s + CLEF_FAULT(wmma2_prefetch_one_tile_late, (i + 1) % 2, i % 2) * KEYS);
    // The tile after next: its block-table walk in flight with the products, stored after the barrier.
    const int64_t after_next = tid < KEYS && i + 2 < tiles ? key_offset(first_tile + i + 2, tid) : -1;

    if (pair_live && k0 < pair_kv_end) {  // uniform over the pair
      // S = Q K^T, this warp's 16-key sub-tiles of the pair's rows (K^T read column-major, as v1). A
      // 16-key tile (a T4's at D = 256) has one: the pair's odd warp waits for it at the barrier.
#pragma unroll 1
      for (int j = half; j < K_TILES; j += 2) {
        Accumulator scores;
        wmma::fill_fragment(scores, 0.0f);
#pragma unroll 4
        for (int t = 0; t < D_TILES; ++t) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> q_frag;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> k_frag;
          wmma::load_matrix_sync(q_frag, q_s + 16 * pair * RS + 16 * t, RS);
          wmma::load_matrix_sync(k_frag, k_s + 16 * j * RS + 16 * t, RS);
          wmma::mma_sync(scores, q_frag, k_frag, scores);
        }
        wmma::store_matrix_sync(pair_s + 16 * j, scores, SS, wmma::mem_row_major);
      }
      // (The fault: v1's whole-CTA count, 128, for a barrier only the pair's 64 threads reach.)
      group_bar_sync(pair, CLEF_FAULT(wmma2_pair_barrier_count, kWmma2PairThreads, kWmmaThreads));

      // Online softmax of the whole rows in fp32, into this warp's own probabilities.
      auto live = [&](int kk) { return offsets[kk] >= 0 && k0 + kk <= row_pos; };
      const SoftmaxStep step = softmax_row_tile<T, KEYS>(pair_s + (lane / 2) * SS, p_warp + (lane / 2) * PS, p.scale,
                                                         live, m_run, l_run, key_lane);
      const bool max_rose = step.m > m_run;
      m_run = step.m;
      if (key_lane == 0) alpha_w[lane / 2] = step.alpha;
      __syncwarp();

      // alpha is exactly 1 for a row whose max stayed, so the per-element pass over O (64 multiplies a
      // lane at D = 256) is skipped when no row of the warp rose, as most tiles of a long context do.
      // (The fault: skipped unless every row rose.)
      if (CLEF_FAULT(wmma2_rescale_vote, __any_sync(0xffffffffu, max_rose), __all_sync(0xffffffffu, max_rose))) {
        float alpha[ELEMS];
#pragma unroll
        for (int i_el = 0; i_el < ELEMS; ++i_el) alpha[i_el] = alpha_w[rows_of[i_el]];
#pragma unroll
        for (int j = 0; j < HALF_TILES; ++j) {
#pragma unroll
          for (int i_el = 0; i_el < ELEMS; ++i_el) acc[j].x[i_el] *= alpha[i_el];
        }
      }

      // O[:, this warp's columns] += P V[:, those columns], one 16-key slice of P live at a time.
#pragma unroll 1
      for (int t = 0; t < K_TILES; ++t) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> p_frag;
        wmma::load_matrix_sync(p_frag, p_warp + 16 * t, PS);
#pragma unroll
        for (int j = 0; j < HALF_TILES; ++j) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> v_frag;
          wmma::load_matrix_sync(v_frag, v_s + 16 * t * RS + 16 * (first_column_tile + j), RS);
          wmma::mma_sync(acc[j], p_frag, v_frag, acc[j]);
        }
      }
    } else {
      // A pair with no products on this tile passes its barrier all the same, so that every warp of the CTA
      // passes the same sequence of barriers. (compute-sanitizer's racecheck on an H200 reported the K/V and
      // key-offset stores below, which follow a __syncthreads, as racing with PV's reads when some pairs had
      // passed one named barrier more than others: benchmarks/RESULTS.md, 2026-12-04, the second GPU run.)
      group_bar_sync(pair, kWmma2PairThreads);
    }
    if (!more) break;  // uniform: nothing left to stage
    __syncthreads();   // every warp is done with this tile's K, V and offsets
    store_tile();
    if (tid < KEYS) key_off_s[(i % 2) * KEYS + tid] = after_next;
    __syncthreads();
  }
  if (!pair_live) return;  // after the CTA's last barrier; the rows are past the sequence's queries

  // (The fault: the last warp's rows, its half of the columns, doubled.)
  if (CLEF_FAULT(wmma2_last_warp_rows_doubled, false, warp == kWmma2Warps - 1)) {
#pragma unroll
    for (int j = 0; j < HALF_TILES; ++j)
      for (int i = 0; i < ELEMS; ++i) acc[j].x[i] *= 2.0f;
  }
  // (The fault: the pair's column halves swapped on the way out.)
  const int out_column_tile = CLEF_FAULT(wmma2_swap_column_halves, first_column_tile, HALF_TILES - first_column_tile);
  if (p.splits > 1) {
    // A part of a split CTA: its unnormalised rows, max and sum, for the combine.
    const Wmma2Partials partials = wmma2_partials(p);
    const int64_t slot = wmma2_split_slot(p, b, kv_head, query_tile, split);
    float* out_rows = partials.out + (slot * kWmmaRows + 16 * pair) * D;
#pragma unroll
    for (int j = 0; j < HALF_TILES; ++j)
      wmma::store_matrix_sync(out_rows + 16 * (out_column_tile + j), acc[j], D, wmma::mem_row_major);
    if (half == 0 && key_lane == 0) {
      partials.max[slot * kWmmaRows + row] = m_run;
      partials.sum[slot * kWmmaRows + row] = l_run;
    }
    return;
  }

  // Each 16 x 16 accumulator tile goes out through 1 KB of the pair's Q rows as fp32 staging, as v1's
  // through its score rows: both warps of the pair passed the barrier after their last S, so neither
  // reads Q any more, and no other pair ever does. (Not a helper shared with v1: as one, ptxas gave v1
  // 127 registers instead of 96 at D = 64 on sm_90, a CTA an SM fewer.)
  float* staging = reinterpret_cast<float*>(q_s + 16 * pair * RS) + 256 * half;
  T* out = static_cast<T*>(p.out);
  const int out_head = kv_head * group + row % group;
#pragma unroll
  for (int j = 0; j < HALF_TILES; ++j) {
    __syncwarp();  // the previous tile's staging has been read
    wmma::store_matrix_sync(staging, acc[j], 16, wmma::mem_row_major);
    __syncwarp();
    if (row_token < s.q_len) {
      T* dst = out + attn_out_offset(s.q_start + row_token, out_head, p) + 16 * (out_column_tile + j) + 8 * key_lane;
      const float* src = staging + (lane / 2) * 16 + 8 * key_lane;
#pragma unroll
      for (int c = 0; c < 8; ++c) dst[c] = from_f32<T>(l_run > 0.0f ? src[c] / l_run : 0.0f);  // no key: zeros
    }
  }
}

#endif  // CLEF_WMMA_ARCH

template <typename T, int D, int KEYS>
__global__ void __launch_bounds__(kWmma2Threads) paged_attention_wmma2_kernel(PagedAttentionParams p) {
#if defined(CLEF_WMMA_ARCH)
  if constexpr (WmmaCompiled<T>::value) {
    paged_attention_wmma2_tile<T, D, KEYS>(p);
  } else {
    __trap();
  }
#else
  (void)p;
  __trap();
#endif
}

// Merges the parts of each split CTA (grid: v2's without the parts): per row, m = max m_s, then
// O = sum exp(m_s - m) O_s, l = sum exp(m_s - m) l_s, out = O / l. `keys` is v2's tile, for the parts the
// CTA's context filled (wmma2_active_splits). Threads run along the head dim, so the partial rows and
// the output rows are read and written coalesced.
template <typename T>
__global__ void __launch_bounds__(kSplitCombineThreads) paged_attention_split_combine_kernel(PagedAttentionParams p,
                                                                                           int keys) {
  const int group = p.num_q_heads / p.num_kv_heads;
  const int tile_tokens = kWmmaRows / group;
  const int kv_head = blockIdx.y;
  const int b = blockIdx.z;
  const AttnSeq s = attn_sequence(p, b);
  const int query_tile = blockIdx.x;
  const int q0 = query_tile * tile_tokens;
  if (q0 >= s.q_len) return;  // uniform over the CTA
  const int kv_end = attn_query_position(s, min_int(q0 + tile_tokens, s.q_len) - 1) + 1;
  const int active_splits = wmma2_active_splits(kv_end > 0 ? ceil_div(kv_end, keys) : 0, p.splits);
  const Wmma2Partials partials = wmma2_partials(p);
  const int64_t first_slot = wmma2_split_slot(p, b, kv_head, query_tile, 0);

  CLEF_DYNAMIC_SHARED(float, combine_smem);
  float* weight_s = combine_smem;                                // [64 rows][splits]: exp(m_s - m) / l
  const int tid = threadIdx.x;
  if (tid < kWmmaRows && tile_row_token(q0, tid, group, tile_tokens) < s.q_len) {
    const int r = tid;
    float m = kNegInf;
    for (int part = 0; part < active_splits; ++part) m = max_f32(m, partials.max[(first_slot + part) * kWmmaRows + r]);
    float l = 0.0f;
    for (int part = 0; part < active_splits; ++part) {
      const int64_t at = (first_slot + part) * kWmmaRows + r;
      // (The fault: every part weighted by the first part's max instead of its own.)
      const float weight = exp_f32(CLEF_FAULT(wmma2_combine_wrong_max, partials.max[at],
                                              partials.max[first_slot * kWmmaRows + r]) - m);
      weight_s[r * p.splits + part] = weight;
      l += weight * partials.sum[at];
    }
    const float inverse_l = l > 0.0f ? 1.0f / l : 0.0f;  // no key: zeros
    for (int part = 0; part < active_splits; ++part) weight_s[r * p.splits + part] *= inverse_l;
  }
  __syncthreads();
  T* out = static_cast<T*>(p.out);
  const int d_count = p.head_dim;
  for (int e = tid; e < kWmmaRows * d_count; e += kSplitCombineThreads) {
    const int r = e / d_count, d = e % d_count;
    const int token = tile_row_token(q0, r, group, tile_tokens);
    if (token >= s.q_len) continue;
    float value = 0.0f;
    for (int part = 0; part < active_splits; ++part)
      value += weight_s[r * p.splits + part] * partials.out[((first_slot + part) * kWmmaRows + r) * d_count + d];
    out[attn_out_offset(s.q_start + token, kv_head * group + r % group, p) + d] = from_f32<T>(value);
  }
}

}  // namespace clef
