// Test-only CUDA simulator: runs the project's CUDA kernels and launchers, unmodified, on the CPU.
//
// Each CUDA thread of a block is a fiber of its own (a stack, switched cooperatively: below); blocks run one
// after another. __syncthreads, __syncwarp, named barriers (bar.sync id, count: one barrier per block and id
// over exactly that count), the warp shuffles and votes and the warp-wide WMMA operations (wmma_sim.h) are
// real barriers, so the
// kernels' thread mapping, shared-memory tiling and synchronisation are what the tests exercise; a barrier
// that not every thread reaches is reported as a deadlock instead of hanging (as soon as every thread
// still running waits at a barrier). Dynamic shared memory is
// NaN-poisoned per block (every 4-byte word 0x7fff7fff: NaN as fp32 and as both of its f16 or bf16
// halves), so reading a slot no thread wrote shows up in the results. What a GPU would fault on is
// checked: misaligned 16-byte and WMMA accesses, more than 48 KB of dynamic shared memory without the
// kernel's opt-in, more than the simulated compute capability's opt-in limit with it. The device has a
// compute capability tests can set (default 8.0): the launchers' dispatch rules and tile choices read it,
// and so does the shared-memory limit (48 KB sm_60/61 ... 227 KB sm_90); and an SM count (default 80).
// This is not a product code path:
// tests/cuda_sim/build.py compiles it into a separate module whose ops live in torch.ops.clef_sim.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <atomic>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <sys/mman.h>
#include <exception>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <deque>
#include <vector>

#include "common/arch_limits.h"

// ---- the CUDA surface the kernels and launchers use -----------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static  // blocks run one at a time, so one copy per kernel instantiation suffices

using __half = c10::Half;
using __nv_bfloat16 = c10::BFloat16;

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
  unsigned x, y, z;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

using cudaStream_t = void*;
enum cudaError_t { cudaSuccess = 0 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr {
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrMaxSharedMemoryPerMultiprocessor = 81,
  cudaDevAttrReservedSharedMemoryPerBlock = 111,
  cudaDevAttrMaxThreadsPerMultiProcessor = 39,
  cudaDevAttrMaxBlocksPerMultiprocessor = 106,
  cudaDevAttrMaxRegistersPerMultiprocessor = 82,
};
inline const char* cudaGetErrorString(cudaError_t) { return "no error"; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }

namespace clef_sim {

// What every kernel gets without opting in.
constexpr int kDefaultDynamicSmemBytes = 48 * 1024;

// The simulated device (tests set it through torch.ops.clef_sim.set_compute_capability) and the fault
// switched on at the kernels' CLEF_FAULT points (torch.ops.clef_sim.set_fault; empty: none). Both are
// set between launches only.
inline int compute_capability = 80;
inline std::string active_fault;
// Whether CLEF_CHECK_FINITE checks (set_finite_check): on by default; off where a test judges kernels only by what
// a GPU would show (benchmarks/selfcheck_power.py: the self-check's own comparisons, not the simulator's check).
inline bool finite_check = true;
// The channels a band fault zeroes (CLEF_FAULT_BAND_CONTAINS; torch.ops.clef_sim.set_fault_band): [lo, hi).
inline int64_t fault_band_lo = 0, fault_band_hi = 0;
// SMs of the simulated device (torch.ops.clef_sim.set_multiprocessor_count): a V100's 80, so that the
// small grids tests can afford in the simulator are the ones a launcher sizes its work up for.
inline int multiprocessor_count = 80;
// The order a grid's blocks run along x (set_block_order): the last first, or the first first.
inline bool blocks_last_first = true;

// The most shared memory one block may have on the simulated device, with the opt-in: the table the
// compile check uses too (csrc/common/arch_limits.h; Pascal cannot opt in above the 48 KB default).
inline int max_dynamic_smem_bytes() { return clef::arch_max_smem_per_block(compute_capability); }

// Bumped whenever a test changes the simulated device (sim_controls.cpp), so that what the launchers
// cache per device (its attributes, the kernels' shared-memory opt-ins) is read again, as a new process
// on another card would.
inline std::atomic<int> device_generation{0};
// How often the launchers asked the device (cudaDeviceGetAttribute) and opted a kernel in
// (cudaFuncSetAttribute): tests check that both happen once per device, not once per call.
inline std::atomic<int64_t> attribute_queries{0};
inline std::atomic<int64_t> opt_ins{0};
inline std::atomic<int64_t> last_launch_smem{0};  // dynamic shared memory of the latest launch
inline std::atomic<int64_t> launches{0};          // kernel launches so far

// Dynamic shared memory each kernel opted in to with cudaFuncSetAttribute.
inline std::mutex attribute_mutex;
inline std::map<const void*, int> max_dynamic_smem;

inline void check_aligned(const void* ptr, size_t bytes, const char* what) {
  if (reinterpret_cast<uintptr_t>(ptr) % bytes != 0)
    throw std::runtime_error(std::string("simulated CUDA: misaligned address in a ") + what + " (needs " +
                             std::to_string(bytes) + "-byte alignment)");
}

// ---- the threads of a block: fibers ---------------------------------------------------------------
// Each CUDA thread of a block is a fiber (its own stack, switched cooperatively on one OS thread): a thread
// runs until it waits at a barrier or exits, then the ready thread of the lowest index runs (the highest, after
// an odd number of __syncthreads): so between two block-wide barriers the first warp runs as far as it can
// before the last one starts (then the other way round), and a warp that writes shared memory another warp
// still reads, or reads what another has not written yet, without a barrier between them, meets it in one
// of the two orders, every run alike. A barrier's last arrival releases the others and runs on. A barrier no
// thread can complete (every thread still running waits at one) is reported at once as a deadlock. OS
// threads, one per CUDA thread, made every barrier a round of futex waits and wakes and the interleaving
// chance: fibers switch ~100x faster and schedule the same way every run.
extern "C" void clef_sim_switch_context(void** save_sp, void* load_sp);  // sim_controls.cpp
extern "C" void clef_sim_fiber_start();                                   // sim_controls.cpp

inline thread_local int current_thread = 0;

// What the other threads of a block see once one has failed: the launch reports that thread's error.
struct BlockAborted : std::runtime_error {
  BlockAborted() : std::runtime_error("simulated CUDA: block aborted") {}
};

// Stacks for fibers, mapped once and reused by every block this OS thread runs (lazily committed: a fiber
// touches a few pages). The page below each stack is a guard: an overflow faults instead of corrupting.
class FiberStacks {
 public:
  static constexpr size_t kBytes = 512 * 1024;
  void* top(int index) {
    while (static_cast<int>(stacks_.size()) <= index) {
      const size_t page = 4096;
      void* base = mmap(nullptr, kBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                        -1, 0);
      if (base == MAP_FAILED) throw std::runtime_error("simulated CUDA: cannot map a fiber stack");
      mprotect(base, page, PROT_NONE);
      stacks_.push_back(static_cast<unsigned char*>(base) + page + kBytes);
    }
    return stacks_[index];
  }
  ~FiberStacks() {
    for (void* top : stacks_) munmap(static_cast<unsigned char*>(top) - kBytes - 4096, kBytes + 4096);
  }

 private:
  std::vector<void*> stacks_;
};
inline thread_local FiberStacks fiber_stacks;

class Block;
inline thread_local Block* current_block = nullptr;

// The fibers of one block and the loop that runs them (on the launching OS thread's own stack).
class Scheduler {
 public:
  enum class State { Ready, Running, Waiting, Done };
  struct Fiber {
    void* sp = nullptr;
    State state = State::Ready;
    uint3 thread_index{0, 0, 0};
    const char* deadlocked_at = nullptr;  // set when the block deadlocked: this fiber throws on waking
  };

  Scheduler(int threads, dim3 block_dim) : fibers_(threads), waiting_at_(threads, nullptr), ready_(threads, 0) {
    for (int t = 0; t < threads; ++t)
      fibers_[t].thread_index = uint3{t % block_dim.x, (t / block_dim.x) % block_dim.y, t / (block_dim.x * block_dim.y)};
  }

  // Runs body(t) for every thread t as a fiber until all have returned. body must not throw.
  template <typename Body>
  void run(Body& body) {
    struct Start {
      Scheduler* scheduler;
      Body* body;
    } start{this, &body};
    for (int t = 0; t < static_cast<int>(fibers_.size()); ++t) {
      // The first switch into a fiber "returns" into clef_sim_fiber_start, which calls entry(start).
      void** sp = static_cast<void**>(fiber_stacks.top(t)) - 11;
      uint32_t control[2];
      asm volatile("stmxcsr %0" : "=m"(control[0]));
      asm volatile("fnstcw %0" : "=m"(control[1]));
      sp[0] = nullptr;
      std::memcpy(&sp[1], control, sizeof(control));
      sp[2] = nullptr;                                          // r15
      sp[3] = nullptr;                                          // r14
      sp[4] = reinterpret_cast<void*>(&entry<Start>);           // r13: the function
      sp[5] = &start;                                           // r12: its argument
      sp[6] = nullptr;                                          // rbx
      sp[7] = nullptr;                                          // rbp
      sp[8] = reinterpret_cast<void*>(&clef_sim_fiber_start);   // the return address
      fibers_[t].sp = sp;
      fibers_[t].state = State::Ready;
      ready_[t] = 1;
      ++ready_count_;
    }
    for (;;) {
      if (ready_count_ == 0) {
        int stuck = -1;  // the first thread still waiting, if any: every one left is stuck
        for (int t = 0; t < static_cast<int>(fibers_.size()) && stuck < 0; ++t)
          if (fibers_[t].state == State::Waiting) stuck = t;
        if (stuck < 0) break;  // all done
        fibers_[stuck].deadlocked_at = waiting_at_[stuck];
        make_ready(stuck);
      }
      const int n = static_cast<int>(fibers_.size());
      int t = 0;
      if (last_first_) {
        t = n - 1;
        while (!ready_[t]) --t;
      } else {
        while (!ready_[t]) ++t;
      }
      ready_[t] = 0;
      --ready_count_;
      resume(t);
    }
  }

  // The running fiber waits (at `what`) until make_ready; then it runs on. Throws if the block deadlocked.
  void wait(const char* what) {
    const int t = current_thread;
    fibers_[t].state = State::Waiting;
    waiting_at_[t] = what;
    clef_sim_switch_context(&fibers_[t].sp, main_sp_);
    if (fibers_[t].deadlocked_at != nullptr)
      throw std::runtime_error(std::string("simulated CUDA deadlock: not every thread reached ") +
                               fibers_[t].deadlocked_at + " (every thread still running waits at a barrier)");
  }

  void make_ready(int t) {
    if (fibers_[t].state != State::Waiting) return;
    fibers_[t].state = State::Ready;
    ready_[t] = 1;
    ++ready_count_;
  }

  // A block-wide barrier completed: the other end of the block runs first until the next.
  void turn_around() { last_first_ = !last_first_; }

 private:
  template <typename Start>
  static void entry(void* arg) {
    Start& start = *static_cast<Start*>(arg);
    (*start.body)(current_thread);
    Scheduler& self = *start.scheduler;
    self.fibers_[current_thread].state = State::Done;
    clef_sim_switch_context(&self.fibers_[current_thread].sp, self.main_sp_);
    std::abort();  // a finished fiber is never resumed
  }

  void resume(int t) {
    fibers_[t].state = State::Running;
    current_thread = t;
    threadIdx_of_fiber(fibers_[t].thread_index);
    clef_sim_switch_context(&main_sp_, fibers_[t].sp);
  }
  static void threadIdx_of_fiber(uint3 index);  // defined once threadIdx is

  std::vector<Fiber> fibers_;
  std::vector<const char*> waiting_at_;
  std::vector<char> ready_;  // per thread: ready to run
  int ready_count_ = 0;
  bool last_first_ = false;
  void* main_sp_ = nullptr;
};

class Barrier {
 public:
  // block_wide: __syncthreads', whose every completion turns the scheduler around (Scheduler::turn_around).
  Barrier(int participants, Scheduler* scheduler, bool block_wide = false)
      : participants_(participants), scheduler_(scheduler), block_wide_(block_wide) {}
  void arrive_and_wait(const char* what) { arrive(what, participants_); }
  // A barrier whose participant count comes with each arrival (bar.sync id, count): the first arrival of
  // a generation sets it, and every later one must pass the same.
  void arrive_counted(const char* what, int count) { arrive(what, count, true); }
  void abort() {
    broken_ = true;
    for (int t : waiting_) scheduler_->make_ready(t);
    waiting_.clear();
  }

 private:
  void arrive(const char* what, int count, bool counted = false) {
    if (broken_) throw BlockAborted();
    if (counted && arrived_ == 0) participants_ = count;
    if (counted && count != participants_)
      throw std::runtime_error(std::string("simulated CUDA: ") + what + " with " + std::to_string(count) +
                               " threads, while others wait at it for " + std::to_string(participants_));
    if (++arrived_ == participants_) {
      arrived_ = 0;
      for (int t : waiting_) scheduler_->make_ready(t);
      waiting_.clear();
      if (block_wide_) scheduler_->turn_around();
      return;
    }
    waiting_.push_back(current_thread);
    scheduler_->wait(what);
    if (broken_) throw BlockAborted();
  }

  int participants_;
  Scheduler* scheduler_;
  bool block_wide_;
  int arrived_ = 0;
  std::vector<int> waiting_;
  bool broken_ = false;
};

struct Warp {
  explicit Warp(Scheduler* scheduler) : barrier(32, scheduler) {}
  Barrier barrier;
  uint64_t lanes[32];
};

// One thread's cp.async copies in flight: the committed groups, oldest first, and the group still open. A copy
// lands (is performed, reading its source then) only when the thread waits for its group.
struct AsyncCopies {
  struct Copy {
    void* dst;
    const void* src;
  };
  std::deque<std::vector<Copy>> groups;
  std::vector<Copy> open;
};

class Block {
 public:
  Block(int threads_, size_t smem_bytes, dim3 block_dim)
      : threads(threads_),
        scheduler(threads_, block_dim),
        sync(threads_, &scheduler, true),
        async_copies(threads_),
        dynamic_smem((smem_bytes + 127) / 128 + 1) {
    for (int w = 0; w < threads / 32; ++w) warps.emplace_back(std::make_unique<Warp>(&scheduler));
    const uint32_t poison = 0x7fff7fffu;
    uint32_t* words = reinterpret_cast<uint32_t*>(dynamic_smem.data());
    for (size_t i = 0; i < dynamic_smem.size() * 32; ++i) words[i] = poison;
  }
  unsigned char* smem() { return reinterpret_cast<unsigned char*>(dynamic_smem.data()); }
  // Barrier `id` of bar.sync (1..15), made on first use.
  Barrier& named(int id) {
    std::unique_ptr<Barrier>& barrier = named_barriers[id];
    if (!barrier) barrier = std::make_unique<Barrier>(0, &scheduler);
    return *barrier;
  }
  void abort() {
    sync.abort();
    for (auto& w : warps) w->barrier.abort();
    for (auto& [id, barrier] : named_barriers) barrier->abort();
  }
  int threads;
  Scheduler scheduler;
  Barrier sync;
  std::vector<AsyncCopies> async_copies;  // per thread
  std::vector<std::unique_ptr<Warp>> warps;
  std::map<int, std::unique_ptr<Barrier>> named_barriers;
  struct alignas(128) Line {
    unsigned char bytes[128];
  };
  std::vector<Line> dynamic_smem;  // 128-byte aligned, as a GPU's shared-memory window is
};

}  // namespace clef_sim

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

inline void clef_sim::Scheduler::threadIdx_of_fiber(uint3 index) { threadIdx = index; }

inline void __syncthreads() { clef_sim::current_block->sync.arrive_and_wait("__syncthreads"); }

namespace clef_sim {
// Every lane of the calling thread's warp must arrive (a warp-wide operation called from divergent code
// is a deadlock here, undefined behaviour on a GPU).
inline void warp_converge(const char* what) {
  current_block->warps[current_thread / 32]->barrier.arrive_and_wait(what);
}
inline int lane_id() { return current_thread % 32; }
}  // namespace clef_sim

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  if (mask != 0xffffffffu) throw std::runtime_error("simulated CUDA: only full-warp __syncwarp is modelled");
  clef_sim::warp_converge("__syncwarp");
}

[[noreturn]] inline void __trap() { throw std::runtime_error("simulated CUDA: __trap() (a kernel that must not run)"); }

template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
  if (mask != 0xffffffffu) throw std::runtime_error("simulated CUDA: only full-warp shuffles are modelled");
  clef_sim::Warp& warp = *clef_sim::current_block->warps[clef_sim::current_thread / 32];
  const int lane = clef_sim::current_thread % 32;
  std::memcpy(&warp.lanes[lane], &value, sizeof(T));
  warp.barrier.arrive_and_wait("__shfl_xor_sync (write)");
  int source = lane ^ lane_mask;
  if (source / width != lane / width) source = lane;  // CUDA: outside the segment, a lane reads itself
  T result;
  std::memcpy(&result, &warp.lanes[source], sizeof(T));
  warp.barrier.arrive_and_wait("__shfl_xor_sync (read)");
  return result;
}

namespace clef_sim {
// __any_sync / __all_sync: every lane of the warp takes part, as in a shuffle.
inline bool warp_vote(unsigned mask, bool predicate, bool all, const char* what) {
  if (mask != 0xffffffffu) throw std::runtime_error("simulated CUDA: only full-warp votes are modelled");
  Warp& warp = *current_block->warps[current_thread / 32];
  const int lane = current_thread % 32;
  warp.lanes[lane] = predicate ? 1 : 0;
  warp.barrier.arrive_and_wait(what);
  bool result = all;
  for (int l = 0; l < 32; ++l) result = all ? (result && warp.lanes[l] != 0) : (result || warp.lanes[l] != 0);
  warp.barrier.arrive_and_wait(what);
  return result;
}

// bar.sync id, threads: a barrier per (block, id) over exactly `threads` threads, which every participant
// must name alike; a count its participants never reach deadlocks, as on a GPU, and is reported.
inline void named_barrier_sync(int id, int threads) {
  Block& block = *current_block;
  if (id < 1 || id > 15)
    throw std::runtime_error("simulated CUDA: bar.sync barrier id " + std::to_string(id) +
                             " (1..15; 0 is __syncthreads')");
  if (threads <= 0 || threads % 32 != 0 || threads > block.threads)
    throw std::runtime_error("simulated CUDA: bar.sync " + std::to_string(id) + " over " + std::to_string(threads) +
                             " threads: a multiple of 32 up to the block's " + std::to_string(block.threads));
  const std::string what = "bar.sync " + std::to_string(id);
  block.named(id).arrive_counted(what.c_str(), threads);
}
}  // namespace clef_sim

namespace clef_sim {
inline void check_finite(float value, const char* what) {
  if (finite_check && !std::isfinite(value))
    throw std::runtime_error(std::string("simulated CUDA: a non-finite value (") + std::to_string(value) + ") in " +
                             what);
}

// cp.async as the hardware orders it for the issuing thread: each copy in flight until a wait covers its group.
inline void cp_async16(void* dst, const void* src) {
  current_block->async_copies[current_thread].open.push_back({dst, src});
}
inline void cp_async_commit() {
  AsyncCopies& copies = current_block->async_copies[current_thread];
  copies.groups.push_back(std::move(copies.open));
  copies.open.clear();
}
inline void cp_async_wait(int pending) {
  AsyncCopies& copies = current_block->async_copies[current_thread];
  while (static_cast<int>(copies.groups.size()) > pending) {
    for (const AsyncCopies::Copy& c : copies.groups.front()) std::memcpy(c.dst, c.src, 16);
    copies.groups.pop_front();
  }
}
}  // namespace clef_sim

inline int __any_sync(unsigned mask, int predicate) {
  return clef_sim::warp_vote(mask, predicate != 0, false, "__any_sync");
}
inline int __all_sync(unsigned mask, int predicate) {
  return clef_sim::warp_vote(mask, predicate != 0, true, "__all_sync");
}

template <typename Kernel>
inline cudaError_t cudaFuncSetAttribute(Kernel* kernel, cudaFuncAttribute, int value) {
  if (value > clef_sim::max_dynamic_smem_bytes())
    throw std::runtime_error("simulated CUDA: a kernel asks for " + std::to_string(value) +
                             " bytes of dynamic shared memory, more than sm_" +
                             std::to_string(clef_sim::compute_capability) + " allows (" +
                             std::to_string(clef_sim::max_dynamic_smem_bytes()) + ")");
  ++clef_sim::opt_ins;
  std::lock_guard<std::mutex> lock(clef_sim::attribute_mutex);
  clef_sim::max_dynamic_smem[reinterpret_cast<const void*>(kernel)] = value;
  return cudaSuccess;
}

inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  ++clef_sim::attribute_queries;
  const clef::ArchLimits limits = clef::arch_limits(clef_sim::compute_capability);
  switch (attr) {
    case cudaDevAttrComputeCapabilityMajor: *value = clef_sim::compute_capability / 10; break;
    case cudaDevAttrComputeCapabilityMinor: *value = clef_sim::compute_capability % 10; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = clef_sim::max_dynamic_smem_bytes(); break;
    case cudaDevAttrMultiProcessorCount: *value = clef_sim::multiprocessor_count; break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = limits.smem_per_sm; break;
    case cudaDevAttrReservedSharedMemoryPerBlock: *value = limits.smem_reserved_per_block; break;
    case cudaDevAttrMaxThreadsPerMultiProcessor: *value = limits.max_threads_per_sm; break;
    case cudaDevAttrMaxBlocksPerMultiprocessor: *value = limits.max_blocks_per_sm; break;
    case cudaDevAttrMaxRegistersPerMultiprocessor: *value = limits.registers_per_sm; break;
  }
  return cudaSuccess;
}

#define CLEF_DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(clef_sim::current_block->smem())
#define CLEF_DYNAMIC_SHARED_ALIGNED(type, name, bytes) CLEF_DYNAMIC_SHARED(type, name)
#define CLEF_FAULT(name, good, faulty) (clef_sim::active_fault == #name ? (faulty) : (good))
#define CLEF_CHECK_FINITE(value, what) clef_sim::check_finite(value, what)
#define CLEF_FAULT_BAND_CONTAINS(c) (clef_sim::fault_band_lo <= (c) && (c) < clef_sim::fault_band_hi)
#define CLEF_CP_ASYNC16(dst, src) clef_sim::cp_async16(dst, src)
#define CLEF_CP_ASYNC_COMMIT() clef_sim::cp_async_commit()
#define CLEF_CP_ASYNC_WAIT(n) clef_sim::cp_async_wait(n)
#define CLEF_CHECK_ALIGNED(ptr, bytes, what) clef_sim::check_aligned(ptr, bytes, what)
#define CLEF_BAR_SYNC(id, threads) clef_sim::named_barrier_sync(id, threads)
#define CLEF_DEVICE_GENERATION() clef_sim::device_generation.load()

#include "wmma_sim.h"

namespace clef_sim {

template <typename... Params>
class Launch {
 public:
  Launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem) : kernel_(kernel), grid_(grid), block_(block), smem_(smem) {}

  template <typename... Args>
  void operator()(Args&&... args) const {
    const int threads = static_cast<int>(block_.x * block_.y * block_.z);
    if (threads <= 0 || threads % 32 != 0 || threads > 1024)
      throw std::runtime_error("simulated CUDA: block size must be a positive multiple of 32 up to 1024");
    if (smem_ > static_cast<size_t>(max_dynamic_smem_bytes()))
      throw std::runtime_error("simulated CUDA: a launch with " + std::to_string(smem_) +
                               " bytes of dynamic shared memory, more than sm_" + std::to_string(compute_capability) +
                               " allows (" + std::to_string(max_dynamic_smem_bytes()) + ")");
    if (smem_ > static_cast<size_t>(kDefaultDynamicSmemBytes)) {
      std::lock_guard<std::mutex> lock(attribute_mutex);
      auto opted = max_dynamic_smem.find(reinterpret_cast<const void*>(kernel_));
      if (opted == max_dynamic_smem.end() || static_cast<size_t>(opted->second) < smem_)
        throw std::runtime_error("simulated CUDA: a launch with " + std::to_string(smem_) +
                                 " bytes of dynamic shared memory (above 48 KB) without "
                                 "cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize) first");
    }
    if (grid_.y > 65535 || grid_.z > 65535) throw std::runtime_error("simulated CUDA: grid.y/grid.z above 65535");
    last_launch_smem = static_cast<int64_t>(smem_);
    ++launches;
    blockDim = block_;
    gridDim = grid_;
    // A GPU runs a grid's blocks in any order: along x the last first by default (blocks_last_first), and
    // tests run both orders, so a block that writes what another block owns (its dead rows into the next
    // tile's token, say) is caught, not overwritten by the owner running after it.
    for (unsigned bz = 0; bz < grid_.z; ++bz)
      for (unsigned by = 0; by < grid_.y; ++by)
        for (unsigned i = 0; i < grid_.x; ++i)
          run_block(uint3{blocks_last_first ? grid_.x - 1 - i : i, by, bz}, threads, args...);
  }

 private:
  template <typename... Args>
  void run_block(uint3 block_index, int threads, const Args&... args) const {
    Block block(threads, smem_, block_);
    std::vector<std::exception_ptr> errors(threads);
    current_block = &block;
    blockIdx = block_index;
    auto body = [&](int t) {
      try {
        kernel_(args...);
      } catch (...) {
        errors[t] = std::current_exception();
        block.abort();
      }
    };
    block.scheduler.run(body);
    current_block = nullptr;
    for (auto& e : errors) {
      if (!e) continue;
      try {
        std::rethrow_exception(e);
      } catch (const BlockAborted&) {
        continue;  // a consequence: the error that aborted the block is another thread's
      }
    }
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }

  void (*kernel_)(Params...);
  dim3 grid_, block_;
  size_t smem_;
};

}  // namespace clef_sim

#define CLEF_LAUNCH(kernel, grid, block, smem_bytes, stream) clef_sim::Launch(kernel, dim3(grid), dim3(block), smem_bytes)
