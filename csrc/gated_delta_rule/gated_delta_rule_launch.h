// Torch-free entry points of the gated delta rule family (see conv1d_launch.h for the conventions).
#pragma once

#include "gated_delta_rule/gated_delta_rule.h"

namespace clef {

const char* gated_delta_rule_cuda(const GatedDeltaRuleParams& p, ScalarKind kind, void* stream);
// The kernel gated_delta_rule_cuda runs for these params on the current device (gdr_choose at its compute
// capability, shared memory and SMs), why it cannot when the caller forced the chunked kernel where it does not
// run (else null), and for the chunked kernel its workspace bytes and column splits, which the caller
// allocates and passes in the params (workspace, state_columns, output_columns).
GdrChoice gated_delta_rule_cuda_choice(const GatedDeltaRuleParams& p, ScalarKind kind);
void gated_delta_rule_cpu(const GatedDeltaRuleParams& p, ScalarKind kind);

// Head dims the CUDA kernels are compiled for (Dk == Dv; clef-flash uses 128). The CPU takes any.
constexpr bool gated_delta_rule_cuda_supports(int head_k_dim, int head_v_dim) {
  return head_k_dim == head_v_dim && (head_k_dim == 16 || head_k_dim == 32 || head_k_dim == 64 || head_k_dim == 128);
}

}  // namespace clef
