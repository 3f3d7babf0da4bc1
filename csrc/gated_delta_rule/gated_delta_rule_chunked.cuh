// The chunked gated delta rule on tensor cores (device code only; see conv1d_kernels.cuh for who compiles it).
//
// Per sequence and value head, tokens in chunks of C = 64 with in-chunk cumulative log decay G_t (fp32), gates
// Gamma[t, s] = e^(G_t - G_s), normalised keys K and queries Q (scale folded in), and the state S [Dk, Dv]
// at the chunk's start (fp32). The chunk's deltas u_t = beta_t (v_t - (e^(G_t) S + the chunk's earlier
// updates)^T k_t) solve a unit lower-triangular system (the WY / UT form):
//   A = strictly-lower(diag(beta) (Gamma (.) K K^T)),   T = (I + A)^-1,
//   W = T diag(beta e^G) K,   U = T diag(beta) V,   v_new = U - W S,
//   o = diag(e^G) Q S + (Q K^T (.) Gamma (.) causal) v_new,
//   S <- e^(G_last) S + K^T diag(e^(G_last - G)) v_new.
// Three passes, each its own kernel:
//   1. gdr_chunk_prepare_kernel, a CTA per (chunk, value head), all in parallel: G, A, T, W and U, and the
//      normalised keys (by the first value head of each key head);
//   2. gdr_chunk_state_kernel, a CTA per (sequence, value head, BV state columns), chunk after chunk: writes
//      the state at each chunk's start (h) and v_new, and carries S in fp32 accumulator fragments. Its variants
//      (gated_delta_rule.h gdr_state_variant: by residency) stage a chunk's W, keys and U columns in shared
//      memory, the next chunk's fetched while the current one computes (cp.async from sm_80, registers before),
//      or read them with the tensor cores straight from the workspace (small cards: a T4 holds one 128-column
//      CTA an SM this way);
//   3. gdr_chunk_output_kernel, a CTA per (chunk, value head), all in parallel: o.
// Every product runs on nvcuda::wmma (m16n16k16, f16 from sm_70, bf16 from sm_80, fp32 accumulators); T
// is inverted by blocked forward substitution in fp32 (four 16 x 16 diagonal blocks by substitution, then
// the off-diagonal blocks T_ij = -T_ii sum_{m=j}^{i-1} A_im T_mj by block distance).
//
// Where values are rounded to the activation dtype (f16 unit roundoff 2^-11, bf16 2^-8), each once, from fp32:
//   - K and Q after their L2 normalisation (|k| = 1, |q| = scale): so raw keys whose K K^T would overflow
//     f16 are never multiplied unnormalised; the sums of squares are fp32;
//   - T diag(beta e^G) and T diag(beta), the operands of W and U (T itself is fp32);
//   - W and U (then v_new) in the workspace, between passes;
//   - S times a power-of-two scale for the products W S and Q S (gdr_state_scale: its largest element in
//     [2^14, 2^15), inside f16's range at full precision; exact to undo). S itself never leaves fp32;
//   - v_new decayed to the chunk's end, the operand of the state update (from the fp32 v_new, not the rounded one);
//   - P = Q K^T (.) Gamma (.) causal, the operand of P v_new;
//   - o, once, as the serial kernel does.
// G, Gamma, e^G, the system, its inverse, the state and every accumulation stay fp32. Rows past a sequence's
// last token are zeros with beta = 0 and the last token's G (their rows of T are the identity's, their W, U
// and v_new rows zero, every Gamma they meet at most 1: no pass computes an inf or a NaN in any row, which the
// simulator checks, CLEF_CHECK_FINITE); they are written to the workspace's tiles and never to `out`.
//
// Threads: 4 warps a CTA. Warp w owns rows 16w..16w+15 of a chunk (in pass 2 also every fourth tile of S).
// A product tile's elements are read back through the warp's own fp32 staging tile in shared memory (the
// element-to-lane mapping of a fragment is unspecified): lane l takes row l / 2, columns 8 (l % 2) .. + 7.
#pragma once

#include "common/cuda_utils.cuh"
#include "common/wmma_utils.cuh"
#include "gated_delta_rule/gated_delta_rule.h"

namespace clef {

#if defined(CLEF_WMMA_ARCH)

namespace gdr_chunked {

namespace wmma = nvcuda::wmma;
using Accumulator = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
template <typename T>
using RowA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
template <typename T>
using ColA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major>;
template <typename T>
using RowB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
template <typename T>
using ColB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;

// acc += A B over `steps` 16-deep slices: A's 16 rows at `a` (row-major, lda), B's 16 columns at `b`
// (row-major, ldb: its rows are the depth).
template <typename T>
__device__ __forceinline__ void mma_ab(Accumulator& acc, const T* a, int lda, const T* b, int ldb, int steps) {
  for (int k = 0; k < steps; ++k) {
    RowA<T> af;
    RowB<T> bf;
    wmma::load_matrix_sync(af, a + 16 * k, lda);
    wmma::load_matrix_sync(bf, b + 16 * k * ldb, ldb);
    wmma::mma_sync(acc, af, bf, acc);
  }
}

// acc += A B^T: B's 16 rows at `b` (row-major, ldb), read column-major as B^T.
template <typename T>
__device__ __forceinline__ void mma_abt(Accumulator& acc, const T* a, int lda, const T* b, int ldb, int steps) {
  for (int k = 0; k < steps; ++k) {
    RowA<T> af;
    ColB<T> bf;
    wmma::load_matrix_sync(af, a + 16 * k, lda);
    wmma::load_matrix_sync(bf, b + 16 * k, ldb);
    wmma::mma_sync(acc, af, bf, acc);
  }
}

// acc += A^T B: A's depth rows at `a` (row-major, lda) read column-major as A^T (16 of its columns), B row-major.
template <typename T>
__device__ __forceinline__ void mma_atb(Accumulator& acc, const T* a, int lda, const T* b, int ldb, int steps) {
  for (int k = 0; k < steps; ++k) {
    ColA<T> af;
    RowB<T> bf;
    wmma::load_matrix_sync(af, a + 16 * k * lda, lda);
    wmma::load_matrix_sync(bf, b + 16 * k * ldb, ldb);
    wmma::mma_sync(acc, af, bf, acc);
  }
}

// The accumulator tile into the warp's staging tile; the lanes may read it when this returns.
__device__ __forceinline__ void stage(float* scratch, const Accumulator& acc) {
  __syncwarp();  // the previous use of the staging tile is over
  wmma::store_matrix_sync(scratch, acc, kGdrScratchLd, wmma::mem_row_major);
  __syncwarp();
}

// Rows r < n of q or k (rows `token_stride` apart from `src`: one key head of the pack's first chunk token),
// L2-normalised (when l2norm) and times `factor` in fp32, rounded once to T into dst [64][LD]; rows >= n zeros.
// A warp per row.
template <typename T, int D, int LD>
__device__ __forceinline__ void stage_normalized_rows(T* dst, const T* src, int64_t token_stride, int n, bool l2norm,
                                                      float factor) {
  constexpr int PER_LANE = (D + 31) / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < kGdrChunk; r += kGdrChunkWarps) {
    float x[PER_LANE];
    float sum_squares = 0.0f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const int d = lane + 32 * i;
      x[i] = (r < n && d < D) ? to_f32(src[r * token_stride + d]) : 0.0f;
      sum_squares += x[i] * x[i];
    }
    sum_squares = group_sum<32>(sum_squares);
    const float f = gdr_key_factor(sum_squares, l2norm) * factor;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const int d = lane + 32 * i;
      if (d < D) dst[r * LD + d] = from_f32<T>(x[i] * f);
    }
  }
}

// Eight values rounded to T and stored as one 16-byte word at dst (16-byte aligned: the workspace's rows, the
// shared tiles' rows, 8-column halves of 16-column tiles).
template <typename T>
__device__ __forceinline__ void store8(T* dst, const float* values) {
  union {
    uint4 word;
    T element[8];
  } packed;
#pragma unroll
  for (int c = 0; c < 8; ++c) packed.element[c] = from_f32<T>(values[c]);
  store16(dst, packed.word);
}

// ROWS rows of COLS columns from the workspace (rows row_stride elements apart) into dst [ROWS][LD], 16 bytes at
// a time: the workspace's base is 256-byte aligned and its rows and column blocks are multiples of 16 columns,
// so every source row is 16-byte aligned (the simulator checks it). Rows >= n are zeros.
template <typename T, int ROWS, int COLS, int LD>
__device__ __forceinline__ void stage_rows(T* dst, const T* src, int64_t row_stride, int n) {
  constexpr int VEC = 8;  // 2-byte elements per 16-byte copy
  static_assert(COLS % VEC == 0 && LD % VEC == 0, "rows must split into 16-byte pieces");
  for (int e = threadIdx.x; e < ROWS * (COLS / VEC); e += kGdrChunkThreads) {
    const int r = e / (COLS / VEC), c = (e % (COLS / VEC)) * VEC;
    if (r < n)
      copy16(dst + r * LD + c, src + r * row_stride + c);
    else
      zero16(dst + r * LD + c);
  }
}

// Rows r < ROWS of a [ROWS][LD] shared tile (COLS columns) to contiguous rows of COLS at dst (a workspace tile),
// 16 bytes at a time.
template <typename T, int ROWS, int COLS, int LD>
__device__ __forceinline__ void store_rows(T* dst, const T* src) {
  constexpr int VEC = 8;
  for (int e = threadIdx.x; e < ROWS * (COLS / VEC); e += kGdrChunkThreads) {
    const int r = e / (COLS / VEC), c = (e % (COLS / VEC)) * VEC;
    copy16(dst + r * COLS + c, src + r * LD + c);
  }
}

// Eight fp32 values a lane computed, checked finite where a test can see it (the simulator; nothing on a GPU).
__device__ __forceinline__ void check_finite8(const float* values, const char* what) {
#pragma unroll
  for (int c = 0; c < 8; ++c) CLEF_CHECK_FINITE(values[c], what);
}

// The workspace's tiles (gated_delta_rule.h GdrChunkedWorkspace): 64 rows each per (chunk, head).
template <typename T, int D>
struct Workspace {
  float* gcum;      // [chunks][Hv][64]
  T* keys;          // [chunks][Hk][64][D]: normalised, rounded once
  T* w;             // [chunks][Hv][64][D]
  T* u;             // [chunks][Hv][64][D]: U, then v_new
  T* h;             // [chunks][Hv][D][D]
  float* h_scale;   // [chunks][Hv][D / 16]
  int num_k_heads, num_v_heads;

  __device__ __forceinline__ static Workspace of(const GatedDeltaRuleParams& p) {
    const GdrChunkedWorkspace l = gdr_chunked_workspace(p.num_tokens, p.batch, p.num_k_heads, p.num_v_heads, D,
                                                        static_cast<int>(sizeof(T)));
    unsigned char* base = static_cast<unsigned char*>(p.workspace);
    return Workspace{reinterpret_cast<float*>(base + l.gcum), reinterpret_cast<T*>(base + l.keys),
                     reinterpret_cast<T*>(base + l.w),        reinterpret_cast<T*>(base + l.u),
                     reinterpret_cast<T*>(base + l.h),        reinterpret_cast<float*>(base + l.h_scale),
                     p.num_k_heads,                           p.num_v_heads};
  }
  __device__ __forceinline__ int64_t value_tile(int64_t chunk, int hv) const { return chunk * num_v_heads + hv; }
  __device__ __forceinline__ float* gates(int64_t chunk, int hv) const { return gcum + value_tile(chunk, hv) * kGdrChunk; }
  __device__ __forceinline__ T* key_rows(int64_t chunk, int hk) const {
    return keys + (chunk * num_k_heads + hk) * kGdrChunk * D;
  }
  __device__ __forceinline__ T* w_rows(int64_t chunk, int hv) const { return w + value_tile(chunk, hv) * kGdrChunk * D; }
  __device__ __forceinline__ T* u_rows(int64_t chunk, int hv) const { return u + value_tile(chunk, hv) * kGdrChunk * D; }
  __device__ __forceinline__ T* state(int64_t chunk, int hv) const { return h + value_tile(chunk, hv) * D * D; }
  __device__ __forceinline__ float* state_scales(int64_t chunk, int hv) const {
    return h_scale + value_tile(chunk, hv) * (D / 16);
  }
};

// ---- pass 1: G, the system, its inverse, W and U ---------------------------------------------------
template <typename T, int D>
__device__ __forceinline__ void prepare(const GatedDeltaRuleParams& p) {
  constexpr int C = kGdrChunk;
  constexpr int LDK = D + 8;
  constexpr int LDA = kGdrSystemLd;
  constexpr GdrPrepareLayout L = gdr_prepare_layout(D);
  const GdrChunkRef chunk = gdr_find_chunk(p, blockIdx.x);
  if (!chunk.valid) return;  // uniform over the CTA
  const int64_t chunk_index = blockIdx.x;
  const int hv = blockIdx.y;
  const int hk = gdr_key_head(hv, p.num_v_heads, p.num_k_heads);
  const int64_t t0 = chunk.start;
  const int n = chunk.len;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  CLEF_DYNAMIC_SHARED_ALIGNED(unsigned char, smem, 128);
  T* k_s = reinterpret_cast<T*>(smem + L.keys);             // normalised keys [64][LDK]
  float* a_s = reinterpret_cast<float*>(smem + L.system);   // A, fp32 [64][LDA] (strictly lower part)
  T* tw_s = reinterpret_cast<T*>(smem + L.system);          // then T diag(beta e^G) [64][LDA]
  T* tb_s = tw_s + C * LDA;                                 //  and T diag(beta) [64][LDA]
  float* t_s = reinterpret_cast<float*>(smem + L.inverse);  // T, fp32 [64][LDA] (lower part)
  T* v_s = reinterpret_cast<T*>(smem + L.inverse);          // then the values [64][LDK]
  float* staging = reinterpret_cast<float*>(smem + L.scratch);
  float* scratch = staging + warp * 16 * kGdrScratchLd;
  float* g_s = reinterpret_cast<float*>(smem + L.gates);    // g, then G
  float* beta_s = g_s + C;
  const Workspace<T, D> ws = Workspace<T, D>::of(p);

  if (tid < C) {
    const int64_t gate = gdr_gate_offset(t0 + tid, hv, p);
    g_s[tid] = tid < n ? p.g[gate] : 0.0f;
    beta_s[tid] = tid < n ? p.beta[gate] : 0.0f;
  }
  stage_normalized_rows<T, D, LDK>(k_s, static_cast<const T*>(p.k) + gdr_k_offset(t0, hk, p), p.k_token_stride, n,
                                   p.l2norm_qk, 1.0f);
  __syncthreads();
  // The normalised keys, once per key head (its first value head's CTA): the state and output passes read them.
  if (hv % (p.num_v_heads / p.num_k_heads) == 0) store_rows<T, C, D, LDK>(ws.key_rows(chunk_index, hk), k_s);
  // G_t = g_0 + ... + g_t summed in token order, as a sequential cumulative sum (the reference's) would. Past
  // the last token g is 0: those rows hold the last token's G, which every pass reads for them.
  float G = 0.0f;
  if (tid < C)
    for (int s = 0; s <= tid; ++s) G += g_s[s];
  __syncthreads();
  if (tid < C) {
    g_s[tid] = G;
    ws.gates(chunk_index, hv)[tid] = G;
  }

  // K K^T, the tiles on and below the diagonal: warp w computes row block w.
  for (int j = 0; j <= warp; ++j) {
    Accumulator acc;
    wmma::fill_fragment(acc, 0.0f);
    mma_abt(acc, k_s + 16 * warp * LDK, LDK, k_s + 16 * j * LDK, LDK, D / 16);
    wmma::store_matrix_sync(a_s + 16 * warp * LDA + 16 * j, acc, LDA, wmma::mem_row_major);
  }
  __syncthreads();
  // A[t][s] = beta_t Gamma[t][s] (k_t . k_s) for s < t (only the strictly lower part is ever read).
  for (int e = tid; e < C * C; e += kGdrChunkThreads) {
    const int t = e / C, s = e % C;
    if (s < t) {
      a_s[t * LDA + s] *= beta_s[t] * exp_f32(g_s[t] - g_s[s]);
      CLEF_CHECK_FINITE(a_s[t * LDA + s], "the chunked delta rule's system A");
    }
  }
  __syncthreads();

  // T = (I + A)^-1. Diagonal blocks: thread (block i, column c) solves (I + A_ii) x = e_c by substitution.
  if (tid < C) {
    const int i = tid / 16, c = tid % 16;
    const float* a_block = a_s + 16 * i * LDA + 16 * i;
    float x[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      float sum = 0.0f;
#pragma unroll
      for (int m = 0; m < r; ++m)
        if (m >= c) sum += a_block[r * LDA + m] * x[m];
      x[r] = r < c ? 0.0f : (r == c ? 1.0f : -sum);
    }
#pragma unroll
    for (int r = 0; r < 16; ++r) t_s[(16 * i + r) * LDA + 16 * i + c] = x[r];
  }
  // Off-diagonal blocks by distance: X_ij = sum_{m=j}^{i-1} A_im T_mj (every T_mj is nearer the diagonal:
  // already known), then T_ij = -T_ii X_ij. X lives in the warps' staging tiles (3 blocks at most).
  for (int dist = 1; dist < 4; ++dist) {
    __syncthreads();
    const int blocks = 4 - dist;
    for (int e = tid; e < blocks * 256; e += kGdrChunkThreads) {
      const int i = dist + e / 256, j = i - dist, r = (e / 16) % 16, c = e % 16;
      float sum = 0.0f;
      for (int m = j; m < i; ++m)
        for (int q = 0; q < 16; ++q) sum += a_s[(16 * i + r) * LDA + 16 * m + q] * t_s[(16 * m + q) * LDA + 16 * j + c];
      staging[e] = sum;
    }
    __syncthreads();
    for (int e = tid; e < blocks * 256; e += kGdrChunkThreads) {
      const int i = dist + e / 256, j = i - dist, r = (e / 16) % 16, c = e % 16;
      float sum = 0.0f;
      for (int q = 0; q <= r; ++q) sum += t_s[(16 * i + r) * LDA + 16 * i + q] * staging[(e / 256) * 256 + q * 16 + c];
      // (The fault: the blocks two or more from the diagonal left out.)
      t_s[(16 * i + r) * LDA + 16 * j + c] = CLEF_FAULT(gdr_t_far_blocks_zeroed, -sum, dist >= 2 ? 0.0f : -sum);
    }
  }
  __syncthreads();

  // The operands of W and U, rounded once: T diag(beta e^G) and T diag(beta), over A's bytes.
  for (int e = tid; e < C * C; e += kGdrChunkThreads) {
    const int t = e / C, s = e % C;
    if (s <= t) CLEF_CHECK_FINITE(t_s[t * LDA + s], "the chunked delta rule's inverse T");
    const float ts = s <= t ? t_s[t * LDA + s] * beta_s[s] : 0.0f;
    tw_s[t * LDA + s] = from_f32<T>(ts * CLEF_FAULT(gdr_w_without_decay, exp_f32(g_s[s]), 1.0f));
    tb_s[t * LDA + s] = from_f32<T>(ts);
  }
  __syncthreads();
  // The values come from the caller's tensor (any token stride): element by element.
  const T* v_rows = static_cast<const T*>(p.v) + gdr_v_offset(t0, hv, p);
  for (int e = tid; e < C * D; e += kGdrChunkThreads) {
    const int r = e / D, d = e % D;
    v_s[r * LDK + d] = r < n ? v_rows[r * p.v_token_stride + d] : from_f32<T>(0.0f);
  }
  __syncthreads();

  // W = T diag(beta e^G) K and U = T diag(beta) V: warp w's 16 rows, one 16-column tile at a time, every row of
  // the tile (past the last token: zeros). Row block w of T has nothing right of its diagonal block, so the
  // depth stops there.
  const int row = lane / 2, col = 8 * (lane % 2);
  const int t = 16 * warp + row;
  T* w_rows = ws.w_rows(chunk_index, hv);
  T* u_rows = ws.u_rows(chunk_index, hv);
  for (int jc = 0; jc < D / 16; ++jc) {
    for (int which = 0; which < 2; ++which) {
      Accumulator acc;
      wmma::fill_fragment(acc, 0.0f);
      mma_ab(acc, (which == 0 ? tw_s : tb_s) + 16 * warp * LDA, LDA, (which == 0 ? k_s : v_s) + 16 * jc, LDK,
             warp + 1);
      stage(scratch, acc);
      float* values = scratch + row * kGdrScratchLd + col;
      // (The fault: W's rows past the first 16 left out.)
      if (which == 0 && CLEF_FAULT(gdr_w_rows_past_16_zeroed, false, t >= 16))
        for (int c = 0; c < 8; ++c) values[c] = 0.0f;
      check_finite8(values, which == 0 ? "the chunked delta rule's W" : "the chunked delta rule's U");
      store8((which == 0 ? w_rows : u_rows) + t * D + 16 * jc + col, values);
    }
  }
}

// ---- pass 2: the state, chunk after chunk ---------------------------------------------------------
// A staged state pass's copies of a chunk's tiles into shared memory: W [64][D] and U's BV columns [64][BV] (read
// by the v_new product), the keys [64][D] (read by the state update). ASYNC (sm_80 on): cp.async, landing
// when the thread waits for its group (fetch_w_u then fetch_keys: two groups a chunk). Else through registers,
// one tile in flight at a time (8 uint4 a thread at D = 128, beside the state's fragments): the next W
// loaded from the chunk's start and stored once this chunk's v_new is done (with U's columns, copied then), the
// next keys loaded then and stored once the state update is done.
template <typename T, int D, int BV, bool ASYNC>
struct StateTiles {
  static constexpr int C = kGdrChunk, LDK = D + 8, LDS = BV + 8, VEC = 8;
  static constexpr int ROW_PIECES = C * (D / VEC) / kGdrChunkThreads;  // 16-byte pieces a thread carries of W
  static_assert(C * (D / VEC) % kGdrChunkThreads == 0, "a tile splits evenly over the CTA");
  T* w_s;
  T* k_s;
  T* u_s;
  int col0;
  uint4 next[ASYNC ? 1 : ROW_PIECES];  // the register path's tile in flight

  __device__ __forceinline__ static void piece(int e, int cols, int& r, int& c) {
    r = e / (cols / VEC);
    c = (e % (cols / VEC)) * VEC;
  }
  __device__ __forceinline__ void copy_rows(T* dst, int ld, const T* src, int cols) const {
    for (int e = threadIdx.x; e < C * (cols / VEC); e += kGdrChunkThreads) {
      int r, c;
      piece(e, cols, r, c);
      if constexpr (ASYNC)
        cp_async16(dst + r * ld + c, src + r * D + c);
      else
        copy16(dst + r * ld + c, src + r * D + c);
    }
  }
  // The chunk's W and U columns, and its keys: copies (ASYNC: two groups in flight).
  __device__ __forceinline__ void fetch_w_u(const T* w_rows, const T* u_rows) const {
    copy_rows(w_s, LDK, w_rows, D);
    copy_rows(u_s, LDS, u_rows + col0, BV);
    if constexpr (ASYNC) cp_async_commit();
  }
  __device__ __forceinline__ void fetch_keys(const T* key_rows) const {
    copy_rows(k_s, LDK, key_rows, D);
    if constexpr (ASYNC) cp_async_commit();
  }
  // The register path: a [64][D] tile of the workspace into registers (any time before land), ...
  __device__ __forceinline__ void load(const T* rows) {
#pragma unroll
    for (int i = 0; i < ROW_PIECES; ++i) {
      int r, c;
      piece(threadIdx.x + i * kGdrChunkThreads, D, r, c);
      next[i] = load16(rows + r * D + c);
    }
  }
  // ... then into a shared tile once no thread reads it.
  __device__ __forceinline__ void land(T* tile) const {
#pragma unroll
    for (int i = 0; i < ROW_PIECES; ++i) {
      int r, c;
      piece(threadIdx.x + i * kGdrChunkThreads, D, r, c);
      store16(tile + r * LDK + c, next[i]);
    }
  }
};

template <typename T, int D, int BV, bool STAGED, bool ASYNC>
__device__ __forceinline__ void carry_state(const GatedDeltaRuleParams& p) {
  constexpr int C = kGdrChunk;
  constexpr int LDK = D + 8;
  constexpr int LDS = BV + 8;
  constexpr int COL_TILES = BV / 16;
  constexpr int TILES = (D / 16) * COL_TILES;                             // S's tiles in this CTA's columns
  // Warp w holds tiles w MY_TILES ... (w + 1) MY_TILES - 1, row block by row block (tile t: rows 16 (t /
  // COL_TILES), columns 16 (t % COL_TILES)), so that the state update reads each row block's key fragment once.
  constexpr int MY_TILES = (TILES + kGdrChunkWarps - 1) / kGdrChunkWarps;
  static_assert(MY_TILES % COL_TILES == 0 || COL_TILES % MY_TILES == 0, "a warp's tiles share row blocks");
  constexpr GdrStateLayout L = gdr_state_layout(D, BV, STAGED);
  const int col0 = blockIdx.x * BV;
  const int hv = blockIdx.y;
  const int b = blockIdx.z;
  const int hk = gdr_key_head(hv, p.num_v_heads, p.num_k_heads);
  const PackedSeq s = gdr_sequence(p, b);
  const int first_chunk = gdr_first_chunk(p, b);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int row = lane / 2, col = 8 * (lane % 2);

  CLEF_DYNAMIC_SHARED_ALIGNED(unsigned char, smem, 128);
  T* s_s = reinterpret_cast<T*>(smem + L.state);      // S times its scale, rounded [D][LDS]
  T* vd_s = reinterpret_cast<T*>(smem + L.decayed);   // v_new e^(G_last - G_t), rounded [64][LDS]
  float* scratch = reinterpret_cast<float*>(smem + L.scratch) + warp * 16 * kGdrScratchLd;
  float* g_s = reinterpret_cast<float*>(smem + L.gates);
  float* reduce_s = reinterpret_cast<float*>(smem + L.reduce);
  const Workspace<T, D> ws = Workspace<T, D>::of(p);
  StateTiles<T, D, BV, ASYNC> tiles{reinterpret_cast<T*>(smem + L.w), reinterpret_cast<T*>(smem + L.keys),
                                    reinterpret_cast<T*>(smem + L.u), col0};

  // S in accumulator fragments, fp32, for the whole sequence: from the slot, or zeros.
  Accumulator S[MY_TILES];
#pragma unroll
  for (int m = 0; m < MY_TILES; ++m) {
    const int tile = warp * MY_TILES + m;
    if (tile >= TILES) continue;  // uniform over the warp
    const int i0 = 16 * (tile / COL_TILES), j0 = col0 + 16 * (tile % COL_TILES);
    __syncwarp();
#pragma unroll
    for (int c = 0; c < 8; ++c)
      scratch[row * kGdrScratchLd + col + c] =
          s.read_state ? p.states[gdr_state_offset(s.slot, hv, i0 + row, j0 + col + c, p)] : 0.0f;
    __syncwarp();
    wmma::load_matrix_sync(S[m], scratch, kGdrScratchLd, wmma::mem_row_major);
  }

  // Valid metadata never numbers a chunk past the workspace's bound; a GPU's cu_seqlens are not checked on the
  // host (packed_sequence keeps each sequence inside the pack, but garbage ones may overlap), so stop there.
  const int64_t max_chunks = gdr_max_chunks(p.num_tokens, p.batch);
  int chunks = gdr_num_chunks(s.len);
  if (first_chunk + chunks > max_chunks)
    chunks = static_cast<int>(max_chunks - first_chunk > 0 ? max_chunks - first_chunk : 0);
  // (The fault: the pack's last sequence stops a chunk short.)
  if (CLEF_FAULT(gdr_drops_last_chunk_of_pack, false, b == p.batch - 1 && chunks > 0)) --chunks;
  if constexpr (STAGED) {
    if (chunks > 0) {
      tiles.fetch_w_u(ws.w_rows(first_chunk, hv), ws.u_rows(first_chunk, hv));
      tiles.fetch_keys(ws.key_rows(first_chunk, hk));
    }
  }
  for (int c = 0; c < chunks; ++c) {
    const int64_t chunk = first_chunk + c;
    const bool more = c + 1 < chunks;
    T* u_rows = ws.u_rows(chunk, hv);
    if (tid < C) g_s[tid] = ws.gates(chunk, hv)[tid];
    // The register path: the next chunk's W on its way while this one's v_new is computed.
    if constexpr (STAGED && !ASYNC) {
      if (more) tiles.load(ws.w_rows(chunk + 1, hv));
    }

    // The state's scale: its largest magnitude over the CTA's columns.
    float largest = 0.0f;
#pragma unroll
    for (int m = 0; m < MY_TILES; ++m) {
      if (warp * MY_TILES + m >= TILES) continue;
      for (int i = 0; i < S[m].num_elements; ++i) largest = max_f32(largest, fabsf(S[m].x[i]));
    }
    largest = group_max<32>(largest);
    if (lane == 0) reduce_s[warp] = largest;
    __syncthreads();
    float largest_all = 0.0f;
    for (int w = 0; w < kGdrChunkWarps; ++w) largest_all = max_f32(largest_all, reduce_s[w]);
    const float scale = gdr_state_scale(largest_all);

    // h = S scale, rounded: the products' operand here and the output pass's (with its scale).
    T* h = ws.state(chunk, hv);
#pragma unroll
    for (int m = 0; m < MY_TILES; ++m) {
      const int tile = warp * MY_TILES + m;
      if (tile >= TILES) continue;
      const int i0 = 16 * (tile / COL_TILES), j0 = 16 * (tile % COL_TILES);
      stage(scratch, S[m]);
      float scaled[8];
#pragma unroll
      for (int cc = 0; cc < 8; ++cc) scaled[cc] = scratch[row * kGdrScratchLd + col + cc] * scale;
      check_finite8(scaled, "the chunked delta rule's scaled state");
      store8(s_s + (i0 + row) * LDS + j0 + col, scaled);
      store8(h + (i0 + row) * D + col0 + j0 + col, scaled);
    }
    if (tid < COL_TILES) ws.state_scales(chunk, hv)[col0 / 16 + tid] = scale;
    // This chunk's W and U (its keys may still be on the way). (The fault: not waited for.)
    if constexpr (STAGED && ASYNC) {
      if (!CLEF_FAULT(gdr_cp_async_not_waited, false, true)) cp_async_wait<1>();
    }
    __syncthreads();

    // v_new = U - W S (fp32), warp w's rows, every row of the chunk (past its last token: 0 - 0): rounded over U
    // in the workspace for the output pass, and decayed to the chunk's end (from the fp32 value) for the state
    // update.
    const float unscale = 1.0f / scale;  // exact: a power of two
    const float g_last = g_s[C - 1];     // the last token's G (rows past it hold it too)
    const int t = 16 * warp + row;
    const float to_end = exp_f32(g_last - g_s[t]);
    const T* w_operand = STAGED ? tiles.w_s + 16 * warp * LDK : ws.w_rows(chunk, hv) + 16 * warp * D;
#pragma unroll 1
    for (int cb = 0; cb < COL_TILES; ++cb) {
      Accumulator acc;
      wmma::fill_fragment(acc, 0.0f);
      // A few 16-deep slices at a time: a whole row of W's fragments at once (read from L2 in the direct
      // variants) would not fit beside the state's (one at a time where the state is 16 tiles a warp).
      constexpr int W_LD = STAGED ? LDK : D;
      if constexpr (MY_TILES >= 16) {
#pragma unroll 1
        for (int k = 0; k < D / 16; ++k) mma_ab(acc, w_operand + 16 * k, W_LD, s_s + 16 * (k * LDS + cb), LDS, 1);
      } else {
#pragma unroll 2
        for (int k = 0; k < D / 16; ++k) mma_ab(acc, w_operand + 16 * k, W_LD, s_s + 16 * (k * LDS + cb), LDS, 1);
      }
      stage(scratch, acc);
      float u[8], value[8], decayed[8];
      if constexpr (STAGED) {
#pragma unroll
        for (int cc = 0; cc < 8; ++cc) u[cc] = to_f32(tiles.u_s[t * LDS + 16 * cb + col + cc]);
      } else {
        union {
          uint4 word;
          T element[8];
        } packed;
        packed.word = load16(u_rows + t * D + col0 + 16 * cb + col);
#pragma unroll
        for (int cc = 0; cc < 8; ++cc) u[cc] = to_f32(packed.element[cc]);
      }
#pragma unroll
      for (int cc = 0; cc < 8; ++cc) {
        value[cc] = u[cc] - scratch[row * kGdrScratchLd + col + cc] * unscale;
        decayed[cc] = value[cc] * to_end;
      }
      check_finite8(value, "the chunked delta rule's v_new");
      store8(u_rows + t * D + col0 + 16 * cb + col, value);
      store8(vd_s + t * LDS + 16 * cb + col, decayed);
    }
    // (The fault: the register path's next W stored while the other warps still read this one.)
    if constexpr (STAGED && !ASYNC) {
      if (CLEF_FAULT(gdr_prefetch_lands_early, false, more)) tiles.land(tiles.w_s);
    }
    if constexpr (STAGED && ASYNC) cp_async_wait<0>();  // this chunk's keys
    __syncthreads();
    // W and U are no longer read: the next chunk's, in flight (ASYNC) or landed (registers) while the state
    // updates; on the register path the next keys start on their way.
    if constexpr (STAGED) {
      if (more) {
        if constexpr (ASYNC) {
          tiles.fetch_w_u(ws.w_rows(chunk + 1, hv), ws.u_rows(chunk + 1, hv));
        } else {
          tiles.land(tiles.w_s);
          tiles.copy_rows(tiles.u_s, LDS, ws.u_rows(chunk + 1, hv) + col0, BV);
          tiles.load(ws.key_rows(chunk + 1, hk));
        }
      }
    }

    // S = e^(G_last) S + K^T (decayed v_new), in the fragments: 16 tokens of depth at a time over every tile, so
    // that beside the state only one pair of operand fragments is live (the 128-column direct variant holds 16
    // tiles of S a warp).
    const float chunk_decay = CLEF_FAULT(gdr_state_not_carried, exp_f32(g_last), 0.0f);
    const T* keys = STAGED ? tiles.k_s : ws.key_rows(chunk, hk);
    constexpr int KEYS_LD = STAGED ? LDK : D;
#pragma unroll
    for (int m = 0; m < MY_TILES; ++m) {
      if (warp * MY_TILES + m >= TILES) continue;
      for (int i = 0; i < S[m].num_elements; ++i) S[m].x[i] *= chunk_decay;
    }
#pragma unroll 1
    for (int k = 0; k < C / 16; ++k) {
      ColA<T> key_fragment;  // K^T's rows of the tile's row block, 16 tokens deep
#pragma unroll
      for (int m = 0; m < MY_TILES; ++m) {
        const int tile = warp * MY_TILES + m;
        if (tile >= TILES) continue;  // uniform over the warp
        const int i0 = 16 * (tile / COL_TILES), j0 = 16 * (tile % COL_TILES);
        if (m % COL_TILES == 0) wmma::load_matrix_sync(key_fragment, keys + 16 * k * KEYS_LD + i0, KEYS_LD);
        RowB<T> value_fragment;
        wmma::load_matrix_sync(value_fragment, vd_s + 16 * k * LDS + j0, LDS);
        wmma::mma_sync(S[m], key_fragment, value_fragment, S[m]);
      }
    }
    __syncthreads();  // the next chunk's staging overwrites what this one read
    if constexpr (STAGED) {
      if (more) {
        if constexpr (ASYNC)
          tiles.fetch_keys(ws.key_rows(chunk + 1, hk));
        else
          tiles.land(tiles.k_s);
      }
    }
  }

  if (s.slot < 0) return;
#pragma unroll
  for (int m = 0; m < MY_TILES; ++m) {
    const int tile = warp * MY_TILES + m;
    if (tile >= TILES) continue;
    const int i0 = 16 * (tile / COL_TILES), j0 = col0 + 16 * (tile % COL_TILES);
    stage(scratch, S[m]);
#pragma unroll
    for (int cc = 0; cc < 8; ++cc)
      p.states[gdr_state_offset(s.slot, hv, i0 + row, j0 + col + cc, p)] = scratch[row * kGdrScratchLd + col + cc];
  }
}

// ---- pass 3: the outputs ----------------------------------------------------------------------------
template <typename T, int D, int OC>
__device__ __forceinline__ void output(const GatedDeltaRuleParams& p) {
  constexpr int C = kGdrChunk;
  constexpr int LDK = D + 8;
  constexpr int LDO = OC + 8;
  constexpr int LDP = kGdrSystemLd;
  constexpr GdrOutputLayout L = gdr_output_layout(D, OC);
  const GdrChunkRef chunk = gdr_find_chunk(p, blockIdx.x);
  if (!chunk.valid) return;  // uniform over the CTA
  const int64_t chunk_index = blockIdx.x;
  const int hv = blockIdx.y;
  const int hk = gdr_key_head(hv, p.num_v_heads, p.num_k_heads);
  const int64_t t0 = chunk.start;
  const int n = chunk.len;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int row = lane / 2, col = 8 * (lane % 2);
  const int t = 16 * warp + row;

  CLEF_DYNAMIC_SHARED_ALIGNED(unsigned char, smem, 128);
  T* q_s = reinterpret_cast<T*>(smem + L.queries);        // normalised, scaled queries [64][LDK]
  T* k_s = reinterpret_cast<T*>(smem + L.keys_or_state);  // normalised keys [64][LDK]
  T* h_s = reinterpret_cast<T*>(smem + L.keys_or_state);  // then OC columns of h [D][LDO]
  T* p_s = reinterpret_cast<T*>(smem + L.scores);         // P [64][LDP]
  T* vn_s = reinterpret_cast<T*>(smem + L.values);        // OC columns of v_new [64][LDO]
  float* scratch = reinterpret_cast<float*>(smem + L.scratch) + warp * 16 * kGdrScratchLd;
  float* g_s = reinterpret_cast<float*>(smem + L.gates);
  float* scale_s = g_s + C;  // the state's scale per 16 columns of this pass
  const Workspace<T, D> ws = Workspace<T, D>::of(p);

  stage_normalized_rows<T, D, LDK>(q_s, static_cast<const T*>(p.q) + gdr_q_offset(t0, hk, p), p.q_token_stride, n,
                                   p.l2norm_qk, p.scale);
  stage_rows<T, C, D, LDK>(k_s, ws.key_rows(chunk_index, hk), D, C);
  // Past the last token: its G. (The fault: 0 there, as this pass once read it: e^(0 - G_s) overflows into P's
  // rows past the last token, 0 x inf; rows never written out, so only the simulator's finite check sees it.)
  if (tid < C) g_s[tid] = CLEF_FAULT(gdr_padding_rows_g_zero, ws.gates(chunk_index, hv)[tid],
                                     tid < n ? ws.gates(chunk_index, hv)[tid] : 0.0f);
  __syncthreads();

  // P = Q K^T (.) Gamma, causal: warp w's row block, tiles on and left of the diagonal (the others are zero
  // and never read). Rows past the last token have zero queries and the last token's G: P's rows there are 0.
  for (int j = 0; j <= warp; ++j) {
    Accumulator acc;
    wmma::fill_fragment(acc, 0.0f);
    mma_abt(acc, q_s + 16 * warp * LDK, LDK, k_s + 16 * j * LDK, LDK, D / 16);
    stage(scratch, acc);
    // (The fault: the tiles two or more 16-blocks below the diagonal left out.)
    const bool far_tile_dropped = CLEF_FAULT(gdr_p_far_tiles_zeroed, false, j <= warp - 2);
    float scores[8];
#pragma unroll
    for (int cc = 0; cc < 8; ++cc) {
      const int s = 16 * j + col + cc;
      const bool visible = CLEF_FAULT(gdr_skip_causal_mask, s <= t, true) && !far_tile_dropped;
      scores[cc] = visible ? scratch[row * kGdrScratchLd + col + cc] * exp_f32(g_s[t] - g_s[s]) : 0.0f;
    }
    check_finite8(scores, "the chunked delta rule's P");
#pragma unroll
    for (int cc = 0; cc < 8; ++cc) p_s[t * LDP + 16 * j + col + cc] = from_f32<T>(scores[cc]);
  }
  const float decay_t = exp_f32(g_s[t]);
  const T* h = ws.state(chunk_index, hv);
  const T* v_new = ws.u_rows(chunk_index, hv);
  T* out = static_cast<T*>(p.out);

  for (int oc0 = 0; oc0 < D; oc0 += OC) {
    __syncthreads();  // P is complete and the keys (or the previous pass's columns) are no longer read
    stage_rows<T, D, OC, LDO>(h_s, h + oc0, D, D);
    stage_rows<T, C, OC, LDO>(vn_s, v_new + oc0, D, C);
    if (tid < OC / 16) scale_s[tid] = ws.state_scales(chunk_index, hv)[oc0 / 16 + tid];
    __syncthreads();
    for (int jc = 0; jc < OC / 16; ++jc) {
      // e^(G_t) (Q h)[t] / scale: the row factor applied in fp32 through the staging tile, then P v_new on top.
      Accumulator acc;
      wmma::fill_fragment(acc, 0.0f);
      mma_ab(acc, q_s + 16 * warp * LDK, LDK, h_s + 16 * jc, LDO, D / 16);
      stage(scratch, acc);
      // (The fault: the Q S term of the rows past the first 16 left out.)
      const float f = CLEF_FAULT(gdr_qs_rows_past_16_zeroed, decay_t / scale_s[jc],
                                 t >= 16 ? 0.0f : decay_t / scale_s[jc]);
#pragma unroll
      for (int cc = 0; cc < 8; ++cc) scratch[row * kGdrScratchLd + col + cc] *= f;
      __syncwarp();
      wmma::load_matrix_sync(acc, scratch, kGdrScratchLd, wmma::mem_row_major);
      mma_ab(acc, p_s + 16 * warp * LDP, LDP, vn_s + 16 * jc, LDO, warp + 1);
      stage(scratch, acc);
      const float* o = scratch + row * kGdrScratchLd + col;
      check_finite8(o, "the chunked delta rule's output");
      if (t < n) {
        T* dst = out + gdr_out_offset(t0 + t, hv, p) + oc0 + 16 * jc + col;
        if (aligned_16_bytes(dst)) {  // the caller's `out`: aligned unless it is an offset view
          store8(dst, o);
        } else {
#pragma unroll
          for (int cc = 0; cc < 8; ++cc) dst[cc] = from_f32<T>(o[cc]);
        }
      }
    }
  }
}

}  // namespace gdr_chunked

#endif  // CLEF_WMMA_ARCH

// The kernels: below the arch (or dtype) WMMA needs they compile to a trap gdr_choose never lets run.
#if defined(CLEF_WMMA_ARCH)
#define CLEF_GDR_CHUNKED_BODY(T, call) \
  if constexpr (WmmaCompiled<T>::value) {    \
    call;                                    \
  } else {                                   \
    __trap();                                \
  }
#else
#define CLEF_GDR_CHUNKED_BODY(T, call) \
  (void)p;                             \
  __trap();
#endif

template <typename T, int D>
__global__ void __launch_bounds__(kGdrChunkThreads, 1) gdr_chunk_prepare_kernel(GatedDeltaRuleParams p) {
  CLEF_GDR_CHUNKED_BODY(T, (gdr_chunked::prepare<T, D>(p)))
}

// The state pass: BV columns a CTA, its tiles STAGED in shared memory or read from the workspace, fetched with
// cp.async (ASYNC: from sm_80; below it this instantiation is a trap gdr_choose never lets run) or registers.
template <typename T, int D, int BV, bool STAGED, bool ASYNC>
__global__ void __launch_bounds__(kGdrChunkThreads, 1) gdr_chunk_state_kernel(GatedDeltaRuleParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  if constexpr (ASYNC) {
    __trap();
  } else {
    CLEF_GDR_CHUNKED_BODY(T, (gdr_chunked::carry_state<T, D, BV, STAGED, ASYNC>(p)))
  }
#else
  CLEF_GDR_CHUNKED_BODY(T, (gdr_chunked::carry_state<T, D, BV, STAGED, ASYNC>(p)))
#endif
}

template <typename T, int D, int OC>
__global__ void __launch_bounds__(kGdrChunkThreads, 1) gdr_chunk_output_kernel(GatedDeltaRuleParams p) {
  CLEF_GDR_CHUNKED_BODY(T, (gdr_chunked::output<T, D, OC>(p)))
}

#undef CLEF_GDR_CHUNKED_BODY

}  // namespace clef
