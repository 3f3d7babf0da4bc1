// Host-side launchers for the paged KV cache kernels. Torch-free on purpose.
#include "common/device_launch.cuh"
#include "paged_attention/paged_attention_kernels.cuh"
#include "paged_attention/paged_attention_launch.h"

namespace clef {

// grid.y and grid.z above 65,535 fail to launch on every arch; say which dimension and why first.
static const char* grid_error(unsigned y, unsigned z) {
  if (y > static_cast<unsigned>(kMaxGridYZ)) return "paged_attention: more KV heads than a grid's 65,535 (grid.y)";
  if (z > static_cast<unsigned>(kMaxGridYZ))
    return "paged_attention: more sequences in one call than a grid's 65,535 (grid.z); split the pack";
  return nullptr;
}

template <typename T>
static const char* launch_cache_write(const CacheWriteParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return nullptr;
  auto* kernel = &reshape_and_cache_kernel<T>;
  CLEF_LAUNCH(kernel, static_cast<unsigned>(p.num_tokens), kCacheWriteThreads, 0, stream)(p);
  return launch_error();
}

const char* reshape_and_cache_cuda(const CacheWriteParams& p, ScalarKind kind, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  switch (kind) {
    case ScalarKind::F32: return launch_cache_write<float>(p, stream);
    case ScalarKind::F16: return launch_cache_write<__half>(p, stream);
    case ScalarKind::BF16: return launch_cache_write<__nv_bfloat16>(p, stream);
  }
  return "reshape_and_cache: unknown dtype";
}

template <typename T, int D, int KEYS>
static const char* launch_attention(const PagedAttentionParams& p, cudaStream_t stream) {
  const int tile_tokens = kAttnRows / (p.num_q_heads / p.num_kv_heads);
  // Tiles for the longest sequence's queries (the host's max_q_len); a shorter sequence's tiles past its
  // queries exit at once.
  const unsigned q_tiles = static_cast<unsigned>(attn_query_tiles(p, tile_tokens));
  constexpr int smem = 4 * paged_attention_smem_floats(D, KEYS);
  auto* kernel = &paged_attention_kernel<T, D, KEYS>;
  if (const char* err = grid_error(p.num_kv_heads, p.batch)) return err;
  if (const char* err = opt_in(kernel, smem)) return err;
  CLEF_LAUNCH(kernel, dim3(q_tiles, p.num_kv_heads, p.batch), kAttnThreads, smem, stream)(p);
  return launch_error();
}

// The SIMT kernel with the largest key tile the device's shared memory holds.
template <typename T>
static const char* launch_for_head_dim(const PagedAttentionParams& p, AttentionDevice device, cudaStream_t stream) {
  if (p.batch == 0 || p.num_tokens == 0) return nullptr;
  if (!paged_attention_cuda_supports_group(p.num_q_heads / p.num_kv_heads))
    return "the SIMT kernel takes at most 16 query heads a KV head (its 16-row tile)";
  const int keys = CLEF_FAULT(attention_ignores_smem_limit, paged_attention_simt_keys(p.head_dim, device.smem_limit),
                              paged_attention_simt_key_options(p.head_dim, 0));
  switch (p.head_dim * 1000 + keys) {
    case 16032: return launch_attention<T, 16, 32>(p, stream);
    case 32032: return launch_attention<T, 32, 32>(p, stream);
    case 64032: return launch_attention<T, 64, 32>(p, stream);
    case 128032: return launch_attention<T, 128, 32>(p, stream);
    case 256016: return launch_attention<T, 256, 16>(p, stream);
    case 256008: return launch_attention<T, 256, 8>(p, stream);
  }
  if (paged_attention_cuda_supports_head_dim(p.head_dim))
    return "no SIMT attention tile of this head dim fits the device's shared memory per block";
  return "paged attention CUDA kernels are compiled for head dims 16, 32, 64, 128 and 256";
}

template <typename T, int D, int KEYS>
static const char* launch_attention_wmma(const PagedAttentionParams& p, cudaStream_t stream) {
  const int tile_tokens = kWmmaRows / (p.num_q_heads / p.num_kv_heads);
  const unsigned q_tiles = static_cast<unsigned>(attn_query_tiles(p, tile_tokens));
  constexpr int smem = WmmaLayout<D, KEYS>::kBytes;
  auto* kernel = &paged_attention_wmma_kernel<T, D, KEYS>;
  if (const char* err = grid_error(p.num_kv_heads, p.batch)) return err;
  if (const char* err = opt_in(kernel, smem)) return err;
  CLEF_LAUNCH(kernel, dim3(q_tiles, p.num_kv_heads, p.batch), kWmmaThreads, smem, stream)(p);
  return launch_error();
}

// The tensor-core kernel with the largest key tile the device's shared memory holds.
template <typename T>
static const char* launch_wmma_for_head_dim(const PagedAttentionParams& p, AttentionDevice device,
                                            cudaStream_t stream) {
  if (p.batch == 0 || p.num_tokens == 0) return nullptr;
  const int keys = CLEF_FAULT(attention_ignores_smem_limit, paged_attention_wmma_keys(p.head_dim, device.smem_limit),
                              paged_attention_wmma_key_options(p.head_dim, 0));
  switch (p.head_dim * 1000 + keys) {
    case 64064: return launch_attention_wmma<T, 64, 64>(p, stream);
    case 128032: return launch_attention_wmma<T, 128, 32>(p, stream);
    case 256032: return launch_attention_wmma<T, 256, 32>(p, stream);
    case 256016: return launch_attention_wmma<T, 256, 16>(p, stream);
  }
  return "the tensor-core kernel is compiled for head dims 64, 128 and 256 (within the device's shared memory)";
}

// v2, then (split) the combine of its parts.
template <typename T, int D, int KEYS>
static const char* launch_attention_wmma2(const PagedAttentionParams& p, cudaStream_t stream) {
  const unsigned q_tiles = static_cast<unsigned>(paged_attention_wmma2_query_tiles(p));
  const unsigned parts = static_cast<unsigned>(p.splits);
  constexpr int smem = Wmma2Layout<D, KEYS>::kBytes;
  auto* kernel = &paged_attention_wmma2_kernel<T, D, KEYS>;
  if (const char* err = grid_error(p.num_kv_heads, static_cast<unsigned>(p.batch) * parts)) return err;
  if (const char* err = opt_in(kernel, smem)) return err;
  CLEF_LAUNCH(kernel, dim3(q_tiles, p.num_kv_heads, p.batch * parts), kWmma2Threads, smem, stream)(p);
  if (p.splits == 1) return launch_error();
  if (const char* err = launch_error()) return err;
  const int combine_smem = kWmmaRows * p.splits * static_cast<int>(sizeof(float));
  auto* combine = &paged_attention_split_combine_kernel<T>;
  CLEF_LAUNCH(combine, dim3(q_tiles, p.num_kv_heads, p.batch), kSplitCombineThreads, combine_smem, stream)(p, KEYS);
  return launch_error();
}

// v2 with the largest key tile the device's shared memory holds.
template <typename T>
static const char* launch_wmma2_for_head_dim(const PagedAttentionParams& p, AttentionDevice device,
                                             cudaStream_t stream) {
  if (p.batch == 0 || p.num_tokens == 0) return nullptr;
  if (p.splits < 1 || p.splits > kWmma2MaxSplits)
    return "paged_attention: v2's split count is out of range (1..kWmma2MaxSplits)";
  if (p.splits > 1 &&
      (p.split_workspace == nullptr || p.split_workspace_bytes < paged_attention_wmma2_workspace_bytes(p, p.splits)))
    return "paged_attention: v2's split-context pass needs the workspace paged_attention_cuda_choice sized";
  const int keys = CLEF_FAULT(attention_ignores_smem_limit, paged_attention_wmma2_keys(p.head_dim, device.smem_limit),
                              paged_attention_wmma2_key_options(p.head_dim, 0));
  switch (p.head_dim * 1000 + keys) {
    case 64032: return launch_attention_wmma2<T, 64, 32>(p, stream);
    case 128032: return launch_attention_wmma2<T, 128, 32>(p, stream);
    case 256032: return launch_attention_wmma2<T, 256, 32>(p, stream);
    case 256016: return launch_attention_wmma2<T, 256, 16>(p, stream);
  }
  return "the tensor-core kernel v2 is compiled for head dims 64, 128 and 256 (within the device's shared memory)";
}

static AttentionChoice choose(const PagedAttentionParams& p, ScalarKind kind, AttentionDevice device) {
  AttentionChoice choice{paged_attention_choose_kernel(p, kind, device), nullptr};
  if (choice.kernel == AttentionKernel::Wmma) choice.error = paged_attention_wmma_unsupported(p, kind, device);
  if (choice.kernel == AttentionKernel::WmmaV2) {
    choice.error = paged_attention_wmma2_unsupported(p, kind, device);
    if (choice.error == nullptr) {
      const int keys = paged_attention_wmma2_keys(p.head_dim, device.smem_limit);
      choice.splits = paged_attention_wmma2_splits(p, device, keys);
      choice.workspace_bytes = paged_attention_wmma2_workspace_bytes(p, choice.splits);
    }
  }
  return choice;
}

AttentionChoice paged_attention_cuda_choice(const PagedAttentionParams& p, ScalarKind kind) {
  return choose(p, kind, current_device());
}

const char* paged_attention_cuda(const PagedAttentionParams& p, ScalarKind kind, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const AttentionDevice device = current_device();
  const AttentionChoice choice = choose(p, kind, device);
  if (choice.error != nullptr) return choice.error;
  if (choice.kernel == AttentionKernel::WmmaV2) {
    switch (kind) {
      case ScalarKind::F16: return launch_wmma2_for_head_dim<__half>(p, device, stream);
      case ScalarKind::BF16: return launch_wmma2_for_head_dim<__nv_bfloat16>(p, device, stream);
      case ScalarKind::F32: break;  // paged_attention_wmma2_unsupported said so already
    }
    return "paged_attention: the tensor-core kernel takes f16 or bf16";
  }
  if (choice.kernel == AttentionKernel::Wmma) {
    switch (kind) {
      case ScalarKind::F16: return launch_wmma_for_head_dim<__half>(p, device, stream);
      case ScalarKind::BF16: return launch_wmma_for_head_dim<__nv_bfloat16>(p, device, stream);
      case ScalarKind::F32: break;  // paged_attention_wmma_unsupported said so already
    }
    return "paged_attention: the tensor-core kernel takes f16 or bf16";
  }
  switch (kind) {
    case ScalarKind::F32: return launch_for_head_dim<float>(p, device, stream);
    case ScalarKind::F16: return launch_for_head_dim<__half>(p, device, stream);
    case ScalarKind::BF16: return launch_for_head_dim<__nv_bfloat16>(p, device, stream);
  }
  return "paged_attention: unknown dtype";
}

}  // namespace clef
