"""Pure-torch references of every op in ``clef_cuda.kernels.ops``: same names, same signatures, fp32 inside.

They are the arbiter the fast ops are tested against, and are themselves tested against the upstream
oracles (transformers' Qwen3.5 fallbacks, FLA's naive.py, torch's attention). Written for clarity, not
speed: loops over sequences are fine here. This module never imports the compiled extension.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

GDR_CHUNK = 64  # chunk length of the chunked (WY) delta-rule form


def _sequences(cu_seqlens: Tensor) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    return [(cu[b], cu[b + 1]) for b in range(len(cu) - 1)]


def _conv_weight(weight: Tensor) -> Tensor:
    return (weight.squeeze(1) if weight.dim() == 3 else weight).float()


# ---- causal conv1d ------------------------------------------------------------------------------
def causal_conv1d_fwd(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_states: Tensor,
    cu_seqlens: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor,
    *,
    silu: bool = True,
    out: Tensor | None = None,
) -> Tensor:
    """x [N, C], weight [C, K] (or [C, 1, K]), bias [C] | None, conv_states [S, C, K-1] (updated),
    cu_seqlens [B+1], state_indices [B] (< 0: no slot), has_initial_state [B] -> out [N, C].

    y[t, c] = act(bias[c] + sum_j weight[c, j] * in[t - (K-1) + j, c]) where in[] continues the slot's
    remembered inputs (zeros without one); afterwards the slot remembers the last K-1 inputs.
    """
    w = _conv_weight(weight)
    channels, width = w.shape
    if out is None:
        out = torch.empty_like(x)
    for b, (start, end) in enumerate(_sequences(cu_seqlens)):
        slot = int(state_indices[b])
        if slot >= 0 and bool(has_initial_state[b]):
            history = conv_states[slot].float()  # [C, K-1], oldest first
        else:
            history = x.new_zeros(channels, width - 1, dtype=torch.float32)
        inputs = torch.cat([history, x[start:end].float().t()], dim=1)  # [C, K-1+L]
        y = F.conv1d(inputs.unsqueeze(0), w.unsqueeze(1), None if bias is None else bias.float(), groups=channels)[0]
        if silu:
            y = F.silu(y)
        out[start:end] = y.t().to(out.dtype)
        if slot >= 0:
            conv_states[slot] = inputs[:, inputs.shape[1] - (width - 1) :].to(conv_states.dtype)
    return out


def causal_conv1d_update(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_states: Tensor,
    state_indices: Tensor,
    *,
    silu: bool = True,
    out: Tensor | None = None,
) -> Tensor:
    """x [B, C] (one token per sequence) -> out [B, C]; conv_states [S, C, K-1] updated (the slot is always read)."""
    batch = x.shape[0]
    cu_seqlens = torch.arange(batch + 1, dtype=torch.int32, device=x.device)
    has_initial = torch.ones(batch, dtype=torch.bool, device=x.device)
    return causal_conv1d_fwd(x, weight, bias, conv_states, cu_seqlens, state_indices, has_initial, silu=silu, out=out)


# ---- gated delta rule ---------------------------------------------------------------------------
def _l2norm(t: Tensor) -> Tensor:
    return t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6)


def _prepare_qk(q: Tensor, k: Tensor, num_v_heads: int, scale: float, use_qk_l2norm: bool) -> tuple[Tensor, Tensor]:
    """[L, Hk, D] -> [L, Hv, D] fp32, normalised and scaled; value head h reads key head h // (Hv/Hk)."""
    group = num_v_heads // q.shape[1]
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    return (q * scale).repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)


def _delta_rule_chunked(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """One sequence, all heads: q, k [L, H, Dk], v [L, H, Dv], g, beta [L, H], state [H, Dk, Dv] (fp32).

    Within a chunk with cumulative log decay G_t, the deltas U solve (I + A) U = beta (V - e^G K S0),
    A[t, s] = beta_t e^(G_t - G_s) k_t.k_s for s < t (unit lower-triangular: one triangular solve), and
    O = e^G Q S0 + (causal e^(G_t - G_s) Q K^T) U,  S = e^(G_last) S0 + sum_s e^(G_last - G_s) k_s u_s^T.
    """
    length = q.shape[0]
    outputs = []
    for c0 in range(0, length, GDR_CHUNK):
        qc, kc, vc = (t[c0 : c0 + GDR_CHUNK].transpose(0, 1) for t in (q, k, v))  # [H, C, D]
        gc, bc = g[c0 : c0 + GDR_CHUNK].t(), beta[c0 : c0 + GDR_CHUNK].t()  # [H, C]
        n = gc.shape[1]
        cum = gc.cumsum(-1)  # G_t
        diff = cum.unsqueeze(-1) - cum.unsqueeze(-2)  # G_t - G_s
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-1)
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay_strict = torch.where(lower, diff, torch.full_like(diff, float("-inf"))).exp()
        decay_causal = torch.where(causal, diff, torch.full_like(diff, float("-inf"))).exp()
        a = bc.unsqueeze(-1) * decay_strict * (kc @ kc.transpose(-1, -2))
        system = a + torch.eye(n, device=q.device)
        rhs = bc.unsqueeze(-1) * (vc - cum.exp().unsqueeze(-1) * (kc @ state))
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [H, C, Dv]
        o = cum.exp().unsqueeze(-1) * (qc @ state) + (decay_causal * (qc @ kc.transpose(-1, -2))) @ u
        last = cum[:, -1:]
        state = last.exp().unsqueeze(-1) * state + (kc * (last - cum).exp().unsqueeze(-1)).transpose(-1, -2) @ u
        outputs.append(o.transpose(0, 1))
    out = torch.cat(outputs) if outputs else v.new_zeros(v.shape)
    return out, state


def gated_delta_rule_chunk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    states: Tensor,
    cu_seqlens: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    out: Tensor | None = None,
    kernel: str = "auto",
) -> Tensor:
    """q, k [N, Hk, Dk], v [N, Hv, Dv], g [N, Hv], beta [N, Hv], states [S, Hv, Dk, Dv] fp32 (updated),
    cu_seqlens [B+1], state_indices [B], has_initial_state [B] -> out [N, Hv, Dv]. Chunked (WY) form.
    `kernel` (which CUDA kernel the fast op runs) is accepted and ignored: the reference has one."""
    num_v_heads, dk, dv = v.shape[1], q.shape[-1], v.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for b, (start, end) in enumerate(_sequences(cu_seqlens)):
        slot = int(state_indices[b])
        if slot >= 0 and bool(has_initial_state[b]):
            state = states[slot].float()
        else:
            state = torch.zeros(num_v_heads, dk, dv, device=v.device)
        qh, kh = _prepare_qk(q[start:end], k[start:end], num_v_heads, scale, use_qk_l2norm)
        o, state = _delta_rule_chunked(
            qh, kh, v[start:end].float(), g[start:end].float(), beta[start:end].float(), state
        )
        out[start:end] = o.to(out.dtype)
        if slot >= 0:
            states[slot] = state
    return out


def gated_delta_rule_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    states: Tensor,
    state_indices: Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    out: Tensor | None = None,
) -> Tensor:
    """One token per sequence: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv] -> out [B, Hv, Dv].

    The recurrence itself: S' = e^g S; u = beta (v - S'^T k); S = S' + k u^T; o = S^T q.
    """
    num_v_heads, dk = v.shape[1], q.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    qh, kh = _prepare_qk(q, k, num_v_heads, scale, use_qk_l2norm)  # [B, Hv, Dk]
    for b in range(q.shape[0]):
        slot = int(state_indices[b])
        state = states[slot].float() if slot >= 0 else torch.zeros(num_v_heads, dk, v.shape[-1], device=v.device)
        state = g[b].float().exp()[:, None, None] * state
        u = beta[b].float()[:, None] * (v[b].float() - torch.einsum("hkv,hk->hv", state, kh[b]))
        state = state + kh[b][:, :, None] * u[:, None, :]
        out[b] = torch.einsum("hkv,hk->hv", state, qh[b]).to(out.dtype)
        if slot >= 0:
            states[slot] = state
    return out


# ---- paged KV cache -----------------------------------------------------------------------------
def reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor) -> None:
    """key, value [N, Hkv, D] -> written at slot_mapping[t] (block * block_size + offset; < 0 skipped)."""
    slots = slot_mapping.long()
    keep = slots >= 0
    key_cache.view(-1, *key_cache.shape[2:])[slots[keep]] = key[keep]
    value_cache.view(-1, *value_cache.shape[2:])[slots[keep]] = value[keep]


def gather_context(cache: Tensor, block_table: Tensor, context_len: int) -> Tensor:
    """The first context_len cached rows of one sequence: [context_len, Hkv, D]."""
    block_size = cache.shape[1]
    positions = torch.arange(context_len, device=cache.device)
    blocks = block_table.long().to(cache.device)[positions // block_size]
    return cache[blocks, positions % block_size]


def paged_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    cu_seqlens_q: Tensor,
    context_lens: Tensor,
    block_tables: Tensor,
    *,
    scale: float | None = None,
    out: Tensor | None = None,
    kernel: str = "auto",
    max_query_len: int | None = None,
) -> Tensor:
    """query [N, Hq, D], caches [num_blocks, block_size, Hkv, D], cu_seqlens_q [B+1], context_lens [B],
    block_tables [B, max_blocks] -> out [N, Hq, D]. Query i of a sequence with L queries and context C
    attends keys [0, C - L + i]; query head h reads KV head h // (Hq/Hkv). `kernel` (which CUDA kernel
    the op runs) and `max_query_len` (how a GPU launch sizes its grid) are accepted for the op's
    signature; the reference has one implementation and needs neither. One KV head (and its query heads) at a
    time, so its memory stays what paged_attention_peak_bytes says (shadow runs plan on it)."""
    num_q_heads, num_kv_heads, head_dim = query.shape[1], key_cache.shape[2], query.shape[2]
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    if out is None:
        out = torch.empty_like(query)
    for b, (start, end) in enumerate(_sequences(cu_seqlens_q)):
        q_len, ctx = end - start, int(context_lens[b])
        if q_len == 0:
            continue
        positions = torch.arange(ctx, device=query.device)
        allowed = positions[None, :] <= (ctx - q_len + torch.arange(q_len, device=query.device))[:, None]
        for kv_head in range(num_kv_heads):
            heads = slice(kv_head * group, (kv_head + 1) * group)
            # [group x q_len, D]: the KV head's query heads, one after the other (plain 2-D matmuls: no copy of
            # the keys broadcast to each query head)
            queries = (query[start:end, heads].float() * scale).transpose(0, 1).reshape(group * q_len, head_dim)
            keys = gather_context(key_cache[:, :, kv_head], block_tables[b], ctx).float()  # [ctx, D]
            scores = (queries @ keys.t()).view(group, q_len, ctx)
            del keys
            probs = scores.masked_fill_(~allowed, float("-inf")).softmax(-1)
            del scores
            values = gather_context(value_cache[:, :, kv_head], block_tables[b], ctx).float()
            rows = probs.view(group * q_len, ctx) @ values  # [group x q_len, D]
            del probs, values  # before the next KV head's scores
            out[start:end, heads] = rows.view(group, q_len, head_dim).transpose(0, 1).to(out.dtype)
    return out


def paged_attention_peak_bytes(
    num_q_heads: int, num_kv_heads: int, head_dim: int, q_len: int, context: int, cache_dtype: torch.dtype
) -> int:
    """What paged_attention above holds at its peak for one sequence of q_len queries over `context` keys, beyond
    its inputs and output: one KV head at a time, its keys or values gathered from the pages (cache dtype) and in
    fp32, its query heads' fp32 scores and probabilities [Hq / Hkv, q_len, context] side by side, the causal mask,
    and its queries and output rows in fp32 (einsum's copies)."""
    group, element = num_q_heads // num_kv_heads, torch.empty((), dtype=cache_dtype).element_size()
    one_head_keys = context * head_dim * (element + 4)
    rows = 3 * q_len * group * head_dim * 4
    return one_head_keys + rows + context * q_len + 2 * group * q_len * context * 4


# ---- int8 weights ------------------------------------------------------------------------------
def dequantize_int8(
    qweight: Tensor, scale: Tensor, *, dtype: torch.dtype | None = None, out: Tensor | None = None
) -> Tensor:
    """qweight [R, C] int8, scale [R] fp32 -> out [R, C] in `dtype` (or out's; default fp32):
    qweight[r, c] * scale[r] computed in fp32, rounded once."""
    if out is None:
        out = torch.empty(qweight.shape, dtype=dtype or torch.float32, device=qweight.device)
    out.copy_(qweight.float() * scale.float()[:, None])
    return out


# ---- the trunk's glue ----------------------------------------------------------------------------
def _rms_normed(x: Tensor, scale: Tensor, eps: float) -> Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale.float()


def int8_linear(x: Tensor, qweight: Tensor, scale: Tensor, *, out: Tensor | None = None) -> Tensor:
    """x [rows, in], qweight [out, in] int8, scale [out] fp32 -> [rows, out] = (x @ qweight^T) * scale in
    fp32 (the int8 values exact), rounded once to x's dtype."""
    result = (x.float() @ qweight.float().t()) * scale.float()
    if out is None:
        return result.to(x.dtype)
    out.copy_(result)
    return out


def add_rms_norm(
    x: Tensor,
    delta: Tensor | None,
    scale: Tensor,
    eps: float,
    *,
    dtype: torch.dtype | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """x [R, C] fp32, updated in place: x += delta ([R, C] or None); -> out [R, C] = rmsnorm(x) * scale, in
    `dtype` (default: delta's, else x's)."""
    if delta is not None:
        x += delta.float()
    if out is None:
        out = torch.empty(x.shape, dtype=dtype or (delta.dtype if delta is not None else x.dtype), device=x.device)
    out.copy_(_rms_normed(x, scale, eps))
    return out


def silu_mul(gate_up: Tensor, *, out: Tensor | None = None) -> Tensor:
    """gate_up [R, 2 I] (gate | up) -> out [R, I] = silu(gate) * up."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    if out is None:
        out = torch.empty(gate.shape, dtype=gate_up.dtype, device=gate_up.device)
    out.copy_(F.silu(gate) * up)
    return out


def gated_rms_norm(core: Tensor, z: Tensor, weight: Tensor, eps: float, *, out: Tensor | None = None) -> Tensor:
    """core [N, H, D], z [N, H * D], weight [D] fp32 -> out [N, H * D] = rmsnorm(core per head) * weight *
    silu(z)."""
    n, heads, dim = core.shape
    gated = _rms_normed(core, weight, eps) * F.silu(z.float().reshape(n, heads, dim))
    if out is None:
        out = torch.empty(n, heads * dim, dtype=core.dtype, device=core.device)
    out.copy_(gated.reshape(n, heads * dim))
    return out


def rms_norm_rope(
    x: Tensor, scale: Tensor, cos: Tensor, sin: Tensor, eps: float, *, out: Tensor | None = None
) -> Tensor:
    """x [N, H, D], scale [D] fp32, cos/sin [N, rotary_dim / 2] -> out [N, H, D]: NeoX rotate-half of
    rmsnorm(x per head) * scale on the first rotary_dim dims, the rest passed through."""
    normed = _rms_normed(x, scale, eps)
    half = cos.shape[-1]
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]
    x1, x2, rest = normed[..., :half], normed[..., half : 2 * half], normed[..., 2 * half :]
    rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out.copy_(rotated)
    return out


def sigmoid_gate(attn: Tensor, gate: Tensor, *, out: Tensor | None = None) -> Tensor:
    """attn [N, H, D], gate [N, H, D] -> out [N, H * D] = attn * sigmoid(gate)."""
    n, heads, dim = attn.shape
    if out is None:
        out = torch.empty(n, heads * dim, dtype=attn.dtype, device=attn.device)
    out.copy_((attn.float() * torch.sigmoid(gate.float())).reshape(n, heads * dim))
    return out
