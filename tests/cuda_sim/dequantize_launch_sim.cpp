// Compiles csrc/dequantize/dequantize_launch.cu (kernel and launcher, unmodified) for the CPU simulator.
#include "cuda_sim.h"
// clang-format off
#include "dequantize/dequantize_launch.cu"
