// What each GPU generation gives one block: the one table the launchers' tests, the simulator
// (tests/cuda_sim) and the compile check (scripts/check_archs.py) read, so a new card is added once.
//
// On a real GPU the launchers read the limit from the device (cudaDevAttrMaxSharedMemoryPerBlockOptin):
// this table is for the places that have no device to ask. Figures: CUDA C++ Programming Guide,
// "Compute Capabilities", shared memory per block with the opt-in (Pascal cannot opt in above the 48 KB
// every kernel gets without cudaFuncSetAttribute).
#pragma once

#include "common/hd.h"

namespace clef {

constexpr int kDefaultSmemPerBlock = 48 * 1024;

// What a launcher knows of the device it launches on (read once per device: csrc/common/device_launch.h).
struct CudaDevice {
  int cc = 0;               // compute capability, 70 = sm_70
  int smem_limit = 0;       // the most shared memory one block may have (with the opt-in where there is one)
  int multiprocessors = 0;  // SMs (cudaDevAttrMultiProcessorCount); 0 when unknown
};
// gridDim.y and gridDim.z on every arch (x goes to 2^31 - 1).
constexpr int kMaxGridYZ = 65535;

// Compute capability (70 = sm_70) -> the most shared memory one block may have with the opt-in; the
// 48 KB default for a capability not listed.
CLEF_HD constexpr int arch_max_smem_per_block(int compute_capability) {
  switch (compute_capability) {
    case 70: case 72: return 96 * 1024;                 // V100, Xavier
    case 75: return 64 * 1024;                          // T4, RTX 20x0
    case 80: case 87: return 163 * 1024;                // A100, Orin
    case 86: case 89: return 99 * 1024;                 // A10, RTX 30x0; L4, RTX 40x0
    case 90: return 227 * 1024;                         // H100, H200
    case 100: case 103: return 227 * 1024;              // B200, B300
    case 120: case 121: return 99 * 1024;               // RTX 50x0, RTX PRO Blackwell; DGX Spark
    default: return kDefaultSmemPerBlock;               // sm_60/61/62 (P100, P40), and any not listed
  }
}

#if !defined(__CUDACC_RTC__)  // host code only (NVRTC compiles device code)
// The archs the compile check builds for, oldest first, with the cards they stand for (check_archs.py
// reads this list through a host probe compiled against this header).
struct ArchEntry {
  int compute_capability;
  const char* cards;
};
constexpr ArchEntry kCheckedArchs[] = {
    {60, "P100"},          {61, "P40, GTX 10x0"},     {70, "V100"},       {75, "T4, RTX 20x0"},
    {80, "A100"},          {86, "A10, RTX 30x0"},     {89, "L4, RTX 40x0"}, {90, "H100, H200"},
    {100, "B200, B300"},   {120, "RTX 50x0, RTX PRO 6000 Blackwell"},
};
#endif

}  // namespace clef
