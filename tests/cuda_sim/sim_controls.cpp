// Test-only controls of the simulated device, as ops of the simulator module: its compute capability
// (the launchers' dispatch rules read it) and the fault switched on at the kernels' CLEF_FAULT points.
// Each returns the previous setting, so a test can restore it.
#include <torch/library.h>

#include "cuda_sim.h"

namespace {

int64_t set_compute_capability(int64_t cc) {
  TORCH_CHECK_VALUE(cc >= 10 && cc < 1000, "set_compute_capability: e.g. 70 for sm_70, got ", cc);
  const int previous = clef_sim::compute_capability;
  clef_sim::compute_capability = static_cast<int>(cc);
  return previous;
}

std::string set_fault(c10::string_view name) {
  std::string previous = clef_sim::active_fault;
  clef_sim::active_fault = std::string(name);
  return previous;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(clef_sim, m) {
  m.def("set_compute_capability(int cc) -> int", &set_compute_capability);
  m.def("set_fault(str name) -> str", &set_fault);
}
