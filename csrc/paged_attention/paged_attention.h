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
//
// Two CUDA kernels serve paged_attention (paged_attention_kernels.cuh): a tensor-core one (WMMA, f16/bf16
// caches, head dims 64/128/256) for prefill chunks and an fp32 SIMT one for everything else (fp32 caches,
// other head dims, decode packs). paged_attention_choose_kernel below is the rule; the CPU tests and the
// simulator run it as the GPU does. A second tensor-core kernel (v2: 8 warps, the output columns split
// over warp pairs, a split-context pass for small grids) runs only when forced (kernel="wmma2"): the
// start-up autotune times it against v1 on the device, which no rule written here can know.
#pragma once

#include "common/arch_limits.h"
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

// Which CUDA kernel serves a paged_attention call. Auto applies paged_attention_choose_kernel; Simt, Wmma
// and WmmaV2 force one (the op's `kernel` argument: benchmarks, tests and the start-up autotune time and
// verify each on one shape). Auto never picks WmmaV2.
enum class AttentionKernel : int { Auto = 0, Simt = 1, Wmma = 2, WmmaV2 = 3 };

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
  // The most new queries any one sequence has (the host knows it: ChunkBatch.q_lens). The launchers size
  // the grid's query tiles from it, so a pack of short chunks launches no CTAs that exit at once; 0 (not
  // given) falls back to num_tokens, a bound that needs no device-to-host copy. A smaller value than a
  // sequence's q_len would leave its last rows unwritten: the host entry checks it on CPU tensors.
  int64_t max_q_len = 0;
  int batch = 0;
  int num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
  int block_size = 0, num_blocks = 0, max_blocks_per_seq = 0;
  float scale = 1.0f;
  AttentionKernel kernel = AttentionKernel::Auto;
  // WmmaV2's split-context pass (paged_attention_wmma2_splits): each CTA's keys are cut into `splits`
  // parts, run by separate CTAs whose partial rows land in split_workspace, then merged by a combine
  // kernel. The torch glue allocates the workspace (paged_attention_wmma2_workspace_bytes), so the .cu
  // launcher needs no allocator of its own. 1: no split.
  int splits = 1;
  void* split_workspace = nullptr;
  int64_t split_workspace_bytes = 0;
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

// Queries of the longest sequence of the pack: what the grid's query tiles must cover.
CLEF_HD int64_t attn_max_q_len(const PagedAttentionParams& p) {
  return p.max_q_len > 0 && p.max_q_len < p.num_tokens ? p.max_q_len : p.num_tokens;
}

// Query tiles of `tile_tokens` tokens the grid needs along x.
CLEF_HD int64_t attn_query_tiles(const PagedAttentionParams& p, int tile_tokens) {
  return (attn_max_q_len(p) + tile_tokens - 1) / tile_tokens;
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

// ---- which kernel: the dispatch rule ------------------------------------------------------------
// CTA tiles of the two kernels, in query rows (a row is one token x one query head of a KV group).
constexpr int kAttnRows = 16;      // SIMT kernel
constexpr int kWmmaWarps = 4;      // tensor-core kernel: one warp per 16 rows
constexpr int kWmmaRows = 16 * kWmmaWarps;
constexpr int kMaxGroup = 16;      // query heads a KV head: every kernel takes 1 .. 16
constexpr int kDeadRowToken = 1 << 30;  // past any sequence's queries

// Row r of a kernel's tile (16 or 64 rows, tile_tokens = rows / group) that starts at token q0 is token
// q0 + r / group (query head r % group of the KV group). A group that does not divide the tile (clef 27B's
// GQA 6: 10 tokens in 64 rows, 2 in 16) leaves the last rows dead: they get a token past every sequence's
// queries, so the kernels' own "past the queries" tests give them no query, no key and no output.
CLEF_HD int tile_row_token(int q0, int r, int group, int tile_tokens) {
  const int token = r / group;  // tile_tokens = tile_rows / group: the tile's own tokens
  return token < tile_tokens ? q0 + token : kDeadRowToken;
}

// ---- tile configurations: chosen from the device's shared memory ---------------------------------
// Each kernel has a few instantiated key-tile sizes per head dim; the launcher runs the largest whose
// shared memory fits the device's per-block limit (cudaDevAttrMaxSharedMemoryPerBlockOptin: 48 KB on
// sm_60/61, which cannot opt in above it, 96 KB sm_70, 64 KB sm_75, 163 KB sm_80, 99 KB sm_86/89, 227 KB
// sm_90), opting in above the 48 KB default when it must. The dispatch rule and the compile checks use
// the same functions.
constexpr int kDefaultSmemBytes = kDefaultSmemPerBlock;  // what a kernel gets without cudaFuncSetAttribute

// SIMT kernel (paged_attention_kernel): fp32 tiles of q, k, v, probabilities, rescale factors and key
// offsets. D = 256 takes 16 keys (49.4 KB: the opt-in on sm_70+) or 8 (33.6 KB: Pascal's 48 KB).
CLEF_HD constexpr int paged_attention_smem_floats(int head_dim, int keys) {
  return kAttnRows * (head_dim + 1) + keys * (head_dim + 1) + keys * head_dim + kAttnRows * keys + 2 * kAttnRows +
         2 * keys;
}
CLEF_HD constexpr int paged_attention_simt_key_options(int head_dim, int option) {
  return head_dim >= 256 ? (option == 0 ? 16 : option == 1 ? 8 : 0) : (option == 0 ? 32 : 0);
}
// Keys per tile of the SIMT kernel on a device with `smem_limit` bytes a block; 0 when none fits.
CLEF_HD int paged_attention_simt_keys(int head_dim, int smem_limit) {
  for (int i = 0; paged_attention_simt_key_options(head_dim, i) > 0; ++i) {
    const int keys = paged_attention_simt_key_options(head_dim, i);
    if (4 * paged_attention_smem_floats(head_dim, keys) <= smem_limit) return keys;
  }
  return 0;
}

CLEF_HD bool paged_attention_wmma_head_dim(int head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 256; }

// Shared-memory layout of the tensor-core kernel, in bytes from the (128-byte aligned) base. Q, K and V
// tiles are kept in the cache dtype (2 bytes), rows padded by 8 elements (16 bytes: rows shift across
// banks, and every 16-row fragment stays 32-byte aligned as wmma::load_matrix_sync requires). Scores are
// fp32; each warp overwrites its own score rows with its probabilities (2 bytes) in place, and later uses
// them as its 16 x 16 output staging tile. Key offsets are double-buffered so the next tile's offsets can
// be written while a slower warp still reads this tile's.
//   D = 64:  64 keys per tile, 45.25 KB: under the 48 KB default (V100: two CTAs per SM)
//   D = 128: 32 keys per tile, 43.75 KB: under the 48 KB default
//   D = 256: 32 keys per tile, 75.75 KB: the opt-in on sm_70 (96 KB), sm_80+ (99-227 KB);
//            16 keys per tile, 55 KB: sm_75's 64 KB (T4), half the keys per barrier
template <int D, int KEYS>
struct WmmaLayout {
  static constexpr int kKeys = KEYS;
  static constexpr int kRowStride = D + 8;        // elements per Q/K/V row
  static constexpr int kScoreStride = kKeys + 4;  // floats per score row (a multiple of 4, as wmma needs)
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kWmmaRows * kRowStride * 2;
  static constexpr int kV = kK + kKeys * kRowStride * 2;
  static constexpr int kScores = kV + kKeys * kRowStride * 2;
  static constexpr int kAlpha = kScores + kWmmaRows * kScoreStride * 4;
  static constexpr int kKeyOffsets = kAlpha + kWmmaRows * 4;
  static constexpr int kBytes = kKeyOffsets + 2 * kKeys * 8;
};

CLEF_HD constexpr int paged_attention_wmma_key_options(int head_dim, int option) {
  if (head_dim == 64) return option == 0 ? 64 : 0;
  if (head_dim == 128) return option == 0 ? 32 : 0;
  if (head_dim == 256) return option == 0 ? 32 : option == 1 ? 16 : 0;
  return 0;
}

CLEF_HD int paged_attention_wmma_smem_bytes(int head_dim, int keys) {
  if (head_dim == 64 && keys == 64) return WmmaLayout<64, 64>::kBytes;
  if (head_dim == 128 && keys == 32) return WmmaLayout<128, 32>::kBytes;
  if (head_dim == 256 && keys == 32) return WmmaLayout<256, 32>::kBytes;
  if (head_dim == 256 && keys == 16) return WmmaLayout<256, 16>::kBytes;
  return 0;
}

// Keys per tile of the tensor-core kernel on a device with `smem_limit` bytes a block; 0 when none fits.
CLEF_HD int paged_attention_wmma_keys(int head_dim, int smem_limit) {
  for (int i = 0; paged_attention_wmma_key_options(head_dim, i) > 0; ++i) {
    const int keys = paged_attention_wmma_key_options(head_dim, i);
    if (paged_attention_wmma_smem_bytes(head_dim, keys) <= smem_limit) return keys;
  }
  return 0;
}

// What the launcher needs to know of the device.
using AttentionDevice = CudaDevice;  // multiprocessors 0 (unknown): v2 never splits

// Why a tensor-core kernel cannot run this call on `device`, or nullptr when it can; `tile_keys` is the key
// tile of that kernel the device's shared memory holds (0: none). Both stage K/V tiles in the cache dtype
// and load them 16 bytes at a time.
CLEF_HD const char* tensor_core_attention_unsupported(const PagedAttentionParams& p, ScalarKind kind,
                                                      AttentionDevice device, int tile_keys) {
  if (kind == ScalarKind::F32) return "the tensor-core kernel takes f16 or bf16 caches (fp32 runs the SIMT kernel)";
  if (device.cc < 70) return "tensor cores need sm_70 or newer";
  if (kind == ScalarKind::BF16 && device.cc < 80) return "bf16 tensor cores need sm_80 or newer (serve V100s in f16)";
  if (!paged_attention_wmma_head_dim(p.head_dim)) return "the tensor-core kernel is compiled for head dims 64, 128 and 256";
  if (tile_keys == 0) return "no tensor-core tile of this head dim fits the device's shared memory per block";
  if (p.num_kv_heads <= 0 || p.num_q_heads / p.num_kv_heads > kMaxGroup)
    return "the tensor-core kernel takes at most 16 query heads a KV head";
  if (!aligned_16_bytes(p.query) || p.query_token_stride % 8 != 0 || p.query_head_stride % 8 != 0 ||
      !aligned_16_bytes(p.key_cache) || !aligned_16_bytes(p.value_cache))
    return "the tensor-core kernel needs 16-byte aligned query rows and caches (query strides multiples of 8)";
  return nullptr;
}

CLEF_HD const char* paged_attention_wmma_unsupported(const PagedAttentionParams& p, ScalarKind kind,
                                                     AttentionDevice device) {
  return tensor_core_attention_unsupported(p, kind, device, paged_attention_wmma_keys(p.head_dim, device.smem_limit));
}

// ---- tensor cores, v2 (forced only: kernel="wmma2") -----------------------------------------------
// The same 64 query rows a CTA as v1, over 8 warps: warps 2w and 2w+1 (a pair) share rows 16w..16w+15,
// each scoring half of the tile's 16-key sub-tiles and each holding half of the D/16 output accumulator
// tiles (64 fp32 registers of O at D = 256 instead of v1's 128), so twice the warps hide the same latency.
constexpr int kWmma2Warps = 8;

// Shared memory of v2, bytes from the 128-byte aligned base. Q, K, V as v1 (the next K/V tile waits in
// registers, so one copy of each suffices). Scores are shared by a pair (each warp stores its key
// sub-tiles, both read whole rows); probabilities are private to each warp, so that neither overwrites
// scores its partner still reads (that would take a second pair barrier a tile). alpha is per warp for
// the same reason. The finished O goes out through the pair's own Q rows (only that pair reads them).
//   D = 64:  32 keys, 38 KB (V100: two CTAs an SM)
//   D = 128: 32 keys, 54 KB (the opt-in on every tensor-core card)
//   D = 256: 32 keys, 86 KB: sm_70 (96 KB), sm_80+; 16 keys, 61.25 KB: sm_75's 64 KB (T4)
template <int D, int KEYS>
struct Wmma2Layout {
  static constexpr int kKeys = KEYS;
  static constexpr int kRowStride = D + 8;        // elements per Q/K/V row, as v1
  static constexpr int kScoreStride = KEYS + 4;   // floats per score row (a multiple of 4, as wmma needs)
  static constexpr int kProbStride = KEYS + 8;    // 2-byte elements per probability row (16-byte rows)
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kWmmaRows * kRowStride * 2;
  static constexpr int kV = kK + KEYS * kRowStride * 2;
  static constexpr int kScores = kV + KEYS * kRowStride * 2;
  static constexpr int kProbs = kScores + kWmmaRows * kScoreStride * 4;
  static constexpr int kAlpha = kProbs + kWmma2Warps * 16 * kProbStride * 2;
  static constexpr int kKeyOffsets = kAlpha + kWmma2Warps * 16 * 4;
  static constexpr int kBytes = kKeyOffsets + 2 * KEYS * 8;
};

CLEF_HD constexpr int paged_attention_wmma2_key_options(int head_dim, int option) {
  if (head_dim == 64 || head_dim == 128) return option == 0 ? 32 : 0;
  if (head_dim == 256) return option == 0 ? 32 : option == 1 ? 16 : 0;
  return 0;
}

CLEF_HD int paged_attention_wmma2_smem_bytes(int head_dim, int keys) {
  if (head_dim == 64 && keys == 32) return Wmma2Layout<64, 32>::kBytes;
  if (head_dim == 128 && keys == 32) return Wmma2Layout<128, 32>::kBytes;
  if (head_dim == 256 && keys == 32) return Wmma2Layout<256, 32>::kBytes;
  if (head_dim == 256 && keys == 16) return Wmma2Layout<256, 16>::kBytes;
  return 0;
}

// Keys per tile of v2 on a device with `smem_limit` bytes a block; 0 when none fits (sm_60/61's 48 KB at
// D = 128 and 256: they have no tensor cores anyway).
CLEF_HD int paged_attention_wmma2_keys(int head_dim, int smem_limit) {
  for (int i = 0; paged_attention_wmma2_key_options(head_dim, i) > 0; ++i) {
    const int keys = paged_attention_wmma2_key_options(head_dim, i);
    if (paged_attention_wmma2_smem_bytes(head_dim, keys) <= smem_limit) return keys;
  }
  return 0;
}

CLEF_HD const char* paged_attention_wmma2_unsupported(const PagedAttentionParams& p, ScalarKind kind,
                                                      AttentionDevice device) {
  return tensor_core_attention_unsupported(p, kind, device, paged_attention_wmma2_keys(p.head_dim, device.smem_limit));
}

// v2's split-context pass. The rule: it engages when the grid (query tiles of the longest sequence x KV
// heads x sequences, as the launcher sizes it from the host's max_q_len: no device-to-host copy) has
// fewer CTAs than the device has SMs, so SMs would idle while a few CTAs walk a long context (one record
// of clef-flash, GQA 4: a 64-token prefix-cache hit over a 16k context is 16 CTAs for a V100's 80 SMs, a
// 16-token one 4). Each CTA's key range is then cut into up to `splits` parts, run by separate CTAs:
//   splits = min(SMs / CTAs, kWmma2MaxSplits, the block table's key capacity / (keys a tile x
//            kWmma2MinTilesPerSplit), 65,535 / sequences (grid.z)), and no split when that is below 2.
// SMs / CTAs keeps the split grid within one wave. A part adds about one to two K/V tiles' time to its
// CTA (staging its Q tile, writing its fp32 partial rows; the combine's read-back is a separate small
// pass), hence at least kWmma2MinTilesPerSplit tiles a part. The block table's capacity bounds the
// context without reading context_lens; on the device each CTA runs only as many parts as its own
// context fills (wmma2_active_splits), so a short record in a wide table costs CTAs that exit at once.
constexpr int kWmma2MaxSplits = 32;
constexpr int kWmma2MinTilesPerSplit = 2;

CLEF_HD int paged_attention_wmma2_query_tiles(const PagedAttentionParams& p) {
  return static_cast<int>(attn_query_tiles(p, kWmmaRows / (p.num_q_heads / p.num_kv_heads)));
}

CLEF_HD int64_t paged_attention_wmma2_ctas(const PagedAttentionParams& p) {
  return static_cast<int64_t>(paged_attention_wmma2_query_tiles(p)) * p.num_kv_heads * p.batch;
}

CLEF_HD int paged_attention_wmma2_splits(const PagedAttentionParams& p, AttentionDevice device, int keys) {
  const int64_t ctas = paged_attention_wmma2_ctas(p);
  if (keys <= 0 || ctas <= 0 || ctas >= device.multiprocessors) return 1;
  const int64_t capacity_tiles = (static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size + keys - 1) / keys;
  int64_t splits = device.multiprocessors / ctas;
  if (splits > kWmma2MaxSplits) splits = kWmma2MaxSplits;
  if (splits > kMaxGridYZ / p.batch) splits = kMaxGridYZ / p.batch;  // grid.z = sequences x parts
  if (splits > capacity_tiles / kWmma2MinTilesPerSplit) splits = capacity_tiles / kWmma2MinTilesPerSplit;
  return splits >= 2 ? static_cast<int>(splits) : 1;
}

// Parts a CTA whose context fills `num_tiles` key tiles actually runs: each gets kWmma2MinTilesPerSplit
// tiles or more; the kernel and the combine both ask, so they agree on which partial rows exist.
CLEF_HD int wmma2_active_splits(int num_tiles, int splits) {
  const int active = num_tiles / kWmma2MinTilesPerSplit;
  return active < 1 ? 1 : (active > splits ? splits : active);
}
// First key tile of part `split` of `active` (part `active` gives the end).
CLEF_HD int wmma2_split_first_tile(int num_tiles, int active, int split) {
  return static_cast<int>(static_cast<int64_t>(num_tiles) * split / active);
}

// The workspace: per CTA and part (a slot), the part's 64 rows of unnormalised O (fp32, [64][D]), then
// every slot's running max m and sum l per row. A slot is ((b * Hkv + kv head) * query tiles + query
// tile) * splits + part.
struct Wmma2Partials {
  float* out;  // [slots][64][D]
  float* max;  // [slots][64]
  float* sum;  // [slots][64]
};
CLEF_HD int64_t paged_attention_wmma2_workspace_bytes(const PagedAttentionParams& p, int splits) {
  if (splits <= 1) return 0;
  return paged_attention_wmma2_ctas(p) * splits * kWmmaRows * (p.head_dim + 2) * static_cast<int64_t>(sizeof(float));
}
CLEF_HD Wmma2Partials wmma2_partials(const PagedAttentionParams& p) {
  const int64_t rows = paged_attention_wmma2_ctas(p) * p.splits * kWmmaRows;
  float* base = static_cast<float*>(p.split_workspace);
  return Wmma2Partials{base, base + rows * p.head_dim, base + rows * (p.head_dim + 1)};
}
CLEF_HD int64_t wmma2_split_slot(const PagedAttentionParams& p, int b, int kv_head, int query_tile, int split) {
  const int64_t kv_row = static_cast<int64_t>(b) * p.num_kv_heads + kv_head;
  const int64_t cta = kv_row * paged_attention_wmma2_query_tiles(p) + query_tile;
  return cta * p.splits + split;
}

// The rule. Tensor cores whenever they can run the call and the pack averages at least one SIMT tile
// (16 rows) per sequence: prefill chunks and prefix-cache hits (G = 4: 4 tokens or more per sequence).
// Packs of decode tokens stay on the SIMT kernel, whose 16-row tile wastes less of its work on padding
// rows than the 64-row tensor-core tile. A forced kernel is returned as asked (the launcher reports why
// a forced Wmma cannot run).
CLEF_HD AttentionKernel paged_attention_choose_kernel(const PagedAttentionParams& p, ScalarKind kind,
                                                      AttentionDevice device) {
  if (p.kernel != AttentionKernel::Auto) return p.kernel;
  if (paged_attention_wmma_unsupported(p, kind, device) != nullptr) return AttentionKernel::Simt;
  const int64_t rows = p.num_tokens * (p.num_q_heads / p.num_kv_heads);
  return rows >= static_cast<int64_t>(kAttnRows) * p.batch ? AttentionKernel::Wmma : AttentionKernel::Simt;
}

}  // namespace clef
