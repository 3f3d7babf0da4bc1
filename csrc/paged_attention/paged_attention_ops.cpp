// Host entries of the paged KV cache family: check every argument, fill the params, dispatch.
#include <ATen/ops/empty.h>

#include <cstdio>
#include <string>

#include "common/torch_glue.h"
#include "ops.h"
#include "paged_attention/paged_attention_launch.h"

namespace clef {
namespace {

void check_cache(const at::Tensor& cache, const at::Tensor& ref, const char* op, const char* name) {
  check_dim(cache, 4, op, name, "[num_blocks, block_size, num_kv_heads, head_dim]");
  check_dtype(cache, ref.scalar_type(), op, name);
  check_contiguous(cache, op, name);
  check_device(cache, ref, op, name);
}

void check_int32_vector(const at::Tensor& t, int64_t size, const at::Tensor& ref, const char* op, const char* name) {
  check_dim(t, 1, op, name, "a vector");
  check_shape(t, {size}, op, name);
  check_dtype(t, at::kInt, op, name);
  check_contiguous(t, op, name);
  check_device(t, ref, op, name);
}

// Values only checkable by reading them: done for CPU tensors (see check_cu_seqlens_values).
void check_attention_metadata(const PagedAttentionParams& p, const at::Tensor& ref, const char* op) {
  if (!ref.is_cpu()) return;
  for (int b = 0; b < p.batch; ++b) {
    const int q_len = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
    const int ctx = p.context_lens[b];
    TORCH_CHECK_VALUE(ctx >= q_len, op, ": context_lens[", b, "] = ", ctx, " is shorter than the sequence's ", q_len,
                      " new queries (the context includes them; write them with reshape_and_cache first)");
    TORCH_CHECK_VALUE(ctx <= static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size, op, ": context_lens[", b, "] = ",
                      ctx, " needs more than the block table's ", p.max_blocks_per_seq, " blocks of ", p.block_size);
    for (int blk = 0; blk < (ctx + p.block_size - 1) / p.block_size; ++blk) {
      const int32_t phys = p.block_tables[b * p.block_table_stride + blk];
      TORCH_CHECK_VALUE(phys >= 0 && phys < p.num_blocks, op, ": block_tables[", b, ", ", blk, "] = ", phys,
                        " is outside the cache's ", p.num_blocks, " blocks");
    }
  }
}

// A max_query_len below a sequence's new queries would leave that sequence's last rows unwritten: checked
// where the values are cheap to read (CPU tensors: the CPU implementation and the simulator).
void check_max_query_len(const PagedAttentionParams& p, const at::Tensor& ref, const char* op) {
  if (!ref.is_cpu() || p.max_q_len == 0) return;
  for (int b = 0; b < p.batch; ++b) {
    const int64_t q_len = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
    TORCH_CHECK_VALUE(q_len <= p.max_q_len, op, ": sequence ", b, " has ", q_len, " new queries, more than max_query_len = ",
                      p.max_q_len, " (the longest sequence's, or 0)");
  }
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                       const at::Tensor& slot_mapping) {
  const char* op = "reshape_and_cache";
  check_dim(key, 3, op, "key", "[num_tokens, num_kv_heads, head_dim]");
  const ScalarKind kind = activation_kind(key, op, "key");
  check_shape(value, key.sizes(), op, "value");
  check_dtype(value, key.scalar_type(), op, "value");
  check_device(value, key, op, "value");
  check_last_dim_contiguous(key, op, "key");
  check_last_dim_contiguous(value, op, "value");
  check_cache(key_cache, key, op, "key_cache");
  check_cache(value_cache, key, op, "value_cache");
  check_shape(value_cache, key_cache.sizes(), op, "value_cache");
  check_shape(key_cache, {key_cache.size(0), key_cache.size(1), key.size(1), key.size(2)}, op, "key_cache");
  check_int32_vector(slot_mapping, key.size(0), key, op, "slot_mapping");
  const int64_t capacity = key_cache.size(0) * key_cache.size(1);
  if (slot_mapping.is_cpu()) {
    const int32_t* slots = slot_mapping.data_ptr<int32_t>();
    for (int64_t t = 0; t < slot_mapping.numel(); ++t)
      TORCH_CHECK_VALUE(slots[t] < capacity, op, ": slot_mapping[", t, "] = ", slots[t], " is outside the cache's ",
                        capacity, " slots (negative skips a token)");
  }

  CacheWriteParams p;
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.key_token_stride = key.stride(0);
  p.key_head_stride = key.stride(1);
  p.value_token_stride = value.stride(0);
  p.value_head_stride = value.stride(1);
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.slot_mapping = slot_mapping.data_ptr<int32_t>();
  p.num_tokens = key.size(0);
  p.num_kv_heads = checked_int32(key.size(1), op, "num_kv_heads");
  p.head_dim = checked_int32(key.size(2), op, "head_dim");
  p.block_size = checked_int32(key_cache.size(1), op, "block_size");
  p.num_blocks = checked_int32(key_cache.size(0), op, "num_blocks");
  run_on_device(
      key, op, [&](void* stream) { return reshape_and_cache_cuda(p, kind, stream); },
      [&] { reshape_and_cache_cpu(p, kind); });
}

namespace {

AttentionKernel parse_kernel(c10::string_view kernel, const char* op) {
  if (kernel == "auto") return AttentionKernel::Auto;
  if (kernel == "simt") return AttentionKernel::Simt;
  if (kernel == "wmma") return AttentionKernel::Wmma;
  if (kernel == "wmma2") return AttentionKernel::WmmaV2;
  TORCH_CHECK_VALUE(false, op, ": kernel must be 'auto', 'simt', 'wmma' or 'wmma2', got '", std::string(kernel), "'");
  return AttentionKernel::Auto;  // not reached
}

const char* kernel_name(AttentionKernel kernel) {
  switch (kernel) {
    case AttentionKernel::Auto: return "auto";
    case AttentionKernel::Simt: return "simt";
    case AttentionKernel::Wmma: return "wmma";
    case AttentionKernel::WmmaV2: return "wmma2";
  }
  return "?";
}

// Checks every argument but `out` and fills the params (out, scale and kernel are the caller's).
PagedAttentionParams attention_params(const at::Tensor& query, const at::Tensor& key_cache,
                                      const at::Tensor& value_cache, const at::Tensor& cu_seqlens_q,
                                      const at::Tensor& context_lens, const at::Tensor& block_tables, const char* op) {
  check_dim(query, 3, op, "query", "[num_tokens, num_q_heads, head_dim]");
  activation_kind(query, op, "query");
  check_last_dim_contiguous(query, op, "query");
  check_cache(key_cache, query, op, "key_cache");
  check_cache(value_cache, query, op, "value_cache");
  check_shape(value_cache, key_cache.sizes(), op, "value_cache");
  const int64_t num_tokens = query.size(0), num_q_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(2);
  TORCH_CHECK_VALUE(key_cache.size(3) == head_dim, op, ": key_cache head_dim ", key_cache.size(3),
                    " differs from the query's ", head_dim);
  TORCH_CHECK_VALUE(num_kv_heads > 0 && num_q_heads % num_kv_heads == 0, op, ": num_q_heads (", num_q_heads,
                    ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
  TORCH_CHECK_VALUE(key_cache.size(1) > 0, op, ": block_size must be positive");
  check_dim(cu_seqlens_q, 1, op, "cu_seqlens_q", "[batch + 1]");
  const int64_t batch = cu_seqlens_q.size(0) - 1;
  TORCH_CHECK_VALUE(batch >= 0, op, ": cu_seqlens_q needs at least one entry");
  check_int32_vector(cu_seqlens_q, batch + 1, query, op, "cu_seqlens_q");
  check_int32_vector(context_lens, batch, query, op, "context_lens");
  check_dim(block_tables, 2, op, "block_tables", "[batch, max_blocks_per_seq]");
  check_shape(block_tables, {batch, block_tables.size(1)}, op, "block_tables");
  check_dtype(block_tables, at::kInt, op, "block_tables");
  check_last_dim_contiguous(block_tables, op, "block_tables");
  check_device(block_tables, query, op, "block_tables");
  check_cu_seqlens_values(cu_seqlens_q, num_tokens, op, "cu_seqlens_q");
  if (query.is_cuda() && cuda_build()) {
    TORCH_CHECK_VALUE(paged_attention_cuda_supports_head_dim(static_cast<int>(head_dim)), op,
                      ": the CUDA kernels are compiled for head_dim 16, 32, 64, 128 and 256, got ", head_dim);
    TORCH_CHECK_VALUE(paged_attention_cuda_supports_group(static_cast<int>(num_q_heads / num_kv_heads)), op,
                      ": the CUDA kernels take at most 16 query heads a KV head, got ", num_q_heads / num_kv_heads);
  }

  PagedAttentionParams p;
  p.query = query.data_ptr();
  p.query_token_stride = query.stride(0);
  p.query_head_stride = query.stride(1);
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.cu_seqlens_q = cu_seqlens_q.data_ptr<int32_t>();
  p.context_lens = context_lens.data_ptr<int32_t>();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.block_table_stride = block_tables.stride(0);
  p.num_tokens = num_tokens;
  p.batch = checked_int32(batch, op, "batch");
  p.num_q_heads = checked_int32(num_q_heads, op, "num_q_heads");
  p.num_kv_heads = checked_int32(num_kv_heads, op, "num_kv_heads");
  p.head_dim = checked_int32(head_dim, op, "head_dim");
  p.block_size = checked_int32(key_cache.size(1), op, "block_size");
  p.num_blocks = checked_int32(key_cache.size(0), op, "num_blocks");
  p.max_blocks_per_seq = checked_int32(block_tables.size(1), op, "max_blocks_per_seq");
  check_attention_metadata(p, query, op);
  return p;
}

// The kernel the CUDA launcher will run for p on query's device; a forced one that cannot run p raises
// ValueError saying why (before any launch).
AttentionChoice checked_cuda_choice(const PagedAttentionParams& p, const at::Tensor& query, const char* op) {
#if defined(CLEF_WITH_CUDA) || defined(CLEF_CUDA_SIM)
#ifdef CLEF_WITH_CUDA
  c10::cuda::CUDAGuard guard(query.device());
#endif
  const AttentionChoice choice = paged_attention_cuda_choice(p, activation_kind(query, op, "query"));
  TORCH_CHECK_VALUE(choice.error == nullptr, op, ": kernel='", kernel_name(choice.kernel),
                    "' cannot run these arguments: ", choice.error);
  return choice;
#else
  (void)p;
  TORCH_CHECK(false, op, ": clef_cuda._C was built without CUDA kernels, so ", query.device(),
              " tensors cannot run; rebuild it with a CUDA toolchain (README)");
  return AttentionChoice{AttentionKernel::Simt, nullptr};  // not reached
#endif
}

}  // namespace

void paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                     const at::Tensor& cu_seqlens_q, const at::Tensor& context_lens, const at::Tensor& block_tables,
                     double scale, at::Tensor& out, c10::string_view kernel, int64_t max_query_len) {
  const char* op = "paged_attention";
  PagedAttentionParams p =
      attention_params(query, key_cache, value_cache, cu_seqlens_q, context_lens, block_tables, op);
  TORCH_CHECK_VALUE(max_query_len >= 0, op, ": max_query_len must be >= 0 (0: not given), got ", max_query_len);
  p.max_q_len = max_query_len;
  check_max_query_len(p, query, op);
  const ScalarKind kind = activation_kind(query, op, "query");
  check_shape(out, query.sizes(), op, "out");
  check_dtype(out, query.scalar_type(), op, "out");
  check_contiguous(out, op, "out");
  check_device(out, query, op, "out");
  p.out = out.data_ptr();
  p.scale = static_cast<float>(scale);
  p.kernel = parse_kernel(kernel, op);
  TORCH_CHECK_VALUE(p.kernel == AttentionKernel::Auto || runs_cuda_launcher(query), op, ": kernel='",
                    std::string(kernel), "' picks a CUDA kernel, but ", query.device(),
                    " tensors run the CPU implementation (pass kernel='auto')");
  if (p.kernel == AttentionKernel::Wmma) checked_cuda_choice(p, query, op);
  // v2's split-context workspace, allocated here so the launcher stays torch-free. Freed when this returns:
  // the caching allocator hands it out again only to work queued after the kernels on this stream.
  at::Tensor split_workspace;
  if (p.kernel == AttentionKernel::WmmaV2) {
    const AttentionChoice choice = checked_cuda_choice(p, query, op);
    if (choice.splits > 1) {
      split_workspace = at::empty({choice.workspace_bytes}, query.options().dtype(at::kByte));
      p.splits = choice.splits;
      p.split_workspace = split_workspace.data_ptr();
      p.split_workspace_bytes = choice.workspace_bytes;
    }
  }
  run_on_device(
      query, op, [&](void* stream) { return paged_attention_cuda(p, kind, stream); },
      [&] { paged_attention_cpu(p, kind); });
}

std::string paged_attention_tiles(int64_t head_dim, int64_t compute_capability, int64_t smem_limit) {
  TORCH_CHECK_VALUE(paged_attention_cuda_supports_head_dim(static_cast<int>(head_dim)),
                    "paged_attention_tiles: the CUDA kernels are compiled for head_dim 16, 32, 64, 128 and 256, got ",
                    head_dim);
  const int d = static_cast<int>(head_dim), limit = static_cast<int>(smem_limit);
  auto tile = [](const char* kernel, int keys, int bytes) {
    char text[96];
    std::snprintf(text, sizeof(text), "%s: %d keys a tile (%.2f KB)", kernel, keys, bytes / 1024.0);
    return std::string(text);
  };
  std::string out;
  const bool tensor_cores = compute_capability >= 70 && paged_attention_wmma_head_dim(d);
  const int wmma = tensor_cores ? paged_attention_wmma_keys(d, limit) : 0;
  if (wmma > 0) out = tile("tensor cores", wmma, paged_attention_wmma_smem_bytes(d, wmma)) + "; ";
  const int wmma2 = tensor_cores ? paged_attention_wmma2_keys(d, limit) : 0;  // the autotune's other candidate
  if (wmma2 > 0) out += tile("tensor cores v2", wmma2, paged_attention_wmma2_smem_bytes(d, wmma2)) + "; ";
  const int simt = paged_attention_simt_keys(d, limit);
  return out + (simt > 0 ? tile("SIMT", simt, 4 * paged_attention_smem_floats(d, simt)) : "SIMT: no tile fits");
}

std::string paged_attention_dispatch(const at::Tensor& query, const at::Tensor& key_cache,
                                     const at::Tensor& value_cache, const at::Tensor& cu_seqlens_q,
                                     const at::Tensor& context_lens, const at::Tensor& block_tables,
                                     c10::string_view kernel) {
  const char* op = "paged_attention_dispatch";
  PagedAttentionParams p =
      attention_params(query, key_cache, value_cache, cu_seqlens_q, context_lens, block_tables, op);
  p.kernel = parse_kernel(kernel, op);
  if (!runs_cuda_launcher(query)) return "cpu";
  return kernel_name(checked_cuda_choice(p, query, op).kernel);
}

}  // namespace clef
