// Host-side helpers every launcher shares (torch-free; the CUDA runtime, or the simulator's stand-in for it):
// what the current device offers (compute capability, shared memory per block, SMs), read once per device,
// and a kernel's opt-in to more than the 48 KB of dynamic shared memory every kernel gets.
#pragma once

#include <cstdlib>
#include <map>
#include <mutex>
#include <utility>

#include "common/arch_limits.h"

// The simulator bumps this whenever a test changes the simulated device, so the cached attributes below
// are read again; a real device's never change while the process runs.
#ifndef CLEF_DEVICE_GENERATION
#define CLEF_DEVICE_GENERATION() 0
#endif

namespace clef {

// The last CUDA error as text, or nullptr (and the error cleared).
inline const char* launch_error() {
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// The device the calling thread runs on: its ordinal, or -1 when it cannot be read.
inline int current_ordinal() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return device;
}

// Above the 48 KB default a kernel must opt in to its dynamic shared memory (cudaFuncSetAttribute). The
// attribute belongs to the kernel on one device and holds for the process, so it is set once per
// (kernel, device), not on every call.
template <typename Kernel>
const char* opt_in(Kernel* kernel, int smem) {
  if (smem <= kDefaultSmemPerBlock) return nullptr;
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, std::pair<int, int>> opted;  // -> (generation, bytes)
  const std::pair<const void*, int> key{reinterpret_cast<const void*>(kernel), current_ordinal()};
  const int generation = CLEF_DEVICE_GENERATION();
  std::lock_guard<std::mutex> lock(mutex);
  auto found = opted.find(key);
  if (key.second >= 0 && found != opted.end() && found->second.first == generation && found->second.second >= smem)
    return nullptr;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  if (key.second >= 0) opted[key] = {generation, smem};
  return nullptr;
}

// Test-only: CLEF_SMEM_LIMIT=<bytes> caps the shared memory a block may have below the device's own, so a
// large GPU runs the tiles of a smaller card (65536: a T4's; 49152: Pascal's, no opt-in). Read on every
// call (a getenv), so a test can change it between calls; unset or unparsable: no cap.
inline int smem_limit_cap() {
  const char* text = std::getenv("CLEF_SMEM_LIMIT");
  if (text == nullptr || *text == 0) return 0;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  return end != nullptr && *end == 0 && value > 0 && value < (1L << 30) ? static_cast<int>(value) : 0;
}

// The device's compute capability, shared memory per block, SM count and per-SM limits (what decides how many
// blocks are resident at once: blocks_per_sm). Zeros, i.e. the kernels every device runs, the 48 KB default, no
// split and one block an SM, when the first four cannot be read; a per-SM limit that cannot be read is zero
// (an older driver may lack one), which the residency rules read as "one block an SM".
inline CudaDevice query_device(int device) {
  int major = 0, minor = 0, optin = 0, sms = 0;
  if (device < 0 || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();  // clear it: the kernels every device runs are the safe answer
    return CudaDevice{0, kDefaultSmemPerBlock, 0};
  }
  CudaDevice d{10 * major + minor, optin > kDefaultSmemPerBlock ? optin : kDefaultSmemPerBlock, sms};
  const std::pair<cudaDeviceAttr, int*> per_sm[] = {
      {cudaDevAttrMaxSharedMemoryPerMultiprocessor, &d.smem_per_sm},
      {cudaDevAttrReservedSharedMemoryPerBlock, &d.smem_reserved_per_block},
      {cudaDevAttrMaxThreadsPerMultiProcessor, &d.max_threads_per_sm},
      {cudaDevAttrMaxBlocksPerMultiprocessor, &d.max_blocks_per_sm},
      {cudaDevAttrMaxRegistersPerMultiprocessor, &d.registers_per_sm},
  };
  for (const auto& [attribute, value] : per_sm) {
    if (cudaDeviceGetAttribute(value, attribute, device) != cudaSuccess) {
      cudaGetLastError();
      *value = 0;
    }
  }
  return d;
}

// The current device's attributes, read once per device (and simulated device generation), then capped by
// CLEF_SMEM_LIMIT.
inline CudaDevice current_device() {
  constexpr int kMaxDevices = 64;
  static std::mutex mutex;
  static std::pair<int, CudaDevice> cached[kMaxDevices];  // (generation + 1, attributes); 0: not read
  const int ordinal = current_ordinal();
  CudaDevice device;
  if (ordinal < 0 || ordinal >= kMaxDevices) {
    device = query_device(ordinal);
  } else {
    const int generation = CLEF_DEVICE_GENERATION() + 1;
    std::lock_guard<std::mutex> lock(mutex);
    if (cached[ordinal].first != generation) cached[ordinal] = {generation, query_device(ordinal)};
    device = cached[ordinal].second;
  }
  const int cap = smem_limit_cap();
  if (cap > 0 && cap < device.smem_limit) device.smem_limit = cap;
  return device;
}

}  // namespace clef
