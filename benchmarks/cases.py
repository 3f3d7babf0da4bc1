"""Benchmark cases at clef-flash layer shapes, shared by the pytest-benchmark suite and kernel_table.py.

Each case builds its inputs once and exposes callables: ``ours`` (clef_cuda.kernels.ops), ``reference`` (the
upstream torch path on the same shapes: transformers' Qwen3.5 torch fallbacks, i.e. causal_conv1d_fn /
_update, torch_chunk / torch_recurrent_gated_delta_rule and eager_attention_forward) and ``peers``:
other implementations worth beating (torch's fused scaled_dot_product_attention for attention, FLA's
Triton kernels where importable on a GPU). ``flops`` / ``bytes`` are the work the rate is computed from.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from clef_cuda.kernels import ops

ROOT = Path(__file__).resolve().parents[1]

# clef-flash (Qwen3.5-9B) layer shapes.
CONV_CHANNELS = 8192  # 2048 q | 2048 k | 4096 v
CONV_WIDTH = 4
GDN_KEY_HEADS, GDN_VALUE_HEADS, GDN_HEAD_DIM = 16, 32, 128
ATTN_Q_HEADS, ATTN_KV_HEADS, ATTN_HEAD_DIM, BLOCK_SIZE = 16, 4, 256, 16


@dataclass
class Case:
    op: str
    shape: str
    ours: Callable[[], object]
    reference: Callable[[], object]
    reference_name: str
    flops: float = 0.0  # useful floating-point operations (compute-bound ops)
    bytes: float = 0.0  # minimal bytes moved (bandwidth-bound ops)
    peers: dict[str, Callable[[], object]] = field(default_factory=dict)


def _qwen35():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5


def fla_ops():
    """FLA's Triton kernels, if fla-core is importable and a GPU is present (the .ci/run oracle copy under
    .oracles/fla works too). Import transformers' Qwen3.5 module *before* this: with fla importable it
    would route its own fallbacks to FLA."""
    if not torch.cuda.is_available():
        return None
    if importlib.util.find_spec("fla") is None and (ROOT / ".oracles" / "fla").exists():
        sys.path.append(str(ROOT / ".oracles" / "fla"))
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:  # triton missing or incompatible: report no FLA column
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def _cu(lengths, device):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def conv_prefill(batch: int, tokens: int, dtype, device) -> Case:
    """Causal conv + SiLU over `batch` fresh sequences of tokens/batch tokens. Bytes: read x, write out."""
    qwen = _qwen35()
    length = tokens // batch
    x = torch.randn(batch * length, CONV_CHANNELS, dtype=dtype, device=device)
    weight = torch.randn(CONV_CHANNELS, CONV_WIDTH, device=device)
    states = torch.zeros(batch, CONV_CHANNELS, CONV_WIDTH - 1, dtype=dtype, device=device)
    cu = _cu([length] * batch, device)
    slots = torch.arange(batch, dtype=torch.int32, device=device)
    fresh = torch.zeros(batch, dtype=torch.bool, device=device)
    out = torch.empty_like(x)
    # transformers' layout: [B, C, L] as a transposed view of the in_proj output, weights in the model dtype.
    x_bcl = x.view(batch, length, CONV_CHANNELS).transpose(1, 2)
    w_model = weight.to(dtype)
    return Case(
        "causal_conv1d_fwd",
        f"B={batch} T={tokens} C={CONV_CHANNELS}",
        lambda: ops.causal_conv1d_fwd(x, weight, None, states, cu, slots, fresh, out=out),
        lambda: qwen.causal_conv1d_fn(x_bcl, w_model, None, activation="silu"),
        "transformers causal_conv1d_fn",
        bytes=2.0 * x.numel() * x.element_size(),
    )


def conv_decode(batch: int, dtype, device) -> Case:
    qwen = _qwen35()
    x = torch.randn(batch, CONV_CHANNELS, dtype=dtype, device=device)
    weight = torch.randn(CONV_CHANNELS, CONV_WIDTH, device=device)
    states = torch.randn(batch, CONV_CHANNELS, CONV_WIDTH - 1, dtype=dtype, device=device)
    slots = torch.arange(batch, dtype=torch.int32, device=device)
    out = torch.empty_like(x)
    window = torch.randn(batch, CONV_CHANNELS, CONV_WIDTH, dtype=dtype, device=device)
    w_model = weight.to(dtype)
    return Case(
        "causal_conv1d_update",
        f"B={batch} decode C={CONV_CHANNELS}",
        lambda: ops.causal_conv1d_update(x, weight, None, states, slots, out=out),
        lambda: qwen.causal_conv1d_update(x.unsqueeze(-1), window, w_model, None, activation="silu"),
        "transformers causal_conv1d_update",
        bytes=(2.0 + 2.0 * (CONV_WIDTH - 1)) * x.numel() * x.element_size(),
    )


def _gdr_inputs(n, dtype, device):
    hk, hv, d = GDN_KEY_HEADS, GDN_VALUE_HEADS, GDN_HEAD_DIM
    q = torch.randn(n, hk, d, dtype=dtype, device=device)
    k = torch.randn(n, hk, d, dtype=dtype, device=device)
    v = torch.randn(n, hv, d, dtype=dtype, device=device)
    g = -torch.rand(n, hv, device=device) * 2
    beta = torch.rand(n, hv, device=device)
    return q, k, v, g, beta


def gdr_prefill(batch: int, tokens: int, dtype, device) -> Case:
    """Delta rule over `batch` fresh sequences. FLOPs: 6 Dk Dv per token and value head (the recurrence's
    three matrix-vector products: S^T k, the rank-1 update, S^T q)."""
    qwen = _qwen35()
    length = tokens // batch
    n = batch * length
    q, k, v, g, beta = _gdr_inputs(n, dtype, device)
    states = torch.zeros(batch, GDN_VALUE_HEADS, GDN_HEAD_DIM, GDN_HEAD_DIM, device=device)
    cu = _cu([length] * batch, device)
    slots = torch.arange(batch, dtype=torch.int32, device=device)
    fresh = torch.zeros(batch, dtype=torch.bool, device=device)
    out = torch.empty_like(v)
    batched = [t.view(batch, length, *t.shape[1:]) for t in (q, k, v, g, beta)]

    def reference():
        return qwen.torch_chunk_gated_delta_rule(
            *batched[:3], g=batched[3], beta=batched[4], output_final_state=True, use_qk_l2norm_in_kernel=True
        )

    case = Case(
        "gated_delta_rule_chunk",
        f"B={batch} T={tokens} Hv={GDN_VALUE_HEADS} D={GDN_HEAD_DIM}",
        lambda: ops.gated_delta_rule_chunk(q, k, v, g, beta, states, cu, slots, fresh, out=out),
        reference,
        "transformers torch_chunk_gated_delta_rule",
        flops=6.0 * n * GDN_VALUE_HEADS * GDN_HEAD_DIM * GDN_HEAD_DIM,
    )
    fla = fla_ops()
    if fla is not None:
        chunk, _ = fla
        flat = [t.unsqueeze(0) for t in (q, k, v, g, beta)]
        case.peers["FLA"] = lambda: chunk(
            *flat[:3],
            g=flat[3],
            beta=flat[4],
            output_final_state=True,
            cu_seqlens=cu.long(),
            use_qk_l2norm_in_kernel=True,
        )
    return case


def gdr_decode(batch: int, dtype, device) -> Case:
    """One token per sequence. Bytes: the fp32 state read and written (2 Hv Dk Dv 4 B per sequence)."""
    qwen = _qwen35()
    q, k, v, g, beta = _gdr_inputs(batch, dtype, device)
    states = torch.randn(batch, GDN_VALUE_HEADS, GDN_HEAD_DIM, GDN_HEAD_DIM, device=device) * 0.1
    slots = torch.arange(batch, dtype=torch.int32, device=device)
    out = torch.empty_like(v)
    batched = [t.unsqueeze(1) for t in (q, k, v, g, beta)]
    initial = states.clone()

    def reference():
        return qwen.torch_recurrent_gated_delta_rule(
            *batched[:3],
            g=batched[3],
            beta=batched[4],
            initial_state=initial,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )

    case = Case(
        "gated_delta_rule_recurrent",
        f"B={batch} decode Hv={GDN_VALUE_HEADS} D={GDN_HEAD_DIM}",
        lambda: ops.gated_delta_rule_recurrent(q, k, v, g, beta, states, slots, out=out),
        reference,
        "transformers torch_recurrent_gated_delta_rule",
        bytes=2.0 * states.numel() * 4,
    )
    fla = fla_ops()
    if fla is not None:
        _, recurrent = fla
        case.peers["FLA"] = lambda: recurrent(
            *batched[:3],
            g=batched[3],
            beta=batched[4],
            initial_state=initial,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
    return case


def _paged_context(batch, ctx, dtype, device):
    blocks_per_seq = (ctx + BLOCK_SIZE - 1) // BLOCK_SIZE
    shape = (batch * blocks_per_seq, BLOCK_SIZE, ATTN_KV_HEADS, ATTN_HEAD_DIM)
    key_cache = torch.randn(shape, dtype=dtype, device=device)
    value_cache = torch.randn(shape, dtype=dtype, device=device)
    # Each sequence's blocks scattered over the pool, as an allocator leaves them.
    block_tables = torch.randperm(batch * blocks_per_seq, device=device).to(torch.int32).view(batch, blocks_per_seq)
    return key_cache, value_cache, block_tables


def _contiguous_kv(cache, block_tables, ctx):
    batch = block_tables.shape[0]
    rows = cache[block_tables.long()].view(batch, -1, ATTN_KV_HEADS, ATTN_HEAD_DIM)[:, :ctx]
    return rows.transpose(1, 2).contiguous()  # [B, Hkv, ctx, D]


def attention(batch: int, q_len: int, ctx: int, dtype, device) -> Case:
    """Queries of `batch` sequences over their paged contexts (q_len == ctx: fresh prefill; q_len = 1:
    decode; else a chunk after a cached prefix). FLOPs: 4 D Hq per (query, attended key) pair; bytes (for
    decode): each KV head's context read once."""
    key_cache, value_cache, block_tables = _paged_context(batch, ctx, dtype, device)
    query = torch.randn(batch * q_len, ATTN_Q_HEADS, ATTN_HEAD_DIM, dtype=dtype, device=device)
    cu = _cu([q_len] * batch, device)
    context_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    out = torch.empty_like(query)
    k = _contiguous_kv(key_cache, block_tables, ctx)
    v = _contiguous_kv(value_cache, block_tables, ctx)
    q = query.view(batch, q_len, ATTN_Q_HEADS, ATTN_HEAD_DIM).transpose(1, 2)
    allowed = torch.ones(q_len, ctx, dtype=torch.bool, device=device).tril(diagonal=ctx - q_len)
    additive = torch.zeros(q_len, ctx, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))[None, None]

    class _Attention:  # what eager_attention_forward reads from its module
        num_key_value_groups = ATTN_Q_HEADS // ATTN_KV_HEADS
        training = False

    qwen = _qwen35()
    reference = lambda: qwen.eager_attention_forward(  # noqa: E731
        _Attention(), q, k, v, additive, scaling=ATTN_HEAD_DIM**-0.5
    )
    if q_len == ctx:
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    else:
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)  # noqa: E731
    pairs = batch * sum(ctx - q_len + i + 1 for i in range(q_len))
    kind = "prefill" if q_len == ctx else ("decode" if q_len == 1 else f"chunk {q_len} after prefix")
    return Case(
        "paged_attention",
        f"B={batch} {kind} ctx={ctx} H={ATTN_Q_HEADS}/{ATTN_KV_HEADS} D={ATTN_HEAD_DIM}",
        lambda: ops.paged_attention(query, key_cache, value_cache, cu, context_lens, block_tables, out=out),
        reference,
        "transformers eager_attention_forward",
        flops=4.0 * ATTN_HEAD_DIM * ATTN_Q_HEADS * pairs,
        bytes=2.0 * batch * ctx * ATTN_KV_HEADS * ATTN_HEAD_DIM * key_cache.element_size(),
        # SDPA gets the context already contiguous (no page gather), as the upstream model holds it.
        peers={"SDPA": sdpa},
    )


def all_cases(tokens: list[int], batches: list[int], dtype, device) -> list[Case]:
    cases: list[Case] = []
    for batch in batches:
        for n in tokens:
            cases.append(conv_prefill(batch, n, dtype, device))
        cases.append(conv_decode(batch, dtype, device))
    for batch in batches:
        for n in tokens:
            cases.append(gdr_prefill(batch, n, dtype, device))
        cases.append(gdr_decode(batch, dtype, device))
    for batch in batches:
        for n in tokens:
            cases.append(attention(batch, n // batch, n // batch, dtype, device))
        longest = max(tokens) // batch
        cases.append(attention(batch, 64, longest, dtype, device))
        cases.append(attention(batch, 1, longest, dtype, device))
    return cases
