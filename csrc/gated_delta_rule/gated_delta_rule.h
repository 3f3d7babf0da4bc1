// Gated delta rule over packed variable-length sequences: parameters and the index/math functions
// shared by the CUDA kernels (gated_delta_rule_kernels.cuh) and the CPU implementation.
//
// Per value head h (key head h / (Hv/Hk)), fp32 state S [Dk, Dv], for each token t:
//   S' = exp(g_t) S;  u_t = beta_t (v_t - S'^T k_t);  S = S' + k_t u_t^T;  o_t = S^T q_t
// with k, q optionally L2-normalised per head and q scaled. Column j of S evolves on its own (it only
// sees v_t[j]), which is how both the CPU and GPU split the work: by (sequence, value head, columns).
//
// Layout:
//   q, k   [num_tokens, Hk, Dk]  last dim contiguous, any token/head stride (views of the conv output)
//   v      [num_tokens, Hv, Dv]  likewise
//   g      [num_tokens, Hv] fp32 log decay (<= 0), contiguous
//   beta   [num_tokens, Hv] fp32, contiguous
//   states [num_slots, Hv, Dk, Dv] fp32, contiguous, read through state_indices and written back
//   out    [num_tokens, Hv, Dv]  contiguous, dtype of v
// cu_seqlens == null is the recurrent (decode) mode: sequence b is the single token b.
//
// Two CUDA kernels run the chunk op (the dispatch rule below picks one; `kernel` forces one):
//   serial   (gated_delta_rule_kernels.cuh): the recurrence token by token, SIMT, fp32 throughout. Every
//            dtype, every arch; the reference beside the chunked kernel and the decode path.
//   chunked  (gated_delta_rule_chunked.cuh): 64-token chunks in the WY form on tensor cores (f16 from sm_70,
//            bf16 from sm_80), three passes over a workspace. Its math and roundings are described there.
#pragma once

#include "common/arch_limits.h"
#include "common/hd.h"

namespace clef {

enum class GdrKernel : int { Auto = 0, Serial = 1, Chunked = 2 };

// The chunked kernel's state pass comes in variants (gdr_state_variants below): how many state columns a CTA
// carries, and whether the chunk's W, keys and U columns are staged in shared memory (the next chunk's fetched
// while this one computes) or read by the tensor cores straight from the workspace (no tiles: a fraction of the
// shared memory, so wide CTAs fit small cards). Named "s32", "d128", ... (ops.gated_delta_rule_variant).
struct GdrStateVariant {
  int columns = 0;     // state columns a CTA: 16, 32, 64 or 128; 0 = none (or: the rule's)
  bool staged = true;  // W, keys and U in shared memory (else read from the workspace)
};

struct GatedDeltaRuleParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t q_token_stride = 0, q_head_stride = 0;
  int64_t k_token_stride = 0, k_head_stride = 0;
  int64_t v_token_stride = 0, v_head_stride = 0;
  const float* g = nullptr;
  const float* beta = nullptr;
  float* states = nullptr;
  void* out = nullptr;
  const int32_t* cu_seqlens = nullptr;      // [batch + 1]; null in recurrent mode
  const int32_t* state_indices = nullptr;   // [batch]
  const bool* has_initial_state = nullptr;  // [batch]; null means "read the slot" (recurrent mode)
  int64_t num_tokens = 0;
  int batch = 0;
  int num_k_heads = 0, num_v_heads = 0;
  int head_k_dim = 0, head_v_dim = 0;
  int num_slots = 0;
  float scale = 1.0f;
  bool l2norm_qk = true;
  GdrKernel kernel = GdrKernel::Auto;  // the chunk op's request ("auto": the dispatch rule)
  // The chunked kernel's workspace (gdr_chunked_workspace says what it holds) and its column splits, filled
  // in by the host entry from gated_delta_rule_cuda_choice.
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  GdrStateVariant state_request{0, true};  // a forced state-pass variant ("chunked:s32"); 0 columns: the rule's
  GdrStateVariant state{0, true};          // the state pass's variant (gdr_state_variant)
  int output_columns = 0;  // output columns per pass of the output kernel (head_v_dim or half of it)
};

CLEF_HD PackedSeq gdr_sequence(const GatedDeltaRuleParams& p, int b) {
  return packed_sequence(p.cu_seqlens, p.num_tokens, p.state_indices, p.has_initial_state, p.num_slots, b);
}

// Grouped value heads: each key head serves Hv/Hk consecutive value heads (indexed, never repeated).
CLEF_HD int gdr_key_head(int value_head, int num_v_heads, int num_k_heads) {
  return value_head / (num_v_heads / num_k_heads);
}

CLEF_HD int64_t gdr_state_offset(int slot, int value_head, int i, int j, const GatedDeltaRuleParams& p) {
  return ((static_cast<int64_t>(slot) * p.num_v_heads + value_head) * p.head_k_dim + i) * p.head_v_dim + j;
}

CLEF_HD int64_t gdr_q_offset(int64_t token, int key_head, const GatedDeltaRuleParams& p) {
  return token * p.q_token_stride + key_head * p.q_head_stride;
}
CLEF_HD int64_t gdr_k_offset(int64_t token, int key_head, const GatedDeltaRuleParams& p) {
  return token * p.k_token_stride + key_head * p.k_head_stride;
}
CLEF_HD int64_t gdr_v_offset(int64_t token, int value_head, const GatedDeltaRuleParams& p) {
  return token * p.v_token_stride + value_head * p.v_head_stride;
}
CLEF_HD int64_t gdr_out_offset(int64_t token, int value_head, const GatedDeltaRuleParams& p) {
  return (token * p.num_v_heads + value_head) * p.head_v_dim;
}
CLEF_HD int64_t gdr_gate_offset(int64_t token, int value_head, const GatedDeltaRuleParams& p) {
  return token * p.num_v_heads + value_head;
}

// Factor that L2-normalises a key head vector with the given sum of squares (eps as FLA/transformers).
CLEF_HD float gdr_key_factor(float sum_squares, bool l2norm) { return l2norm ? rsqrt_f32(sum_squares + 1e-6f) : 1.0f; }
CLEF_HD float gdr_query_factor(float sum_squares, bool l2norm, float scale) {
  return gdr_key_factor(sum_squares, l2norm) * scale;
}

// One token's update of state column j, given the column's dot products with the (normalised) key and
// query, sk = S[:, j] . k and sq = S[:, j] . q, taken *before* this token's decay:
//   u = beta (v - decay sk),   o = S_new[:, j] . q = decay sq + u (k . q)
// V is float on the GPU (a thread per column) and a vector of columns on the CPU.
template <typename V>
struct GdrColumnStep {
  V u;  // the delta written into the column: S_new[:, j] = decay S[:, j] + k u
  V o;  // the output o_t[j]
};
template <typename V>
CLEF_HD GdrColumnStep<V> gdr_column_step(V sk, V sq, V v, float decay, float beta, float kq) {
  GdrColumnStep<V> r;
  r.u = beta * (v - decay * sk);
  r.o = decay * sq + r.u * kq;
  return r;
}

// ---- the chunked kernel: chunks, workspace, shared memory, dispatch ---------------------------------
constexpr int kGdrChunk = 64;        // tokens a chunk (the WY form's block)
constexpr int kGdrChunkWarps = 4;    // each owns 16 of a chunk's rows
constexpr int kGdrChunkThreads = 32 * kGdrChunkWarps;
constexpr int kGdrScratchLd = 20;    // a warp's fp32 16 x 16 staging tile, rows padded (16-byte multiple)
// Below this many tokens a sequence on average, "auto" runs the token-serial kernel: the chunked one pays
// three launches and a workspace per call, the serial one a barrier per token (the autotune measures the
// crossing per device and bucket).
constexpr int kGdrChunkedMinTokens = 32;

CLEF_HD int gdr_num_chunks(int len) { return (len + kGdrChunk - 1) / kGdrChunk; }

// A pack has at most this many chunks (each sequence adds at most one partial chunk): the grid of the
// per-chunk passes and the workspace's chunk slots, known without reading cu_seqlens.
CLEF_HD int64_t gdr_max_chunks(int64_t num_tokens, int batch) { return (num_tokens + kGdrChunk - 1) / kGdrChunk + batch; }

// Chunks are numbered through the pack: sequence b's chunks follow sequence b-1's.
CLEF_HD int gdr_first_chunk(const GatedDeltaRuleParams& p, int b) {
  int first = 0;
  for (int i = 0; i < b; ++i) first += gdr_num_chunks(gdr_sequence(p, i).len);
  return first;
}

struct GdrChunkRef {
  bool valid;      // false: past the pack's last chunk (the CTA has nothing to do)
  int b;           // the sequence
  int64_t start;   // its first token
  int len;         // its tokens, 1..64
};

CLEF_HD GdrChunkRef gdr_find_chunk(const GatedDeltaRuleParams& p, int chunk) {
  int first = 0;
  for (int b = 0; b < p.batch; ++b) {
    const PackedSeq s = gdr_sequence(p, b);
    const int chunks = gdr_num_chunks(s.len);
    if (chunk < first + chunks) {
      const int c = chunk - first;
      return GdrChunkRef{true, b, s.start + static_cast<int64_t>(c) * kGdrChunk, min_int(kGdrChunk, s.len - c * kGdrChunk)};
    }
    first += chunks;
  }
  return GdrChunkRef{false, 0, 0, 0};
}

// The workspace, byte offsets from its (256-byte aligned) base, in tiles of a chunk's 64 rows per (chunk, head)
// (chunk numbering: gdr_find_chunk): per value head the in-chunk cumulative log decay G (fp32), W and U (then
// v_new) in the activation dtype, the state at the chunk's start scaled by a power of two per 16 columns and
// rounded (h), and those scales; per key head the normalised keys, rounded once. Rows past a sequence's last
// token are written too (zeros; G holds the last token's value), so every later read of a tile is whole and
// finite, and a tile is one contiguous block: a 16-byte copy per lane and slice, or a tensor-core fragment
// loaded straight from it.
struct GdrChunkedWorkspace {
  int64_t gcum, keys, w, u, h, h_scale, bytes;
  int64_t max_chunks;
};
CLEF_HD int64_t gdr_align256(int64_t bytes) { return (bytes + 255) / 256 * 256; }
CLEF_HD GdrChunkedWorkspace gdr_chunked_workspace(int64_t num_tokens, int batch, int num_k_heads, int num_v_heads,
                                                  int head_dim, int elem_bytes) {
  GdrChunkedWorkspace w;
  w.max_chunks = gdr_max_chunks(num_tokens, batch);
  const int64_t value_rows = w.max_chunks * num_v_heads * kGdrChunk;
  w.gcum = 0;
  w.keys = gdr_align256(value_rows * 4);
  w.w = w.keys + gdr_align256(w.max_chunks * num_k_heads * kGdrChunk * head_dim * elem_bytes);
  w.u = w.w + gdr_align256(value_rows * head_dim * elem_bytes);
  w.h = w.u + gdr_align256(value_rows * head_dim * elem_bytes);
  w.h_scale = w.h + gdr_align256(w.max_chunks * num_v_heads * head_dim * head_dim * elem_bytes);
  w.bytes = w.h_scale + gdr_align256(w.max_chunks * num_v_heads * (head_dim / 16) * 4);
  return w;
}

// Shared-memory layouts (bytes from a 128-byte aligned base). 2-byte tiles have rows padded by 8 elements
// (16 bytes: rows fall on different banks, and every 16-row fragment stays 32-byte aligned).
CLEF_HD constexpr int gdr_round128(int bytes) { return (bytes + 127) / 128 * 128; }
CLEF_HD constexpr int gdr_row_tile_bytes(int rows, int columns) { return gdr_round128(rows * (columns + 8) * 2); }
constexpr int kGdrSystemLd = kGdrChunk + 8;  // fp32 [64][72] systems; also their 2-byte successors
constexpr int kGdrSystemBytes = kGdrChunk * kGdrSystemLd * 4;
constexpr int kGdrScratchBytes = kGdrChunkWarps * 16 * kGdrScratchLd * 4;

// Pass 1 (gdr_chunk_prepare_kernel): the chunk's keys; the system A in fp32, later T diag(beta e^G) and
// T diag(beta) in the activation dtype; its inverse T in fp32, later the chunk's values; the warps' staging
// tiles; G and beta.
struct GdrPrepareLayout {
  int keys, system, inverse, scratch, gates, bytes;
};
CLEF_HD constexpr GdrPrepareLayout gdr_prepare_layout(int d) {
  GdrPrepareLayout l{};
  l.keys = 0;
  l.system = l.keys + gdr_row_tile_bytes(kGdrChunk, d);
  l.inverse = l.system + kGdrSystemBytes;
  const int values = gdr_row_tile_bytes(kGdrChunk, d);
  l.scratch = l.inverse + (values > kGdrSystemBytes ? values : kGdrSystemBytes);
  l.gates = l.scratch + kGdrScratchBytes;
  l.bytes = l.gates + 2 * kGdrChunk * 4;
  return l;
}

// Pass 2's variants (GdrStateVariant) compiled for head dim d: staged at 16, 32 and 64 columns, direct at 64 and
// 128 (what small cards need for wide CTAs); the launcher and scripts/check_archs.py compile these.
CLEF_HD constexpr bool gdr_state_variant_compiled(int d, int columns, bool staged) {
  return columns <= d && (staged ? (columns == 16 || columns == 32 || columns == 64) : (columns == 64 || columns == 128));
}
constexpr int kGdrMaxStateVariants = 5;
struct GdrStateVariants {
  GdrStateVariant list[kGdrMaxStateVariants];
  int count = 0;
};
// Narrowest first, staged before direct.
CLEF_HD GdrStateVariants gdr_state_variants(int d) {
  GdrStateVariants v{};
  for (int staged = 1; staged >= 0; --staged)
    for (int columns = 16; columns <= 128; columns *= 2)
      if (gdr_state_variant_compiled(d, columns, staged == 1)) v.list[v.count++] = GdrStateVariant{columns, staged == 1};
  return v;
}

// Its shared memory: W and the keys of a chunk (staged only), the state rounded for the products, the chunk's U
// columns (staged only), the decayed v_new columns, staging, G and the scale's reduction.
struct GdrStateLayout {
  int w, keys, state, u, decayed, scratch, gates, reduce, bytes;
};
CLEF_HD constexpr GdrStateLayout gdr_state_layout(int d, int bv, bool staged = true) {
  GdrStateLayout l{};
  const int rows = staged ? gdr_row_tile_bytes(kGdrChunk, d) : 0;
  l.w = 0;
  l.keys = l.w + rows;
  l.state = l.keys + rows;
  l.u = l.state + gdr_row_tile_bytes(d, bv);
  l.decayed = l.u + (staged ? gdr_row_tile_bytes(kGdrChunk, bv) : 0);
  l.scratch = l.decayed + gdr_row_tile_bytes(kGdrChunk, bv);
  l.gates = l.scratch + kGdrScratchBytes;
  l.reduce = l.gates + kGdrChunk * 4;
  l.bytes = l.reduce + 128;
  return l;
}

// Pass 3 (gdr_chunk_output_kernel, OC output columns at a time): the chunk's queries; its keys, later the
// state's OC columns; the masked, decayed scores P; v_new's OC columns; staging, G and the state's scales.
struct GdrOutputLayout {
  int queries, keys_or_state, scores, values, scratch, gates, bytes;
};
CLEF_HD constexpr GdrOutputLayout gdr_output_layout(int d, int oc) {
  GdrOutputLayout l{};
  l.queries = 0;
  l.keys_or_state = l.queries + gdr_row_tile_bytes(kGdrChunk, d);
  const int keys = gdr_row_tile_bytes(kGdrChunk, d), state = gdr_row_tile_bytes(d, oc);
  l.scores = l.keys_or_state + (keys > state ? keys : state);
  l.values = l.scores + gdr_row_tile_bytes(kGdrChunk, kGdrChunk);
  l.scratch = l.values + gdr_row_tile_bytes(kGdrChunk, oc);
  l.gates = l.scratch + kGdrScratchBytes;
  l.bytes = l.gates + kGdrChunk * 4 + gdr_round128(d / 16 * 4);
  return l;
}

CLEF_HD bool gdr_chunked_head_dim(int d) { return d == 16 || d == 32 || d == 64 || d == 128; }

// The output kernel's column pass: the whole head where it fits the device, else half of it (sm_75's 64 KB
// at head dim 128); 0 when neither fits.
CLEF_HD int gdr_output_columns(int d, int smem_limit) {
  if (gdr_output_layout(d, d).bytes <= smem_limit) return d;
  if (d >= 32 && gdr_output_layout(d, d / 2).bytes <= smem_limit) return d / 2;
  return 0;
}

// How the state pass's CTAs of one variant sit on a device: CTAs, CTAs resident per SM and the waves they run
// in (each CTA walks its sequence's every chunk, so a second wave repeats the whole walk).
struct GdrStateFit {
  int64_t blocks = 0;
  int per_sm = 0;  // 0: the variant does not fit the device
  int64_t waves = 0;
};
CLEF_HD GdrStateFit gdr_state_fit(int d, int num_v_heads, int batch, GdrStateVariant v, const CudaDevice& device) {
  GdrStateFit fit;
  fit.blocks = static_cast<int64_t>(d / v.columns) * num_v_heads * batch;
  fit.per_sm = blocks_per_sm(device, kGdrChunkThreads, gdr_state_layout(d, v.columns, v.staged).bytes);
  if (fit.per_sm > 0) {
    const int64_t resident = static_cast<int64_t>(fit.per_sm) * (device.multiprocessors > 0 ? device.multiprocessors : 1);
    fit.waves = (fit.blocks + resident - 1) / resident;
  }
  return fit;
}

// The state pass's variant, chosen by residency: the fewest waves of CTAs (a wave is every SM's resident CTAs,
// from their shared memory, threads and registers: blocks_per_sm), then staged (its next chunk's tiles are
// fetched during the current one) before direct, then the most CTAs (the shortest chain of work a chunk). So one
// record fills a card in one wave wherever some variant can: clef-flash's 32 heads x 128 columns on a V100 (80
// SMs, one 75 KB CTA each) as 64 staged CTAs of 64 columns, on a T4 (40 SMs, 64 KB) as 32 direct CTAs of 128,
// on an H100 (132 SMs, two CTAs each) as 256 staged CTAs of 16. {0, true} when none fits.
CLEF_HD GdrStateVariant gdr_state_variant(int d, int num_v_heads, int batch, const CudaDevice& device) {
  const GdrStateVariants variants = gdr_state_variants(d);
  GdrStateVariant best{0, true};
  GdrStateFit best_fit;
  for (int i = 0; i < variants.count; ++i) {
    const GdrStateVariant v = variants.list[i];
    const GdrStateFit fit = gdr_state_fit(d, num_v_heads, batch, v, device);
    if (fit.per_sm == 0) continue;
    const bool better = best.columns == 0 || fit.waves < best_fit.waves ||
                        (fit.waves == best_fit.waves && v.staged && !best.staged) ||
                        (fit.waves == best_fit.waves && v.staged == best.staged && fit.blocks > best_fit.blocks);
    if (better) {
      best = v;
      best_fit = fit;
    }
  }
  return best;
}

// Why the chunked kernel cannot run `p` on `device`, or nullptr when it can.
CLEF_HD const char* gdr_chunked_unsupported(const GatedDeltaRuleParams& p, ScalarKind kind, CudaDevice device) {
  if (p.cu_seqlens == nullptr) return "the chunked kernel runs the chunk op only (decode runs the serial kernel)";
  if (kind == ScalarKind::F32) return "the chunked kernel takes f16 or bf16 (tensor cores); fp32 runs the serial kernel";
  if (device.cc < 70) return "the chunked kernel needs tensor cores (sm_70 and newer)";
  if (kind == ScalarKind::BF16 && device.cc < 80) return "the chunked kernel's bf16 tensor cores need sm_80 or newer";
  if (p.head_k_dim != p.head_v_dim || !gdr_chunked_head_dim(p.head_k_dim))
    return "the chunked kernel is compiled for head_k_dim == head_v_dim in {16, 32, 64, 128}";
  if (p.num_v_heads > kMaxGridYZ) return "the chunked kernel takes at most 65,535 value heads (grid.y)";
  if (p.batch > kMaxGridYZ) return "the chunked kernel takes at most 65,535 sequences a call (grid.z)";
  const int d = p.head_k_dim;
  if (gdr_prepare_layout(d).bytes > device.smem_limit || gdr_output_columns(d, device.smem_limit) == 0 ||
      gdr_state_variant(d, p.num_v_heads, p.batch, device).columns == 0)
    return "the chunked kernel's tiles do not fit the device's shared memory per block";
  if (p.state_request.columns != 0) {
    if (!gdr_state_variant_compiled(d, p.state_request.columns, p.state_request.staged))
      return "that state-pass variant is not compiled for this head dim (gdr_state_variants)";
    if (gdr_state_fit(d, p.num_v_heads, p.batch, p.state_request, device).per_sm == 0)
      return "that state-pass variant's shared memory does not fit the device";
  }
  return nullptr;
}

struct GdrChoice {
  GdrKernel kernel;
  const char* error;  // a forced kernel that cannot run these params: why
  int64_t workspace_bytes = 0;
  GdrStateVariant state{0, true};
  int output_columns = 0;
};

// The dispatch rule: the chunked kernel where it can run and sequences average kGdrChunkedMinTokens tokens or
// more; the serial kernel otherwise (decode, fp32, Pascal, bf16 before sm_80, other head dims). The chunked
// kernel's state pass runs the variant asked for (p.state_request: tests, the self-check) or gdr_state_variant's.
CLEF_HD GdrChoice gdr_choose(const GatedDeltaRuleParams& p, ScalarKind kind, CudaDevice device) {
  const char* why_not = gdr_chunked_unsupported(p, kind, device);
  GdrChoice choice{GdrKernel::Serial, nullptr};
  if (p.kernel == GdrKernel::Chunked) {
    choice.kernel = GdrKernel::Chunked;
    choice.error = why_not;
  } else if (p.kernel == GdrKernel::Auto && why_not == nullptr) {
    choice.kernel = p.num_tokens >= static_cast<int64_t>(kGdrChunkedMinTokens) * p.batch ? GdrKernel::Chunked
                                                                                          : GdrKernel::Serial;
  }
  if (choice.kernel == GdrKernel::Chunked && choice.error == nullptr) {
    const int d = p.head_k_dim;
    const int elem_bytes = kind == ScalarKind::F32 ? 4 : 2;
    choice.workspace_bytes =
        gdr_chunked_workspace(p.num_tokens, p.batch, p.num_k_heads, p.num_v_heads, d, elem_bytes).bytes;
    choice.state = p.state_request.columns != 0 ? p.state_request : gdr_state_variant(d, p.num_v_heads, p.batch, device);
    choice.output_columns = gdr_output_columns(d, device.smem_limit);
  }
  return choice;
}

// A power of two s with s * max_abs in [2^14, 2^15): the state is scaled by it before it is rounded to the
// activation dtype for the tensor cores, so that f16's range (65,504) holds it at full precision however
// large or small it has grown (bf16 has fp32's range; the scale is exact either way). 1 for a zero state.
CLEF_HD float gdr_state_scale(float max_abs) {
  if (!(max_abs > 0.0f)) return 1.0f;
  int e = 0;
  frexp_f32(max_abs, &e);  // max_abs < 2^e
  const int shift = 15 - e;
  return ldexp_f32(1.0f, shift < -100 ? -100 : (shift > 100 ? 100 : shift));
}

}  // namespace clef
