// CUDA kernels for the causal conv1d (device code only: compiled by nvcc through conv1d_launch.cu,
// by NVRTC for the sm_70 check, and by g++ under the test-only CUDA simulator).
//
// One thread owns one channel of one tile of tokens of one sequence, so a warp reads 32 neighbouring
// channels of a token row (coalesced) and no channel band is special: q, k and v channels take exactly
// the same path. The remembered history is written by a second kernel after every tile has read it.
#pragma once

#include "common/cuda_utils.cuh"
#include "conv1d/conv1d.h"

namespace clef {

constexpr int kConvThreads = 128;
constexpr int kConvTileTokens = 64;

template <typename T, int W>
__global__ void __launch_bounds__(kConvThreads) conv1d_fwd_kernel(Conv1dParams p) {
  const int c = blockIdx.x * kConvThreads + threadIdx.x;
  const int b = blockIdx.z;
  const PackedSeq s = conv_sequence(p, b);
  const int t0 = blockIdx.y * kConvTileTokens;
  if (c >= p.channels || t0 >= s.len) return;  // no block-wide sync below, early exit is safe

  float window[W];
  for (int j = 0; j < W - 1; ++j) window[j] = conv_input<T>(p, s, t0 - (W - 1) + j, c);
  const int t_end = min_int(t0 + kConvTileTokens, s.len);
  T* out = static_cast<T*>(p.out);
  for (int t = t0; t < t_end; ++t) {
    window[W - 1] = conv_input<T>(p, s, t, c);
    const float y = conv_output(window, p, c);
    // (The fault: a band of channels, which the test names, zeroed: the seed's V100 build zeroed the key band.)
    out[conv_out_offset(s.start + t, c, p.channels)] =
        from_f32<T>(CLEF_FAULT(conv_channel_band_zeroed, y, CLEF_FAULT_BAND_CONTAINS(c) ? 0.0f : y));
#pragma unroll
    for (int j = 0; j < W - 1; ++j) window[j] = window[j + 1];
  }
}

// Runs after conv1d_fwd_kernel on the same stream: every tile has read the old history by then.
template <typename T, int W>
__global__ void __launch_bounds__(kConvThreads) conv1d_save_state_kernel(Conv1dParams p) {
  const int c = blockIdx.x * kConvThreads + threadIdx.x;
  const int b = blockIdx.y;
  const PackedSeq s = conv_sequence(p, b);
  if (c >= p.channels || s.slot < 0) return;
  float history[W - 1];
  // Read everything first: the new history may be built from the old one (sequences shorter than W-1).
  for (int j = 0; j < W - 1; ++j) history[j] = conv_new_history<T>(p, s, j, c);
  T* states = static_cast<T*>(p.conv_states);
  for (int j = 0; j < W - 1; ++j) states[conv_state_offset(s.slot, c, j, p.channels, p.width)] = from_f32<T>(history[j]);
}

}  // namespace clef
