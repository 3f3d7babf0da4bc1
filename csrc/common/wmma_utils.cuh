// What the tensor-core kernels of every family share (device code only): nvcuda::wmma where the arch has
// it, and which element types it has there.
//
// WMMA exists from sm_70 and its bf16 fragments from sm_80; below them a tensor-core kernel compiles to a
// trap that its launcher never reaches (each family's dispatch rule keeps those devices on its SIMT kernel).
// The host pass (no __CUDA_ARCH__) sees everything, to launch it.
#pragma once

#include "common/cuda_utils.cuh"

#if !defined(CLEF_CUDA_SIM)
#include <mma.h>  // the CUDA simulator brings its own nvcuda::wmma (tests/cuda_sim/wmma_sim.h)
#endif

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 700
#define CLEF_WMMA_ARCH 1
#endif

namespace clef {

template <typename T>
struct WmmaCompiled {
  static constexpr bool value = true;
};
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
template <>
struct WmmaCompiled<__nv_bfloat16> {
  static constexpr bool value = false;
};
#endif

}  // namespace clef
