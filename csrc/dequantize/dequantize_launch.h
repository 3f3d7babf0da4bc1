// Torch-free entry points of the dequantize family (see conv1d_launch.h for the conventions).
#pragma once

#include "dequantize/dequantize.h"

namespace clef {

const char* dequantize_int8_cuda(const DequantizeParams& p, ScalarKind kind, void* stream);
void dequantize_int8_cpu(const DequantizeParams& p, ScalarKind kind);
const char* int8_linear_cuda(const Int8LinearParams& p, ScalarKind kind, void* stream);
void int8_linear_cpu(const Int8LinearParams& p, ScalarKind kind);

}  // namespace clef
