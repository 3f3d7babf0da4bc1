// Causal depthwise conv1d over packed variable-length sequences: parameters and the index/math
// functions shared by the CUDA kernels (conv1d_kernels.cuh) and the CPU implementation (conv1d_cpu.cpp).
//
// Layout (token-major, as the in_proj output is):
//   x            [num_tokens, channels]   channel stride 1, token stride x_token_stride
//   weight       [channels, width]        fp32
//   bias         [channels]               fp32 or null
//   conv_states  [num_slots, channels, width-1], dtype of x: the last width-1 *raw inputs* of a
//                sequence, oldest first, so a later chunk continues exactly where this one stopped.
//   out          [num_tokens, channels]   contiguous, dtype of x
// Sequence b owns tokens [cu_seqlens[b], cu_seqlens[b+1]). In "update" (decode) mode cu_seqlens is null
// and sequence b is the single token b.
// state_indices[b] < 0 means the sequence has no slot: it starts from zeros and nothing is saved.
#pragma once

#include "common/hd.h"

namespace clef {

struct Conv1dParams {
  const void* x = nullptr;
  int64_t x_token_stride = 0;
  const float* weight = nullptr;
  const float* bias = nullptr;
  void* conv_states = nullptr;
  void* out = nullptr;
  const int32_t* cu_seqlens = nullptr;      // [batch + 1]; null in update mode
  const int32_t* state_indices = nullptr;   // [batch]
  const bool* has_initial_state = nullptr;  // [batch]; null means "read the slot" (update mode)
  int64_t num_tokens = 0;
  int batch = 0;
  int channels = 0;
  int width = 0;
  int num_slots = 0;
  bool silu = true;
};

CLEF_HD PackedSeq conv_sequence(const Conv1dParams& p, int b) {
  return packed_sequence(p.cu_seqlens, p.num_tokens, p.state_indices, p.has_initial_state, p.num_slots, b);
}

// conv_states[slot, channel, j]; j = 0 is the oldest remembered input.
CLEF_HD int64_t conv_state_offset(int slot, int channel, int j, int channels, int width) {
  return (static_cast<int64_t>(slot) * channels + channel) * (width - 1) + j;
}

CLEF_HD int64_t conv_x_offset(int64_t token, int channel, int64_t token_stride) {
  return token * token_stride + channel;
}

CLEF_HD int64_t conv_out_offset(int64_t token, int channel, int channels) {
  return token * channels + channel;
}

// Raw input of channel c at position pos of the sequence (pos may be negative: the remembered history,
// pos = -1 being the newest remembered input). Zero where nothing is remembered.
template <typename T>
CLEF_HD float conv_input(const Conv1dParams& p, const PackedSeq& s, int pos, int c) {
  if (pos >= 0) return to_f32(static_cast<const T*>(p.x)[conv_x_offset(s.start + pos, c, p.x_token_stride)]);
  if (!s.read_state) return 0.0f;
  int j = pos + (p.width - 1);
  return to_f32(static_cast<const T*>(p.conv_states)[conv_state_offset(s.slot, c, j, p.channels, p.width)]);
}

// y = act(bias + sum_j w[c, j] * in[t - (width-1) + j]); window[j] holds in[t - (width-1) + j].
CLEF_HD float conv_output(const float* window, const Conv1dParams& p, int c) {
  float acc = p.bias != nullptr ? p.bias[c] : 0.0f;
  const float* w = p.weight + static_cast<int64_t>(c) * p.width;
  for (int j = 0; j < p.width; ++j) acc += w[j] * window[j];
  return p.silu ? silu_f32(acc) : acc;
}

// The new remembered history of channel c: inputs at positions len-(width-1) .. len-1 (older ones may
// come from the previous history when the sequence is shorter than width-1).
template <typename T>
CLEF_HD float conv_new_history(const Conv1dParams& p, const PackedSeq& s, int j, int c) {
  return conv_input<T>(p, s, s.len - (p.width - 1) + j, c);
}

constexpr int kConvMaxWidth = 8;

}  // namespace clef
