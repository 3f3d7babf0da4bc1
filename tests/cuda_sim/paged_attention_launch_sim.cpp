// Compiles csrc/paged_attention/paged_attention_launch.cu (kernels and launcher, unmodified) for the CPU simulator.
#include "cuda_sim.h"
// clang-format off
#include "paged_attention/paged_attention_launch.cu"
