// The CPU kernels' instruction-set choice (common/cpu_kernel.h) as ops: which variants this machine can
// run, which one runs now, and a switch, so a test can run the AVX2 code on an AVX-512 machine and an
// operator can pin one (CLEF_CPU_ISA, read by clef_cuda/ops.py).
#include <c10/util/Exception.h>

#include <string>
#include <vector>

#include "common/cpu_kernel.h"
#include "ops.h"

namespace clef {

std::vector<std::string> supported_cpu_isas() {
  std::vector<std::string> names;
  for (CpuIsa isa : {CpuIsa::Avx512, CpuIsa::Avx2, CpuIsa::Baseline})
    if (cpu_supports(isa)) names.emplace_back(cpu_isa_name(isa));
  return names;
}

std::string get_cpu_isa() { return cpu_isa_name(cpu_isa()); }

std::vector<int64_t> cpu_isa_calls() {
  std::vector<int64_t> calls;
  for (CpuIsa isa : {CpuIsa::Avx512, CpuIsa::Avx2, CpuIsa::Baseline})
    calls.push_back(cpu_isa_call_counts()[static_cast<int>(isa)].load(std::memory_order_relaxed));
  return calls;
}

std::string set_cpu_isa(c10::string_view name) {
  CpuIsa wanted = best_cpu_isa();
  if (name != "auto") {
    bool known = false;
    for (CpuIsa isa : {CpuIsa::Avx512, CpuIsa::Avx2, CpuIsa::Baseline})
      if (name == cpu_isa_name(isa)) wanted = isa, known = true;
    TORCH_CHECK_VALUE(known, "CPU instruction set must be auto, avx512, avx2 or baseline, got '", name, "'");
    TORCH_CHECK_VALUE(cpu_supports(wanted), "this CPU cannot run the ", name, " kernels (it runs ",
                      cpu_isa_name(best_cpu_isa()), " and below)");
  }
  return cpu_isa_name(static_cast<CpuIsa>(cpu_isa_setting().exchange(static_cast<int>(wanted))));
}

}  // namespace clef
