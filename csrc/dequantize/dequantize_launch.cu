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

}  // namespace clef
