// Test-only controls of the simulated device, as ops of the simulator module: its compute capability
// (the launchers' dispatch rules read it), its SM count (v2 attention's split rule reads it) and the
// fault switched on at the kernels' CLEF_FAULT points. Each returns the previous setting, so a test can
// restore it. Also a probe of the simulator's own model of named barriers and warp votes.
#include <torch/library.h>

#include "cuda_sim.h"
// clang-format off
#include "common/cuda_utils.cuh"
// clang-format on

// The simulator's fiber switch (cuda_sim.h Scheduler), x86-64 System V: the callee-saved registers, the SSE
// and x87 control words, then the stack pointer; the first switch into a fiber returns into
// clef_sim_fiber_start, which calls r13(r12) on a 16-byte aligned stack.
#if !defined(__x86_64__)
#error "the CUDA simulator's fiber switch is written for x86-64"
#endif
asm(R"(
    .text
    .globl clef_sim_switch_context
    .type clef_sim_switch_context, @function
clef_sim_switch_context:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $16, %rsp
    stmxcsr 8(%rsp)
    fnstcw 12(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr 8(%rsp)
    fldcw 12(%rsp)
    addq $16, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size clef_sim_switch_context, .-clef_sim_switch_context

    .globl clef_sim_fiber_start
    .type clef_sim_fiber_start, @function
clef_sim_fiber_start:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size clef_sim_fiber_start, .-clef_sim_fiber_start
)");

namespace {

// One block of 4 warps. Warps 0 and 1 (and 2 and 3) hand a value over through shared memory across a
// named barrier of their own, as v2 attention's warp pairs do; `how` bends that barrier the ways a kernel
// could get it wrong. Each thread also votes on lane parity.
__global__ void named_barrier_probe(int how, int* results) {
  CLEF_DYNAMIC_SHARED(int, handoff);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, pair = warp / 2;
  if (warp % 2 == 0) handoff[pair * 32 + lane] = 1000 * pair + lane;
  int threads = 64;
  if (how == 1) threads = 48;                     // not a multiple of 32
  // The participants of pair 0's barrier disagree; pair 1's stays right, so the error names bar.sync 1 however
  // the simulator's threads are scheduled (both pairs wrong, whichever pair waited first was the one named).
  if (how == 2 && pair == 0 && warp % 2 == 1) threads = 96;
  if (how == 3) threads = 128;                    // more than the pair: never reached
  clef::group_bar_sync(pair, threads);
  if (warp % 2 == 1) results[threadIdx.x] = handoff[pair * 32 + lane];
  const int any_odd = __any_sync(0xffffffffu, lane % 2), all_odd = __all_sync(0xffffffffu, lane % 2);
  const int all_live = __all_sync(0xffffffffu, 1), any_past = __any_sync(0xffffffffu, lane > 31);
  if (warp % 2 == 0) results[threadIdx.x] = 8 * any_odd + 4 * all_odd + 2 * all_live + any_past;
}

// "ok" when the probe ran as a GPU would (every handoff and vote right), else what the simulator said.
std::string probe_named_barriers(c10::string_view how) {
  const int mode = how == "right" ? 0 : how == "count_not_a_multiple_of_32" ? 1 : how == "participants_disagree" ? 2
                 : how == "count_never_reached" ? 3 : -1;
  TORCH_CHECK_VALUE(mode >= 0, "probe_named_barriers: unknown case ", std::string(how));
  std::vector<int> results(128, -1);
  try {
    CLEF_LAUNCH(named_barrier_probe, 1, 128, 64 * sizeof(int), nullptr)(mode, results.data());
  } catch (const std::exception& error) {
    return error.what();
  }
  for (int t = 0; t < 128; ++t) {
    const int warp = t / 32, lane = t % 32;
    const int expected = warp % 2 == 1 ? 1000 * (warp / 2) + lane : 8 + 0 + 2 + 0;
    if (results[t] != expected)
      return "thread " + std::to_string(t) + " read " + std::to_string(results[t]) + ", not " +
             std::to_string(expected);
  }
  return "ok";
}

int64_t set_compute_capability(int64_t cc) {
  TORCH_CHECK_VALUE(cc >= 10 && cc < 1000, "set_compute_capability: e.g. 70 for sm_70, got ", cc);
  const int previous = clef_sim::compute_capability;
  clef_sim::compute_capability = static_cast<int>(cc);
  ++clef_sim::device_generation;
  return previous;
}

// The compile check's archs with one card each (csrc/common/arch_limits.h kCheckedArchs): "cc card SMs" lines,
// the devices tests simulate per arch.
std::vector<std::string> checked_archs() {
  std::vector<std::string> lines;
  for (const auto& a : clef::kCheckedArchs)
    lines.push_back(std::to_string(a.compute_capability) + " " + a.card + " " + std::to_string(a.multiprocessors));
  return lines;
}

int64_t set_multiprocessor_count(int64_t sms) {
  TORCH_CHECK_VALUE(sms >= 1 && sms <= 1024, "set_multiprocessor_count: 1..1024 SMs, got ", sms);
  const int previous = clef_sim::multiprocessor_count;
  clef_sim::multiprocessor_count = static_cast<int>(sms);
  ++clef_sim::device_generation;
  return previous;
}

std::string set_block_order(c10::string_view order) {
  TORCH_CHECK_VALUE(order == "last-first" || order == "first-last", "set_block_order: last-first or first-last");
  std::string previous = clef_sim::blocks_last_first ? "last-first" : "first-last";
  clef_sim::blocks_last_first = order == "last-first";
  return previous;
}

// The band of channels a band fault (CLEF_FAULT_BAND_CONTAINS) zeroes, [lo, hi); returns the previous one.
std::vector<int64_t> set_fault_band(int64_t lo, int64_t hi) {
  std::vector<int64_t> previous{clef_sim::fault_band_lo, clef_sim::fault_band_hi};
  clef_sim::fault_band_lo = lo;
  clef_sim::fault_band_hi = hi;
  return previous;
}

// Whether CLEF_CHECK_FINITE checks; returns the previous setting.
bool set_finite_check(bool on) {
  const bool previous = clef_sim::finite_check;
  clef_sim::finite_check = on;
  return previous;
}

std::string set_fault(c10::string_view name) {
  std::string previous = clef_sim::active_fault;
  clef_sim::active_fault = std::string(name);
  return previous;
}

// [device attribute queries, kernel opt-ins] so far, and the dynamic shared memory of the latest launch.
// Kernel launches so far (what a GPU would pay a launch for: benchmarks/selfcheck_cost.py counts the self-check's).
int64_t launch_count() { return clef_sim::launches.load(); }

std::vector<int64_t> launcher_device_calls() {
  return {clef_sim::attribute_queries.load(), clef_sim::opt_ins.load(), clef_sim::last_launch_smem.load()};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(clef_sim, m) {
  m.def("launcher_device_calls() -> int[]", &launcher_device_calls);
  m.def("launch_count() -> int", &launch_count);
  m.def("set_compute_capability(int cc) -> int", &set_compute_capability);
  m.def("set_multiprocessor_count(int sms) -> int", &set_multiprocessor_count);
  m.def("checked_archs() -> str[]", &checked_archs);
  m.def("set_fault(str name) -> str", &set_fault);
  m.def("set_fault_band(int lo, int hi) -> int[]", &set_fault_band);
  m.def("set_finite_check(bool on) -> bool", &set_finite_check);
  m.def("set_block_order(str order) -> str", &set_block_order);
  m.def("probe_named_barriers(str how) -> str", &probe_named_barriers);
}
