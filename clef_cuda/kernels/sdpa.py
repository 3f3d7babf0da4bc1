"""paged_attention computed by torch's scaled_dot_product_attention on each sequence's context gathered
from the paged cache: a candidate the start-up autotune (clef_cuda.tuning.autotune) times against our
kernels, per backend the build offers (flash, memory-efficient, cuDNN, math; on the CPU, flash and math).

Same contract as clef_cuda.kernels.ops.paged_attention (query i of a sequence with L new queries and context C
attends keys [0, C - L + i]; GQA). The per-sequence lengths are host values: the trunk passes the ones it
built the chunk from, so no device-to-host copy is needed on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

# Candidate name -> torch.nn.attention.SDPBackend member name.
SDPA_BACKENDS = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-math": "MATH",
}


def gather_context(cache: Tensor, block_table: Tensor, context_len: int) -> Tensor:
    """The first context_len cached rows of one sequence, [context_len, Hkv, D], by one index_select."""
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    blocks = -(-context_len // block_size)
    slots = block_table[:blocks].long()[:, None] * block_size + torch.arange(block_size, device=cache.device)
    return cache.view(num_blocks * block_size, *cache.shape[2:]).index_select(0, slots.flatten()[:context_len])


def _sdpa(q: Tensor, k: Tensor, v: Tensor, causal_offset: bool, scale: float, backend) -> Tensor:
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(q.shape[2], k.shape[2]) if causal_offset else None
    with sdpa_kernel(backend):
        try:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        except RuntimeError:  # a backend without native GQA: K/V repeated to the query heads
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def paged_attention_sdpa(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    q_lens: tuple[int, ...],
    context_lens: tuple[int, ...],
    *,
    backend: str = "sdpa-math",
    scale: float | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """query [N, Hq, D] packed as q_lens (host), caches [blocks, block_size, Hkv, D], block_tables [B, M]
    -> out [N, Hq, D]. RuntimeError when the backend cannot run these arguments."""
    from torch.nn.attention import SDPBackend

    sdp = getattr(SDPBackend, SDPA_BACKENDS[backend])
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    if out is None:
        out = torch.empty_like(query)
    start = 0
    for b, (q_len, context) in enumerate(zip(q_lens, context_lens, strict=True)):
        if q_len == 0:
            continue
        q = query[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
        k = gather_context(key_cache, block_tables[b], context).transpose(0, 1).unsqueeze(0)  # [1, Hkv, C, D]
        v = gather_context(value_cache, block_tables[b], context).transpose(0, 1).unsqueeze(0)
        # A single query attends its whole context: no mask (every backend takes that).
        result = _sdpa(q, k, v, q_len > 1, scale, sdp)
        out[start : start + q_len] = result[0].transpose(0, 1)
        start += q_len
    return out
