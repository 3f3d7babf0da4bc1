// Compiles csrc/conv1d/conv1d_launch.cu (kernels and launcher, unmodified) for the CPU simulator.
#include "cuda_sim.h"
// clang-format off
#include "conv1d/conv1d_launch.cu"
