// CPU implementation of the causal conv1d: parallel over (sequence, block of channels), each block
// walking its tokens in order with the inner loop over contiguous channels (vectorised).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <vector>

#include "common/cpu_kernel.h"
#include "conv1d/conv1d_launch.h"

namespace clef {
namespace {

constexpr int kChannelBlock = 256;

template <typename T, int W, typename V>
CLEF_INLINE void conv1d_block(const Conv1dParams& p, int b, int c0, int c1) {
  const PackedSeq s = conv_sequence(p, b);
  const int n = c1 - c0;
  // Weights transposed to [W][n] so the channel loop reads them contiguously.
  float wt[W][kChannelBlock];
  float bias[kChannelBlock];
  for (int c = 0; c < n; ++c) {
    for (int j = 0; j < W; ++j) wt[j][c] = p.weight[static_cast<int64_t>(c0 + c) * W + j];
    bias[c] = p.bias != nullptr ? p.bias[c0 + c] : 0.0f;
  }
  const T* x = static_cast<const T*>(p.x);
  T* out = static_cast<T*>(p.out);

  // Tokens whose window reaches into the remembered history: the shared (GPU) input function.
  const int head = std::min(s.len, W - 1);
  for (int t = 0; t < head; ++t) {
    for (int c = 0; c < n; ++c) {
      float acc = bias[c];
      for (int j = 0; j < W; ++j) acc += wt[j][c] * conv_input<T>(p, s, t - (W - 1) + j, c0 + c);
      out[conv_out_offset(s.start + t, c0 + c, p.channels)] = from_f32<T>(p.silu ? silu_vec(acc) : acc);
    }
  }
  // Steady state: every tap is a row of x. Rows are a whole token apart (16 KB for clef-flash in f16),
  // a new page each, which the hardware prefetchers do not follow: fetch a few rows ahead.
  constexpr int kPrefetchRows = 4;
  const int row_bytes = n * static_cast<int>(sizeof(T));
  for (int t = head; t < s.len; ++t) {
    if (t + kPrefetchRows < s.len) {
      const char* ahead = reinterpret_cast<const char*>(x + conv_x_offset(s.start + t + kPrefetchRows, c0, p.x_token_stride));
      for (int off = 0; off < row_bytes; off += 64) __builtin_prefetch(ahead + off);
    }
    const T* rows[W];
    for (int j = 0; j < W; ++j) rows[j] = x + conv_x_offset(s.start + t - (W - 1) + j, c0, p.x_token_stride);
    T* o = out + conv_out_offset(s.start + t, c0, p.channels);
    int c = 0;
    for (; c + lanes_of<V> <= n; c += lanes_of<V>) {
      V acc = load_v<V>(bias + c);
      for (int j = 0; j < W; ++j) acc += load_v<V>(&wt[j][c]) * load_as<V>(rows[j] + c);
      store_from<V>(o + c, p.silu ? silu_any(acc) : acc);
    }
    for (; c < n; ++c) {
      float acc = bias[c];
      for (int j = 0; j < W; ++j) acc += wt[j][c] * to_f32(rows[j][c]);
      o[c] = from_f32<T>(p.silu ? silu_vec(acc) : acc);
    }
  }
  // This work item owns these channels of this slot, and has finished reading the old history above.
  if (s.slot >= 0) {
    T* states = static_cast<T*>(p.conv_states);
    float history[W - 1 > 0 ? W - 1 : 1];
    for (int c = c0; c < c1; ++c) {
      for (int j = 0; j < W - 1; ++j) history[j] = conv_new_history<T>(p, s, j, c);
      for (int j = 0; j < W - 1; ++j) states[conv_state_offset(s.slot, c, j, p.channels, W)] = from_f32<T>(history[j]);
    }
  }
}

template <typename T, typename V>
CLEF_INLINE void conv1d_block_any_width(const Conv1dParams& p, int b, int c0, int c1) {
  switch (p.width) {
    case 2: return conv1d_block<T, 2, V>(p, b, c0, c1);
    case 3: return conv1d_block<T, 3, V>(p, b, c0, c1);
    case 4: return conv1d_block<T, 4, V>(p, b, c0, c1);
    case 5: return conv1d_block<T, 5, V>(p, b, c0, c1);
    case 6: return conv1d_block<T, 6, V>(p, b, c0, c1);
    case 7: return conv1d_block<T, 7, V>(p, b, c0, c1);
    case 8: return conv1d_block<T, 8, V>(p, b, c0, c1);
  }
}

}  // namespace

// One entry per dtype and instruction set (the variants cannot be put on the templates above); the steady-state
// loop runs vf16s on AVX-512 and baseline, vf8s on AVX2 (one register: see vf8 in common/cpu_kernel.h).
#define CLEF_CONV1D_CPU_ENTRY(name, T)                                                                        \
  CLEF_CPU_VARIANTS_EACH(name, (const Conv1dParams& p, int b, int c0, int c1), (p, b, c0, c1),                 \
                         (conv1d_block_any_width<T, vf16>), (conv1d_block_any_width<T, vf8>),                  \
                         (conv1d_block_any_width<T, vf16>))
CLEF_CONV1D_CPU_ENTRY(conv1d_block_f32, float)
CLEF_CONV1D_CPU_ENTRY(conv1d_block_f16, c10::Half)
CLEF_CONV1D_CPU_ENTRY(conv1d_block_bf16, c10::BFloat16)

void conv1d_fwd_cpu(const Conv1dParams& p, ScalarKind kind) {
  const CpuIsa isa = cpu_isa();
  auto block_fn = kind == ScalarKind::F32   ? conv1d_block_f32_for(isa)
                  : kind == ScalarKind::F16 ? conv1d_block_f16_for(isa)
                                            : conv1d_block_bf16_for(isa);
  const int channel_blocks = (p.channels + kChannelBlock - 1) / kChannelBlock;
  const int64_t items = static_cast<int64_t>(p.batch) * channel_blocks;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int b = static_cast<int>(item / channel_blocks);
      const int c0 = static_cast<int>(item % channel_blocks) * kChannelBlock;
      block_fn(p, b, c0, std::min(c0 + kChannelBlock, p.channels));
    }
  });
}

}  // namespace clef
