// Torch-free entry points of the glue family (see conv1d_launch.h for the conventions).
#pragma once

#include "glue/glue.h"

namespace clef {

const char* add_rms_norm_cuda(const AddRmsNormParams& p, ScalarKind kind, void* stream);
const char* silu_mul_cuda(const SiluMulParams& p, ScalarKind kind, void* stream);
const char* gated_rms_norm_cuda(const GatedRmsNormParams& p, ScalarKind kind, void* stream);
const char* rms_norm_rope_cuda(const RmsNormRopeParams& p, ScalarKind kind, void* stream);
const char* sigmoid_gate_cuda(const SigmoidGateParams& p, ScalarKind kind, void* stream);

void add_rms_norm_cpu(const AddRmsNormParams& p, ScalarKind kind);
void silu_mul_cpu(const SiluMulParams& p, ScalarKind kind);
void gated_rms_norm_cpu(const GatedRmsNormParams& p, ScalarKind kind);
void rms_norm_rope_cpu(const RmsNormRopeParams& p, ScalarKind kind);
void sigmoid_gate_cpu(const SigmoidGateParams& p, ScalarKind kind);

}  // namespace clef
