// Test-only CUDA simulator: runs the project's CUDA kernels and launchers, unmodified, on the CPU.
//
// Each CUDA thread of a block is a real std::thread; blocks run one after another. __syncthreads,
// __syncwarp, the warp shuffles and the warp-wide WMMA operations (wmma_sim.h) are real barriers, so the
// kernels' thread mapping, shared-memory tiling and synchronisation are what the tests exercise; a barrier
// that not every thread reaches is reported as a deadlock instead of hanging. Dynamic shared memory is
// NaN-poisoned per block (every 4-byte word 0x7fff7fff: NaN as fp32 and as both of its f16 or bf16
// halves), so reading a slot no thread wrote shows up in the results. What a GPU would fault on is
// checked: misaligned 16-byte and WMMA accesses, more than 48 KB of dynamic shared memory without the
// kernel's opt-in, more than the simulated compute capability's opt-in limit with it. The device has a
// compute capability tests can set (default 8.0): the launchers' dispatch rules and tile choices read it,
// and so does the shared-memory limit (48 KB sm_60/61 ... 227 KB sm_90). This is not a product code path:
// tests/cuda_sim/build.py compiles it into a separate module whose ops live in torch.ops.clef_sim.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

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

// The most shared memory one block may have on the simulated device, with the opt-in
// (cudaDevAttrMaxSharedMemoryPerBlockOptin; CUDA C++ Programming Guide, "Compute Capabilities"):
// Pascal cannot opt in above the 48 KB default.
inline int max_dynamic_smem_bytes() {
  switch (compute_capability) {
    case 70: case 72: return 96 * 1024;
    case 75: return 64 * 1024;
    case 80: case 87: return 163 * 1024;
    case 86: case 89: return 99 * 1024;
    case 90: return 227 * 1024;
    default: return kDefaultDynamicSmemBytes;  // sm_60/61/62, and any capability not listed
  }
}

// Dynamic shared memory each kernel opted in to with cudaFuncSetAttribute.
inline std::mutex attribute_mutex;
inline std::map<const void*, int> max_dynamic_smem;

inline void check_aligned(const void* ptr, size_t bytes, const char* what) {
  if (reinterpret_cast<uintptr_t>(ptr) % bytes != 0)
    throw std::runtime_error(std::string("simulated CUDA: misaligned address in a ") + what + " (needs " +
                             std::to_string(bytes) + "-byte alignment)");
}

class Barrier {
 public:
  explicit Barrier(int participants) : participants_(participants) {}
  void arrive_and_wait(const char* what) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (broken_) throw std::runtime_error("simulated CUDA: block aborted");
    const uint64_t generation = generation_;
    if (++arrived_ == participants_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    const bool released = cv_.wait_for(lock, std::chrono::seconds(30), [&] { return generation_ != generation || broken_; });
    if (!released) {
      broken_ = true;
      cv_.notify_all();
      throw std::runtime_error(std::string("simulated CUDA deadlock: not every thread reached ") + what);
    }
    if (broken_) throw std::runtime_error("simulated CUDA: block aborted");
  }
  void abort() {
    std::lock_guard<std::mutex> lock(mutex_);
    broken_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int participants_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool broken_ = false;
};

struct Warp {
  Barrier barrier{32};
  uint64_t lanes[32];
};

struct Block {
  explicit Block(int threads, size_t smem_bytes) : sync(threads), dynamic_smem((smem_bytes + 127) / 128 + 1) {
    for (int w = 0; w < threads / 32; ++w) warps.emplace_back(std::make_unique<Warp>());
    const uint32_t poison = 0x7fff7fffu;
    uint32_t* words = reinterpret_cast<uint32_t*>(dynamic_smem.data());
    for (size_t i = 0; i < dynamic_smem.size() * 32; ++i) words[i] = poison;
  }
  unsigned char* smem() { return reinterpret_cast<unsigned char*>(dynamic_smem.data()); }
  Barrier sync;
  std::vector<std::unique_ptr<Warp>> warps;
  struct alignas(128) Line {
    unsigned char bytes[128];
  };
  std::vector<Line> dynamic_smem;  // 128-byte aligned, as a GPU's shared-memory window is
};

inline thread_local Block* current_block = nullptr;
inline thread_local int current_thread = 0;

}  // namespace clef_sim

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

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

template <typename Kernel>
inline cudaError_t cudaFuncSetAttribute(Kernel* kernel, cudaFuncAttribute, int value) {
  if (value > clef_sim::max_dynamic_smem_bytes())
    throw std::runtime_error("simulated CUDA: a kernel asks for " + std::to_string(value) +
                             " bytes of dynamic shared memory, more than sm_" +
                             std::to_string(clef_sim::compute_capability) + " allows (" +
                             std::to_string(clef_sim::max_dynamic_smem_bytes()) + ")");
  std::lock_guard<std::mutex> lock(clef_sim::attribute_mutex);
  clef_sim::max_dynamic_smem[reinterpret_cast<const void*>(kernel)] = value;
  return cudaSuccess;
}

inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  switch (attr) {
    case cudaDevAttrComputeCapabilityMajor: *value = clef_sim::compute_capability / 10; break;
    case cudaDevAttrComputeCapabilityMinor: *value = clef_sim::compute_capability % 10; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = clef_sim::max_dynamic_smem_bytes(); break;
  }
  return cudaSuccess;
}

#define CLEF_DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(clef_sim::current_block->smem())
#define CLEF_DYNAMIC_SHARED_ALIGNED(type, name, bytes) CLEF_DYNAMIC_SHARED(type, name)
#define CLEF_FAULT(name, good, faulty) (clef_sim::active_fault == #name ? (faulty) : (good))
#define CLEF_CHECK_ALIGNED(ptr, bytes, what) clef_sim::check_aligned(ptr, bytes, what)

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
    blockDim = block_;
    gridDim = grid_;
    for (unsigned bz = 0; bz < grid_.z; ++bz)
      for (unsigned by = 0; by < grid_.y; ++by)
        for (unsigned bx = 0; bx < grid_.x; ++bx) run_block(uint3{bx, by, bz}, threads, args...);
  }

 private:
  template <typename... Args>
  void run_block(uint3 block_index, int threads, const Args&... args) const {
    Block block(threads, smem_);
    std::vector<std::thread> workers;
    std::vector<std::exception_ptr> errors(threads);
    workers.reserve(threads);
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        current_block = &block;
        current_thread = t;
        threadIdx = uint3{t % block_.x, (t / block_.x) % block_.y, t / (block_.x * block_.y)};
        blockIdx = block_index;
        try {
          kernel_(args...);
        } catch (...) {
          errors[t] = std::current_exception();
          block.sync.abort();
          for (auto& w : block.warps) w->barrier.abort();
        }
      });
    }
    for (auto& w : workers) w.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }

  void (*kernel_)(Params...);
  dim3 grid_, block_;
  size_t smem_;
};

}  // namespace clef_sim

#define CLEF_LAUNCH(kernel, grid, block, smem_bytes, stream) clef_sim::Launch(kernel, dim3(grid), dim3(block), smem_bytes)
