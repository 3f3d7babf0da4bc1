// Torch-free entry points of the paged attention family (see conv1d_launch.h for the conventions).
#pragma once

#include "paged_attention/paged_attention.h"

namespace clef {

const char* reshape_and_cache_cuda(const CacheWriteParams& p, ScalarKind kind, void* stream);
void reshape_and_cache_cpu(const CacheWriteParams& p, ScalarKind kind);
const char* paged_attention_cuda(const PagedAttentionParams& p, ScalarKind kind, void* stream);
// The kernel paged_attention_cuda runs for these params on the current device (the rule applied at its
// compute capability), and why it cannot when the caller forced a kernel that does not fit (else null).
// For WmmaV2 also its split-context parts (paged_attention_wmma2_splits) and the workspace bytes they
// need, which the caller allocates and passes in the params (split_workspace) with `splits`.
struct AttentionChoice {
  AttentionKernel kernel;
  const char* error;
  int splits = 1;
  int64_t workspace_bytes = 0;
};
AttentionChoice paged_attention_cuda_choice(const PagedAttentionParams& p, ScalarKind kind);
void paged_attention_cpu(const PagedAttentionParams& p, ScalarKind kind);

constexpr bool paged_attention_cuda_supports_head_dim(int head_dim) {
  return head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}
// Query heads per KV head: 1 .. 16 (clef-flash 4, clef 27B 6; a group that does not divide a kernel's tile
// leaves rows dead: tile_row_token).
constexpr bool paged_attention_cuda_supports_group(int group) { return group >= 1 && group <= kMaxGroup; }

}  // namespace clef
