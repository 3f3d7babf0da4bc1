// Host-side launchers for the paged KV cache kernels. Torch-free on purpose.
#include "paged_attention/paged_attention_kernels.cuh"
#include "paged_attention/paged_attention_launch.h"

namespace clef {

static const char* last_error() {
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

template <typename T>
static const char* launch_cache_write(const CacheWriteParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return nullptr;
  auto* kernel = &reshape_and_cache_kernel<T>;
  CLEF_LAUNCH(kernel, static_cast<unsigned>(p.num_tokens), kCacheWriteThreads, 0, stream)(p);
  return last_error();
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

template <typename T, int D>
static const char* launch_attention(const PagedAttentionParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.num_tokens == 0) return nullptr;
  if (!paged_attention_cuda_supports_group(p.num_q_heads / p.num_kv_heads))
    return "the SIMT kernel needs num_q_heads / num_kv_heads to divide its 16-row tile";
  const int tile_tokens = kAttnRows / (p.num_q_heads / p.num_kv_heads);
  // Bounded by the whole pack so no device-to-host copy of cu_seqlens_q is needed; tiles past a
  // sequence's queries exit at once.
  const unsigned q_tiles = static_cast<unsigned>((p.num_tokens + tile_tokens - 1) / tile_tokens);
  const size_t smem = sizeof(float) * paged_attention_smem_floats<D>();
  auto* kernel = &paged_attention_kernel<T, D>;
  // Above 48 KB a kernel must opt in to its dynamic shared memory (D = 256 in fp32 needs ~50 KB).
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return cudaGetErrorString(err);
  CLEF_LAUNCH(kernel, dim3(q_tiles, p.num_kv_heads, p.batch), kAttnThreads, smem, stream)(p);
  return last_error();
}

template <typename T>
static const char* launch_for_head_dim(const PagedAttentionParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 16: return launch_attention<T, 16>(p, stream);
    case 32: return launch_attention<T, 32>(p, stream);
    case 64: return launch_attention<T, 64>(p, stream);
    case 128: return launch_attention<T, 128>(p, stream);
    case 256: return launch_attention<T, 256>(p, stream);
  }
  return "paged attention CUDA kernels are compiled for head dims 16, 32, 64, 128 and 256";
}

template <typename T, int D>
static const char* launch_attention_wmma(const PagedAttentionParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.num_tokens == 0) return nullptr;
  const int tile_tokens = kWmmaRows / (p.num_q_heads / p.num_kv_heads);
  const unsigned q_tiles = static_cast<unsigned>((p.num_tokens + tile_tokens - 1) / tile_tokens);
  constexpr int smem = WmmaLayout<D>::kBytes;
  auto* kernel = &paged_attention_wmma_kernel<T, D>;
  // D = 256 needs more than the 48 KB every kernel gets by default (paged_attention.h, WmmaLayout).
  if (smem > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return cudaGetErrorString(err);
  }
  CLEF_LAUNCH(kernel, dim3(q_tiles, p.num_kv_heads, p.batch), kWmmaThreads, smem, stream)(p);
  return last_error();
}

template <typename T>
static const char* launch_wmma_for_head_dim(const PagedAttentionParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_attention_wmma<T, 64>(p, stream);
    case 128: return launch_attention_wmma<T, 128>(p, stream);
    case 256: return launch_attention_wmma<T, 256>(p, stream);
  }
  return "the tensor-core kernel is compiled for head dims 64, 128 and 256";
}

static int current_compute_capability() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();  // clear it: the SIMT kernel is the safe answer
    return 0;
  }
  return 10 * major + minor;
}

AttentionChoice paged_attention_cuda_choice(const PagedAttentionParams& p, ScalarKind kind) {
  const int cc = current_compute_capability();
  AttentionChoice choice{paged_attention_choose_kernel(p, kind, cc), nullptr};
  if (choice.kernel == AttentionKernel::Wmma) choice.error = paged_attention_wmma_unsupported(p, kind, cc);
  return choice;
}

const char* paged_attention_cuda(const PagedAttentionParams& p, ScalarKind kind, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const AttentionChoice choice = paged_attention_cuda_choice(p, kind);
  if (choice.error != nullptr) return choice.error;
  if (choice.kernel == AttentionKernel::Wmma) {
    switch (kind) {
      case ScalarKind::F16: return launch_wmma_for_head_dim<__half>(p, stream);
      case ScalarKind::BF16: return launch_wmma_for_head_dim<__nv_bfloat16>(p, stream);
      case ScalarKind::F32: break;  // paged_attention_wmma_unsupported said so already
    }
    return "paged_attention: the tensor-core kernel takes f16 or bf16";
  }
  switch (kind) {
    case ScalarKind::F32: return launch_for_head_dim<float>(p, stream);
    case ScalarKind::F16: return launch_for_head_dim<__half>(p, stream);
    case ScalarKind::BF16: return launch_for_head_dim<__nv_bfloat16>(p, stream);
  }
  return "paged_attention: unknown dtype";
}

}  // namespace clef
