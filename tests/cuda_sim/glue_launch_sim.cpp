// Compiles csrc/glue/glue_launch.cu (kernels and launchers, unmodified) for the CPU simulator.
#include "cuda_sim.h"
// clang-format off
#include "glue/glue_launch.cu"
