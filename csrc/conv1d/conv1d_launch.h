// Torch-free entry points of the conv1d family. The CUDA launchers return nullptr on success or the
// CUDA error string; `stream` is a cudaStream_t passed as void* so callers need no CUDA headers.
#pragma once

#include "conv1d/conv1d.h"

namespace clef {

const char* conv1d_fwd_cuda(const Conv1dParams& p, ScalarKind kind, void* stream);
void conv1d_fwd_cpu(const Conv1dParams& p, ScalarKind kind);

// Widths the CUDA kernels are compiled for (the CPU path takes any width up to kConvMaxWidth).
constexpr bool conv1d_cuda_supports_width(int width) { return width == 4; }

}  // namespace clef
