"""Test-only fault injection. Nothing in clef_cuda or app imports this."""

from __future__ import annotations

from clef_cuda import ops


class KeyBandZeroedOps:
    """clef_cuda.ops with the seed's broken conv: the key-channel band of causal_conv1d_fwd comes back zero,
    so every Gated DeltaNet layer's state never moves and the layer returns 0 (the candle-vllm bug)."""

    def __init__(self, key_dim: int) -> None:
        self.key_dim = key_dim

    def causal_conv1d_fwd(self, *args, **kwargs):
        out = ops.causal_conv1d_fwd(*args, **kwargs)
        out[:, self.key_dim : 2 * self.key_dim] = 0
        return out

    def __getattr__(self, name):
        return getattr(ops, name)


class OpFault:
    """An op library (clef_cuda.ops by default) with one op replaced by `broken(original, *args, **kwargs)`:
    the injected faults the self-check's tests must catch."""

    def __init__(self, name: str, broken, base=ops) -> None:
        self._name, self._broken, self._base = name, broken, base

    def __getattr__(self, attr):
        original = getattr(self._base, attr)
        if attr != self._name:
            return original
        return lambda *args, **kwargs: self._broken(original, *args, **kwargs)


def with_fault(library, name: str, broken):
    """`library` (an op library) with op `name` broken."""
    return OpFault(name, broken, library)


class LongContextFaultOps:
    """clef_cuda.ops with paged_attention wrong only past `threshold` context tokens (its output scaled by
    1.5 for every sequence of a call whose longest context is longer): a fault the start-up self-check,
    whose contexts are short, cannot see, and shadow verification must."""

    def __init__(self, threshold: int = 3000) -> None:
        self.threshold = threshold

    def paged_attention(self, query, key_cache, value_cache, cu_seqlens_q, context_lens, block_tables, **kwargs):
        out = ops.paged_attention(query, key_cache, value_cache, cu_seqlens_q, context_lens, block_tables, **kwargs)
        if int(context_lens.max()) > self.threshold:
            out.mul_(1.5)
        return out

    def __getattr__(self, name):
        return getattr(ops, name)
