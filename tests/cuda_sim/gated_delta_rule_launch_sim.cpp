// Compiles csrc/gated_delta_rule/gated_delta_rule_launch.cu (kernels and launcher, unmodified) for the CPU simulator.
#include "cuda_sim.h"
// clang-format off
#include "gated_delta_rule/gated_delta_rule_launch.cu"
