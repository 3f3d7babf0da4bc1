// Host-side launcher of the dequantize kernel. Torch-free on purpose.
#include "dequantize/dequantize_kernels.cuh"
#include "dequantize/dequantize_launch.h"

namespace clef {

template <typename T>
static const char* launch_dequantize(const DequantizeParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return nullptr;
  const int64_t chunks = p.rows * ((p.cols + kDequantizeVector - 1) / kDequantizeVector);
  const int64_t blocks = (chunks + kDequantizeThreads - 1) / kDequantizeThreads;
  if (blocks > 0x7fffffffLL) return "dequantize_int8: tensor too large for one launch";
  // The 16-byte path needs every row to start 16-byte aligned: rows a multiple of 16 long (the base
  // pointers are torch allocations, 256-byte aligned; the host entry checks it).
  auto* kernel = p.cols % kDequantizeVector == 0 ? &dequantize_int8_kernel<T, true> : &dequantize_int8_kernel<T, false>;
  CLEF_LAUNCH(kernel, static_cast<unsigned>(blocks), kDequantizeThreads, 0, stream)(p);
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

const char* dequantize_int8_cuda(const DequantizeParams& p, ScalarKind kind, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  switch (kind) {
    case ScalarKind::F32: return launch_dequantize<float>(p, stream);
    case ScalarKind::F16: return launch_dequantize<__half>(p, stream);
    case ScalarKind::BF16: return launch_dequantize<__nv_bfloat16>(p, stream);
  }
  return "dequantize_int8: unknown dtype";
}

template <typename T>
static const char* launch_int8_linear(const Int8LinearParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.out_features == 0) return nullptr;
  if (p.rows > kInt8LinearMaxRows) return "int8_linear: at most 64 rows a call (dequantize + GEMM runs larger steps)";
  const int64_t blocks = (p.out_features + kInt8LinearColumns - 1) / kInt8LinearColumns;
  if (blocks > 0x7fffffffLL) return "int8_linear: too many output features for one launch";
  auto* kernel = &int8_linear_kernel<T>;
  CLEF_LAUNCH(kernel, static_cast<unsigned>(blocks), kInt8LinearThreads, 0, stream)(p);
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

const char* int8_linear_cuda(const Int8LinearParams& p, ScalarKind kind, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  switch (kind) {
    case ScalarKind::F32: return launch_int8_linear<float>(p, stream);
    case ScalarKind::F16: return launch_int8_linear<__half>(p, stream);
    case ScalarKind::BF16: return launch_int8_linear<__nv_bfloat16>(p, stream);
  }
  return "int8_linear: unknown dtype";
}

}  // namespace clef
