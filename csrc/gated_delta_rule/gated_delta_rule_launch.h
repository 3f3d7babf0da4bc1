// Torch-free entry points of the gated delta rule family (see conv1d_launch.h for the conventions).
#pragma once

#include "gated_delta_rule/gated_delta_rule.h"

namespace clef {

const char* gated_delta_rule_cuda(const GatedDeltaRuleParams& p, ScalarKind kind, void* stream);
void gated_delta_rule_cpu(const GatedDeltaRuleParams& p, ScalarKind kind);

// Head dims the CUDA kernels are compiled for (Dk == Dv; clef-flash uses 128). The CPU takes any.
constexpr bool gated_delta_rule_cuda_supports(int head_k_dim, int head_v_dim) {
  return head_k_dim == head_v_dim && (head_k_dim == 16 || head_k_dim == 32 || head_k_dim == 64 || head_k_dim == 128);
}

}  // namespace clef
