// What each GPU generation gives one block and one SM: the one table the launchers' tests, the simulator
// (tests/cuda_sim), the compile check (scripts/check_archs.py) and the occupancy table
// (benchmarks/delta_rule_occupancy.py) read, so a new card is added once.
//
// On a real GPU the launchers read these from the device (cudaDeviceGetAttribute: device_launch.cuh): this
// table is for the places that have no device to ask. Figures: CUDA C++ Programming Guide, "Compute
// Capabilities" (shared memory per block with the opt-in, per SM, reserved per block, resident threads and
// blocks per SM, registers per SM; Pascal cannot opt in above the 48 KB every kernel gets without
// cudaFuncSetAttribute), and each card's SM count from its vendor's specification.
#pragma once

#include "common/hd.h"

namespace clef {

constexpr int kDefaultSmemPerBlock = 48 * 1024;

// What a launcher knows of the device it launches on (read once per device: csrc/common/device_launch.cuh).
// The per-SM fields say how many blocks of a kernel are resident at once (clef::blocks_per_sm); zeros where
// they could not be read, which gdr's rules treat as one block an SM.
struct CudaDevice {
  int cc = 0;                        // compute capability, 70 = sm_70
  int smem_limit = 0;                // the most shared memory one block may have (with the opt-in where there is one)
  int multiprocessors = 0;           // SMs (cudaDevAttrMultiProcessorCount); 0 when unknown
  int smem_per_sm = 0;               // shared memory an SM shares among its resident blocks
  int smem_reserved_per_block = 0;   // what the driver keeps per resident block (1 KB from sm_80)
  int max_threads_per_sm = 0;        // resident threads an SM holds
  int max_blocks_per_sm = 0;         // resident blocks an SM holds
  int registers_per_sm = 0;          // 32-bit registers an SM shares among its resident blocks
};
// gridDim.y and gridDim.z on every arch (x goes to 2^31 - 1).
constexpr int kMaxGridYZ = 65535;
// Every kernel of ours declares __launch_bounds__(threads, 1): ptxas may give a thread up to 255 registers,
// allocated per warp in units of 256 (a thread counts as 256). So a block of T threads holds at most 256 T
// registers: what the residency rules assume, never the fewer a given compile may use.
constexpr int kMaxRegistersPerThread = 256;

struct ArchLimits {
  int smem_per_block;           // with the opt-in
  int smem_per_sm;
  int smem_reserved_per_block;
  int max_threads_per_sm;
  int max_blocks_per_sm;
  int registers_per_sm;
};

// Compute capability (70 = sm_70) -> its limits; Pascal's (48 KB a block, no opt-in) for one not listed.
CLEF_HD constexpr ArchLimits arch_limits(int compute_capability) {
  switch (compute_capability) {
    case 61: return ArchLimits{48 * 1024, 96 * 1024, 0, 2048, 32, 65536};                 // P40, GTX 10x0
    case 70: case 72: return ArchLimits{96 * 1024, 96 * 1024, 0, 2048, 32, 65536};        // V100, Xavier
    case 75: return ArchLimits{64 * 1024, 64 * 1024, 0, 1024, 16, 65536};                 // T4, RTX 20x0
    case 80: case 87: return ArchLimits{163 * 1024, 164 * 1024, 1024, 2048, 32, 65536};   // A100, Orin
    case 86: return ArchLimits{99 * 1024, 100 * 1024, 1024, 1536, 16, 65536};             // A10, RTX 30x0
    case 89: return ArchLimits{99 * 1024, 100 * 1024, 1024, 1536, 24, 65536};             // L4, RTX 40x0
    case 90: return ArchLimits{227 * 1024, 228 * 1024, 1024, 2048, 32, 65536};            // H100, H200
    case 100: case 103: return ArchLimits{227 * 1024, 228 * 1024, 1024, 2048, 32, 65536}; // B200, B300
    case 120: case 121: return ArchLimits{99 * 1024, 100 * 1024, 1024, 1536, 32, 65536};  // RTX 50x0, DGX Spark
    default: return ArchLimits{48 * 1024, 64 * 1024, 0, 2048, 32, 65536};                  // sm_60 (P100) and any other
  }
}

// The most shared memory one block may have with the opt-in (the 48 KB default for a capability not listed).
CLEF_HD constexpr int arch_max_smem_per_block(int compute_capability) {
  return arch_limits(compute_capability).smem_per_block;
}

// The device a card of this compute capability with `multiprocessors` SMs is (what the simulator answers).
CLEF_HD constexpr CudaDevice arch_device(int compute_capability, int multiprocessors) {
  const ArchLimits a = arch_limits(compute_capability);
  return CudaDevice{compute_capability, a.smem_per_block,     multiprocessors,    a.smem_per_sm,
                    a.smem_reserved_per_block, a.max_threads_per_sm, a.max_blocks_per_sm, a.registers_per_sm};
}

// Blocks of `threads` threads and `smem` bytes of dynamic shared memory an SM of `device` holds at once: the
// least of what its shared memory, threads, block slots and registers (at kMaxRegistersPerThread) allow; 0
// when the block does not fit; 1 when the device did not say (its per-SM fields are zero).
CLEF_HD int blocks_per_sm(const CudaDevice& device, int threads, int smem) {
  if (smem > device.smem_limit || threads <= 0) return 0;
  if (device.smem_per_sm <= 0 || device.max_threads_per_sm <= 0 || device.max_blocks_per_sm <= 0 ||
      device.registers_per_sm <= 0)
    return 1;
  int blocks = device.max_blocks_per_sm;
  const int by_smem = device.smem_per_sm / (smem + device.smem_reserved_per_block);
  const int by_threads = device.max_threads_per_sm / threads;
  const int by_registers = device.registers_per_sm / (threads * kMaxRegistersPerThread);
  blocks = by_smem < blocks ? by_smem : blocks;
  blocks = by_threads < blocks ? by_threads : blocks;
  return by_registers < blocks ? by_registers : blocks;
}

#if !defined(__CUDACC_RTC__)  // host code only (NVRTC compiles device code)
// The archs the compile check builds for, oldest first, with the cards they stand for and one card's SM count
// (the simulator's device per arch, the occupancy table's): check_archs.py and the tests read this list
// through a host probe compiled against this header.
struct ArchEntry {
  int compute_capability;
  const char* cards;
  const char* card;    // the card whose SMs `multiprocessors` counts
  int multiprocessors;
};
constexpr ArchEntry kCheckedArchs[] = {
    {60, "P100", "P100", 56},
    {61, "P40, GTX 10x0", "P40", 30},
    {70, "V100", "V100", 80},
    {75, "T4, RTX 20x0", "T4", 40},
    {80, "A100", "A100", 108},
    {86, "A10, RTX 30x0", "A10", 72},
    {89, "L4, RTX 40x0", "L4", 58},
    {90, "H100, H200", "H100", 132},
    {100, "B200, B300", "B200", 148},
    {120, "RTX 50x0, RTX PRO 6000 Blackwell", "RTX 5090", 170},
};
#endif

}  // namespace clef
