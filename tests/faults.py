"""Test-only fault injection. Nothing in clef_cuda or app imports this."""

from __future__ import annotations

import torch

from clef_cuda.kernels import ops


class KeyBandZeroedOps:
    """clef_cuda.kernels.ops with the seed's broken conv: the key-channel band of causal_conv1d_fwd comes back zero,
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
    """An op library (clef_cuda.kernels.ops by default) with one op replaced by `broken(original, *args, **kwargs)`:
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
    """clef_cuda.kernels.ops with paged_attention wrong only past `threshold` context tokens (its output scaled by
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


class LayerFaultOps:
    """clef_cuda.kernels.ops (or `base`) wrong in one layer only, the ways a kernel can go wrong and the shadow's layer
    fingerprints must see and name (benchmarks/shadow_power.py measures the smallest each catches). The trunk
    calls each op in the same order every step, so the k-th call of an op within a step is the k-th layer that
    calls it; a step starts at the first layer's input norm (add_rms_norm without a residual to add).

    kind and its size e:
      attention_scaled  the layer's attention output x (1 + e), when a call's longest context passes `past`
      kv_head_zeroed    the values of the layer's KV head 0 written as zeros (e unused)
      key_band_zeroed   the layer's conv key band returned as zeros (the seed's bug, in one layer; e unused)
      beta_off          the layer's delta-rule beta x (1 + e)
      int8_scale_off    one row's int8 scale x (1 + e) in the layer's MLP down projection (int8 releases; call
                        bind(trunk) once loaded)
      eps_x100          the layer's post-mixer RMSNorm eps x 100 (e unused)
    `layer` counts the layers of the op's own kind (the j-th attention layer, the j-th delta net, the j-th
    layer for MLP and norm faults)."""

    KINDS = ("attention_scaled", "kv_head_zeroed", "key_band_zeroed", "beta_off", "int8_scale_off", "eps_x100")

    def __init__(self, kind: str, e: float = 0.0, layer: int = 0, past: int = 0, key_dim: int = 0, base=ops) -> None:
        assert kind in self.KINDS, kind
        self.kind, self.e, self.layer, self.past, self._base = kind, e, layer, past, base
        self.key_dim = key_dim  # key_band_zeroed: the model's key_dim (the band is [key_dim, 2 key_dim))
        self._calls: dict[str, int] = {}
        self._row = 0
        self._target: int | None = None  # the int8 down projection's qweight, by address

    def bind(self, trunk) -> None:
        """int8_scale_off: aim at `layer`'s MLP down projection of this loaded trunk."""
        self._target = trunk.layers[self.layer].down.qweight.data_ptr()
        self._row = trunk.layers[self.layer].down.qweight.shape[0] // 3

    def _nth(self, op: str) -> int:
        n = self._calls.get(op, 0)
        self._calls[op] = n + 1
        return n

    def add_rms_norm(self, x, delta, scale, eps, **kwargs):
        if delta is None:  # the first layer's input norm: a new step
            self._calls.clear()
        n = self._nth("add_rms_norm")  # two a layer: the input norm (even), the post-mixer norm (odd)
        if self.kind == "eps_x100" and n == 2 * self.layer + 1:
            eps = eps * 100
        return self._base.add_rms_norm(x, delta, scale, eps, **kwargs)

    def paged_attention(self, query, key_cache, value_cache, cu_seqlens_q, context_lens, block_tables, **kwargs):
        out = self._base.paged_attention(
            query, key_cache, value_cache, cu_seqlens_q, context_lens, block_tables, **kwargs
        )
        if self._nth("paged_attention") == self.layer and self.kind == "attention_scaled":
            if int(context_lens.max()) > self.past:
                out.mul_(1 + self.e)
        return out

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping):
        if self._nth("reshape_and_cache") == self.layer and self.kind == "kv_head_zeroed":
            value = value.clone()
            value[:, 0] = 0
        return self._base.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def causal_conv1d_fwd(self, x, *args, **kwargs):
        out = self._base.causal_conv1d_fwd(x, *args, **kwargs)
        if self._nth("causal_conv1d_fwd") == self.layer and self.kind == "key_band_zeroed":
            out[:, self.key_dim : 2 * self.key_dim] = 0
        return out

    def gated_delta_rule_chunk(self, q, k, v, g, beta, *args, **kwargs):
        if self._nth("gated_delta_rule_chunk") == self.layer and self.kind == "beta_off":
            beta = beta * (1 + self.e)
        return self._base.gated_delta_rule_chunk(q, k, v, g, beta, *args, **kwargs)

    def _scaled(self, qweight, scale):
        if self.kind == "int8_scale_off" and qweight.data_ptr() == self._target:
            scale = scale.clone()
            scale[self._row] *= 1 + self.e
        return scale

    def dequantize_int8(self, qweight, scale, **kwargs):
        return self._base.dequantize_int8(qweight, self._scaled(qweight, scale), **kwargs)

    def int8_linear(self, x, qweight, scale, **kwargs):
        return self._base.int8_linear(x, qweight, self._scaled(qweight, scale), **kwargs)

    def __getattr__(self, name):
        return getattr(self._base, name)


class HeadReadFault:
    """The joint head `head` reading one question's or option's rows wrong on the served pass only: what the
    shadow's head-input check must catch (the layer fingerprints sketch a few positions, and never the head's
    reads). attach(engine) puts it in the engine's place of its base head; the shadow's steps
    (engine.shadow.step) run it clean, as a transient fault (a GPU corrupting a row) leaves the re-run clean.

    kind and its size e, in every record the engine serves:
      option_scaled     the first option's row as the head reads it, x (1 + e): its span's mean, and each of
                        its tokens' rows (their LayerNorm output: their memory rows too). (Scaling the trunk's
                        output rows themselves is no fault: the head's LayerNorm undoes it; scaling the last
                        layer's MLP output at one option token by 1.02 moved the head's input by 7e-5, 0.15 u
                        of f16, on the upstream tiny release.)
      question_shifted  the trunk's output rows the head reads over the first question's span are those one
                        position earlier (e unused)"""

    KINDS = ("option_scaled", "question_shifted")

    def __init__(self, kind: str, e: float = 0.0) -> None:
        assert kind in self.KINDS, kind
        self.kind, self.e = kind, e
        self.head = None
        self.clean = False  # set while the shadow runs
        self.hits = 0  # rows read wrong, in all
        self._previous: dict[int, torch.Tensor] = {}  # id(inputs) -> the last row of its previous chunk

    def attach(self, engine) -> HeadReadFault:
        self.head, engine.decider.head = engine.decider.head, self
        shadow_step = engine.shadow.step

        def clean_step(*args, **kwargs):
            self.clean = True
            try:
                return shadow_step(*args, **kwargs)
            finally:
                self.clean = False

        engine.shadow.step = clean_step
        return self

    def consume(self, inputs, layout, hidden) -> None:
        if self.clean:
            return self.head.consume(inputs, layout, hidden)
        start, n = inputs.filled, hidden.shape[0]
        if self.kind == "question_shifted":
            span = (layout.span_of_token == 0).nonzero().flatten().tolist()  # the first question's positions
            previous = self._previous.pop(id(inputs), None)
            shifted = hidden.clone()
            for position in span:
                if start <= position < start + n and (position > start or previous is not None):
                    shifted[position - start] = hidden[position - start - 1] if position > start else previous
                    self.hits += 1
            if start + n < inputs.memory.shape[0]:
                self._previous[id(inputs)] = hidden[-1].clone()
            return self.head.consume(inputs, layout, shifted)
        self.head.consume(inputs, layout, hidden)
        option = layout.num_questions  # the first option's span index
        span = (layout.span_of_token[start : start + n] == option).nonzero().flatten()
        if span.numel():
            normed = self.head.normed(hidden[span])
            inputs.span_sums[option] += self.e * normed.sum(0)
            inputs.memory[start + span] *= 1 + self.e
            if int(span[-1]) == n - 1:
                inputs.last = inputs.last * (1 + self.e)
            self.hits += span.numel()
        return None

    def __getattr__(self, name):
        return getattr(self.head, name)
