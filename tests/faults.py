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
