"""The Qwen3.5 hybrid trunk on packed chunks, built on the clef_cuda ops.

One call runs every layer over the new tokens of several sequences at once (a chunk each): the delta-net
layers through causal_conv1d_fwd + gated_delta_rule_chunk with per-sequence state slots, the attention
layers through reshape_and_cache + paged_attention with block tables. So a long record can be prefilled
chunk by chunk, interleaved with other records, with results identical to one pass.

Precision: the residual stream and every norm are fp32; matrix multiplies run in the serving dtype
(fp32 on the CPU; f16/bf16 on a GPU, accumulating in fp32); delta-rule states are fp32. Non-finite hidden
states (an f16 overflow) raise NumericalOverflowError instead of flowing into answers. With int8 weights
(clef_cuda.model.quantize) each linear layer dequantizes into one scratch buffer in the serving dtype
and runs the same GEMM; the embedding lookup dequantizes the rows it gathers.
"""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from clef_cuda.model.trunk_cache import TrunkCache

if TYPE_CHECKING:
    from clef_cuda.model.adapters import AdapterBatch
    from clef_cuda.model.fingerprint import LayerProbe
from clef_cuda.errors import NumericalOverflowError
from clef_cuda.model.config import LINEAR_ATTENTION, TrunkConfig
from clef_cuda.model.quantize import DequantizeScratch, Int8Weight
from clef_cuda.model.vocab_tables import HostTable, VocabShard

Tensor = torch.Tensor


class Collectives(Protocol):
    """The tensor-parallel group a sharded trunk sums over (clef_cuda.parallel.tensor_parallel implements it)."""

    def all_reduce(self, tensor: Tensor) -> Tensor: ...  # the sum over the ranks, in place; returns it


class Peers(Protocol):
    """Rank 0's handle on the other ranks: call(trunk, name, args, local) tells them to make the same call on their
    shard (the same collectives, in the same order), runs local() (rank 0's part) and returns its result once every
    rank has finished the call; a part that raised on any rank fails the call on rank 0 (lock-step)."""

    def call(self, trunk: Trunk, name: str, args: tuple, local: Callable): ...


@dataclass
class SequenceChunk:
    """Host-side description of one sequence's part of a chunk."""

    token_ids: list[int]
    start: int  # index of token_ids[0] in the sequence (its KV slot; not necessarily its RoPE position)
    state_slot: int  # delta-net state slot
    block_ids: list[int]  # KV blocks of the sequence, covering positions [0, start + len(token_ids))
    # [3, n] int64 RoPE positions (T, H, W) of the chunk's tokens; None: start + i on every axis (text)
    rope_positions: Tensor | None = None
    # (offset in the chunk, rows [k, hidden]): embeddings that replace the tokens' (image features)
    embedding_overrides: tuple[tuple[int, Tensor], ...] = ()


@dataclass
class ChunkBatch:
    """Device tensors for one trunk step over B sequences with N new tokens in total."""

    input_ids: Tensor  # [N] int64
    positions: Tensor  # [3, N] int64 RoPE positions (T, H, W; equal for text)
    cu_seqlens: Tensor  # [B+1] int32
    state_slots: Tensor  # [B] int32
    has_initial_state: Tensor  # [B] bool: the slot holds the state after `start` tokens
    slot_mapping: Tensor  # [N] int32: KV cache slot of each new token
    block_tables: Tensor  # [B, max_blocks] int32
    context_lens: Tensor  # [B] int32: keys each sequence attends after this chunk is written
    override_rows: Tensor | None = None  # [M] int64 rows of the chunk whose embedding is replaced
    override_values: Tensor | None = None  # [M, hidden]
    # Host copies of the pack's shape (no device-to-host copy needed): new tokens and context per sequence.
    q_lens: tuple[int, ...] = ()
    context_lengths: tuple[int, ...] = ()
    # The token ids on the host: what a vocabulary table in host memory gathers its rows by.
    host_input_ids: Tensor | None = None

    @classmethod
    def build(cls, chunks: list[SequenceChunk], block_size: int, device) -> ChunkBatch:
        ids, positions, slot_mapping, cu = [], [], [], [0]
        override_rows, override_values = [], []
        for c in chunks:
            n = len(c.token_ids)
            if len(c.block_ids) * block_size < c.start + n:
                raise ValueError(f"{len(c.block_ids)} blocks cannot hold {c.start + n} tokens")
            ids += c.token_ids
            span = range(c.start, c.start + n)
            if c.rope_positions is None:
                positions.append(torch.arange(c.start, c.start + n).expand(3, n))
            else:
                positions.append(c.rope_positions)
            slot_mapping += [c.block_ids[p // block_size] * block_size + p % block_size for p in span]
            for offset, rows in c.embedding_overrides:
                override_rows.append(torch.arange(cu[-1] + offset, cu[-1] + offset + rows.shape[0]))
                override_values.append(rows)
            cu.append(cu[-1] + n)
        max_blocks = max(1, max(len(c.block_ids) for c in chunks))
        tables = [c.block_ids + [0] * (max_blocks - len(c.block_ids)) for c in chunks]

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        host_ids = torch.tensor(ids, dtype=torch.int64)
        return cls(
            input_ids=host_ids.to(device, non_blocking=True),
            positions=torch.cat(positions, dim=1).to(device, torch.int64, non_blocking=True),
            cu_seqlens=tensor(cu, torch.int32),
            state_slots=tensor([c.state_slot for c in chunks], torch.int32),
            has_initial_state=tensor([c.start > 0 for c in chunks], torch.bool),
            slot_mapping=tensor(slot_mapping, torch.int32),
            block_tables=tensor(tables, torch.int32),
            context_lens=tensor([c.start + len(c.token_ids) for c in chunks], torch.int32),
            override_rows=torch.cat(override_rows).to(device, non_blocking=True) if override_rows else None,
            # Image features wait in (pinned) host memory on a GPU: each step copies its own rows over.
            override_values=torch.cat([v.to(device, non_blocking=True) for v in override_values])
            if override_values
            else None,
            q_lens=tuple(len(c.token_ids) for c in chunks),
            context_lengths=tuple(c.start + len(c.token_ids) for c in chunks),
            host_input_ids=host_ids,
        )


Weight = Tensor | Int8Weight  # a linear layer's [out, in] weight, in the serving dtype or int8
# The fused W8A16 kernel (ops.int8_linear) takes at most this many rows; below it, it reads 1 byte a weight where
# dequantize + GEMM moves 5, so it is the default there until the autotune measures otherwise.
INT8_FUSED_MAX_ROWS = 64
DEFAULT_INT8_BY_ROWS = ((INT8_FUSED_MAX_ROWS, "fused"), (sys.maxsize, "dequantize+gemm"))


@dataclass
class _DeltaNetWeights:
    in_proj: Weight  # [conv_dim + value_dim + 2 Hv, H]: q|k|v, z, b, a fused into one GEMM
    conv_weight: Tensor  # [conv_dim, K] fp32
    decay_rate: Tensor  # exp(A_log) [Hv] fp32
    dt_bias: Tensor  # [Hv] fp32
    norm_weight: Tensor  # [Dv] fp32 (stored as-is: not zero-centred)
    out_proj: Weight


@dataclass
class _AttentionWeights:
    qkv_proj: Weight  # [Hq 2D + 2 Hkv D, H]: query|gate per head, then k, then v
    q_scale: Tensor  # 1 + q_norm.weight, fp32
    k_scale: Tensor
    o_proj: Weight


@dataclass
class _LayerWeights:
    kind: str
    input_scale: Tensor  # 1 + input_layernorm.weight, fp32
    post_scale: Tensor
    mixer: _DeltaNetWeights | _AttentionWeights
    gate_up: Weight  # [2 I, H]
    down: Weight


def rms_norm(x: Tensor, scale: Tensor, eps: float) -> Tensor:
    """fp32 RMSNorm; `scale` is the effective gain (1 + w for Qwen's zero-centred weights)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale


def rope_axes(rotary_dim: int, mrope_section: tuple[int, int, int]) -> Tensor:
    """The position axis (0 T, 1 H, 2 W) each rotary frequency follows: Qwen3.5's interleaved M-RoPE,
    as transformers recomposes it (frequency j: H if j % 3 == 1 and j < 3 * section[1], W if j % 3 == 2
    and j < 3 * section[2], else T)."""
    axes = torch.zeros(rotary_dim // 2, dtype=torch.int64)
    for axis, offset in ((1, 1), (2, 2)):
        axes[offset : 3 * mrope_section[axis] : 3] = axis
    return axes


def rotate_half(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int) -> Tensor:
    """NeoX rotate-half RoPE on the first rotary_dim dims of each head's last axis (cos/sin broadcast to
    x's leading axes, rotary_dim / 2 wide); the rest of the head passes through. Also used by training/."""
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


class Trunk:
    """Qwen3.5 text trunk over packed chunks. `ops` is clef_cuda.kernels.ops (tests may pass another OpLibrary)."""

    def __init__(self, config: TrunkConfig, weights: dict[str, Tensor], dtype: torch.dtype, ops=None) -> None:
        if ops is None:
            from clef_cuda.kernels import ops
        self.config, self.dtype, self.ops = config, dtype, ops
        # [vocab, H]; int8 rows under --quantize int8; a HostTable under --vocab-tables host; this rank's rows
        # under tensor parallel (a VocabShard, read whole through vocab_rows); None in a kernel trial's two-layer
        # trunk (it runs layers, never a forward).
        self.embed: Weight | VocabShard | None = weights["embed_tokens.weight"]
        self.lm_head: Weight | VocabShard | None = weights["lm_head.weight"]
        for name in ("embed", "lm_head"):
            if isinstance(getattr(self, name), VocabShard):
                getattr(self, name).gather = functools.partial(self.vocab_rows, name)
        self.final_scale = 1.0 + weights["norm.weight"].float()
        device = self.final_scale.device
        half = config.rotary_dim // 2
        self.inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, half, dtype=torch.float32, device=device) * 2 / config.rotary_dim)
        )
        self.rope_axis = rope_axes(config.rotary_dim, config.mrope_section).to(device)  # [half]: T 0, H 1, W 2
        self.layers = [self._layer(weights, i, kind) for i, kind in enumerate(config.layer_types)]
        # Layer i's index among the layers of its kind: where its state slots or KV blocks sit in a TrunkCache.
        self.cache_index = [
            (config.linear_layers if kind == LINEAR_ATTENTION else config.attention_layers).index(i)
            for i, kind in enumerate(config.layer_types)
        ]
        quantized = [w for layer in self.layers for w in self._linear_weights(layer) if isinstance(w, Int8Weight)]
        self.scratch = DequantizeScratch(quantized, dtype, device) if quantized else None
        # Set by the start-up autotune (clef_cuda.tuning.autotune): batch -> the attention implementation
        # to run, (query, key_cache, value_cache, batch) -> out. None: self.ops.paged_attention.
        self.attention_choice: Callable[[ChunkBatch], Callable] | None = None
        # Set by the autotune on a GPU: batch -> the delta rule kernel gated_delta_rule_chunk runs ("serial",
        # "chunked"). None: "auto", the op's dispatch rule.
        self.delta_rule_choice: Callable[[ChunkBatch], str] | None = None
        # int8 weights: how a step of n rows runs each GEMM, the first (max rows, impl) with n <= max rows: "fused"
        # (ops.int8_linear: the int8 weights read once, no scratch), "dequantize+gemm", or "int8pack_mm" (torch's
        # CPU kernel). The autotune measures where each wins on the device.
        self.int8_by_rows: list[tuple[int, str]] = list(DEFAULT_INT8_BY_ROWS)
        # Tensor parallel (clef_cuda.model.shard; the ranks are run by clef_cuda.parallel.tensor_parallel): this
        # trunk is one rank's shard; `collectives` sums each mixer's and MLP's partial output over the ranks
        # (all_reduce), and the ranks' shares of each step's embedded rows; rank 0's `peers` tells the
        # other ranks what to run before it runs it. Both None on one device.
        self.collectives: Collectives | None = None
        self.peers: Peers | None = None
        self.ops_name = "fast"  # which of its op libraries a peer runs this trunk's calls on ("reference")

    @staticmethod
    def _linear_weights(layer: _LayerWeights) -> list[Weight]:
        m = layer.mixer
        mixer = [m.in_proj, m.out_proj] if isinstance(m, _DeltaNetWeights) else [m.qkv_proj, m.o_proj]
        return mixer + [layer.gate_up, layer.down]

    def int8_impl(self, rows: int) -> str:
        """How a step of `rows` rows multiplies by an int8 weight (int8_by_rows)."""
        for limit, impl in self.int8_by_rows:
            if rows <= limit:
                return impl
        return "dequantize+gemm"

    @property
    def device(self) -> torch.device:
        """The serving device (where the layers' weights live; the vocabulary tables may be on the host)."""
        return self.final_scale.device

    @property
    def quantized(self) -> bool:
        return self.scratch is not None

    def _layer(self, w: dict[str, Tensor], index: int, kind: str) -> _LayerWeights:
        p = f"layers.{index}."

        def fuse(*names: str) -> Weight:
            # Concatenate, then drop the parts: the fused copy replaces them (no second copy of the model).
            parts = [w.pop(p + n) for n in names]
            if any(isinstance(part, Int8Weight) for part in parts):
                return Int8Weight.cat(parts)
            return torch.cat(parts)

        if kind == LINEAR_ATTENTION:
            mixer = _DeltaNetWeights(
                in_proj=fuse(
                    "linear_attn.in_proj_qkv.weight",
                    "linear_attn.in_proj_z.weight",
                    "linear_attn.in_proj_b.weight",
                    "linear_attn.in_proj_a.weight",
                ),
                conv_weight=w[p + "linear_attn.conv1d.weight"].float().squeeze(1).contiguous(),
                decay_rate=w[p + "linear_attn.A_log"].float().exp(),
                dt_bias=w[p + "linear_attn.dt_bias"].float(),
                norm_weight=w[p + "linear_attn.norm.weight"].float(),
                out_proj=w[p + "linear_attn.out_proj.weight"],
            )
        else:
            mixer = _AttentionWeights(
                qkv_proj=fuse("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                q_scale=1.0 + w[p + "self_attn.q_norm.weight"].float(),
                k_scale=1.0 + w[p + "self_attn.k_norm.weight"].float(),
                o_proj=w[p + "self_attn.o_proj.weight"],
            )
        return _LayerWeights(
            kind=kind,
            input_scale=1.0 + w[p + "input_layernorm.weight"].float(),
            post_scale=1.0 + w[p + "post_attention_layernorm.weight"].float(),
            mixer=mixer,
            gate_up=fuse("mlp.gate_proj.weight", "mlp.up_proj.weight"),
            down=w[p + "mlp.down_proj.weight"],
        )

    # ---- forward --------------------------------------------------------------------------------
    def forward(
        self, batch: ChunkBatch, cache: TrunkCache, lora: AdapterBatch | None = None, probe: LayerProbe | None = None
    ) -> Tensor:
        """Final-normed hidden states [N, hidden] (fp32) of the chunk's tokens; caches updated in place.
        `lora`: the variants of the chunk's rows (clef_cuda.model.adapters); rows outside it are the base model's.
        `probe`: rows whose layer outputs are sketched and whose MLP rows are kept (clef_cuda.model.fingerprint:
        shadow verification)."""
        if self.peers is not None:
            return self.peers.call(
                self, "forward", (batch, cache, lora, probe), lambda: self._forward(batch, cache, lora, probe)
            )
        return self._forward(batch, cache, lora, probe)

    def _forward(
        self, batch: ChunkBatch, cache: TrunkCache, lora: AdapterBatch | None, probe: LayerProbe | None
    ) -> Tensor:
        eps = self.config.rms_norm_eps
        table = self.embed.local if isinstance(self.embed, VocabShard) else self.embed
        on_host = isinstance(table, HostTable) and batch.host_input_ids is not None
        ids = batch.host_input_ids if on_host else batch.input_ids
        x = self._embed(ids).float().contiguous()  # the residual stream: fp32 (a rank's share under TP)
        if batch.override_rows is not None:  # image features in place of their <|image_pad|> tokens
            # A tensor-parallel worker is not handed the features: rank 0's share is them, the others' zeros.
            x[batch.override_rows] = batch.override_values.float() if batch.override_values is not None else 0.0
        if self.collectives is not None:  # the ranks' shares of the vocabulary summed: every row whole
            self.collectives.all_reduce(x)
        rope = self._rope(batch.positions)
        # Each block's output (in the serving dtype) is added to the residual stream by the next norm, in
        # the same pass (ops.add_rms_norm): the stream is read and written once per norm, not per step.
        delta = None
        for index, layer in enumerate(self.layers):
            h = self.ops.add_rms_norm(x, delta, layer.input_scale, eps, dtype=self.dtype)
            if probe is not None:
                probe.record(index, "mixer_res", x)
                probe.record(index, "mixer_in", h)
            mixed = self._mix(layer, h, batch, cache, self.cache_index[index], rope, index, lora)
            if self.collectives is not None:
                mixed = self.collectives.all_reduce(mixed)
            if probe is not None:
                probe.record(index, "mixer", mixed)
            h = self.ops.add_rms_norm(x, mixed, layer.post_scale, eps)
            if probe is not None:
                probe.record(index, "mlp_res", x)
                probe.record(index, "mlp_in", h)
            delta = self.mlp(index, h, lora)
            if probe is not None:
                probe.record(index, "mlp", delta)
        if delta is not None:
            x += delta.float()
        out = rms_norm(x, self.final_scale, eps)  # fp32 out, for the head: the one norm left eager
        if not torch.isfinite(out).all():
            raise NumericalOverflowError(
                f"non-finite hidden states in a {self.dtype} forward pass (an overflow of the serving dtype); "
                "serve with --dtype bf16 or f32"
            )
        return out

    def mixer(self, layer_index: int, h: Tensor, batch: ChunkBatch, cache: TrunkCache, cache_index: int) -> Tensor:
        """Layer `layer_index`'s mixer alone (its delta net or gated attention, without the MLP) on inputs that
        are already input-normed, h [N, hidden] in the serving dtype -> [N, hidden] fp32. Reads and writes
        `cache` at `cache_index` (the layer's place among the layers of its kind in that cache). The
        self-check runs one real layer of each kind through this, once on the ops and once on the references."""
        return self._mix(
            self.layers[layer_index], h, batch, cache, cache_index, self._rope(batch.positions), layer_index
        ).float()

    def allocate_cache(self, num_slots: int, num_blocks: int, block_size: int, name: str = "engine") -> TrunkCache:
        """Zeroed state slots and KV blocks for this trunk (its shard's heads, on every rank: `name` is how the
        other ranks know the pool a later call means)."""

        def allocate() -> TrunkCache:
            cache = TrunkCache.allocate(self.config, num_slots, num_blocks, block_size, self.device, self.dtype)
            cache.name = name
            return cache

        if self.peers is not None:
            return self.peers.call(self, "allocate_cache", (num_slots, num_blocks, block_size, name), allocate)
        return allocate()

    def copy_slot(self, cache: TrunkCache, destination: int, source: int) -> None:
        """State slot `source`'s delta-net state into slot `destination` (a prefix snapshot taken or restored),
        on every rank."""

        def copy() -> None:
            cache.conv_states[:, destination].copy_(cache.conv_states[:, source])
            cache.gdr_states[:, destination].copy_(cache.gdr_states[:, source])

        if self.peers is not None:
            return self.peers.call(self, "copy_slot", (cache, destination, source), copy)
        return copy()

    def with_ops(self, ops) -> Trunk:
        """The same trunk (shared weights, no copy) running on another op library, e.g. clef_cuda.kernels.reference,
        for every op (the autotune's choices are this trunk's, not the twin's)."""
        twin = copy.copy(self)
        twin.ops, twin.attention_choice = ops, None
        # The other ranks run the reference ops for a reference twin, else their own fast ops.
        twin.ops_name = "reference" if getattr(ops, "__name__", "") == "clef_cuda.kernels.reference" else self.ops_name
        twin.int8_by_rows = [(sys.maxsize, "dequantize+gemm")]
        return twin

    def _mix(
        self,
        layer: _LayerWeights,
        h: Tensor,
        batch: ChunkBatch,
        cache: TrunkCache,
        i: int,
        rope: tuple[Tensor, Tensor],
        index: int,
        lora: AdapterBatch | None = None,
    ) -> Tensor:
        if layer.kind == LINEAR_ATTENTION:
            return self._delta_net(layer.mixer, h, batch, cache, i, index, lora)
        return self._attention(layer.mixer, h, batch, cache, i, *rope, index, lora)

    def _embed(self, token_ids: Tensor) -> Tensor:
        if isinstance(self.embed, VocabShard):
            return self.embed.partial_rows(token_ids, self.ops)
        if isinstance(self.embed, Int8Weight | HostTable):
            return self.embed.rows(token_ids, self.ops)
        return self.embed[token_ids]

    def vocab_rows(self, table: str, ids: Tensor) -> Tensor:
        """Whole rows `ids` (int64 [n]) of a vocabulary table split over the tensor-parallel ranks ("embed" or
        "lm_head": VocabShard.gather, e.g. the joint head's option rows): every rank adds its share (rank 0's
        peers tell the others to), [n, hidden] in the serving dtype."""

        def local() -> Tensor:
            rows = getattr(self, table).partial_rows(ids, self.ops).to(self.dtype)
            return self.collectives.all_reduce(rows) if self.collectives is not None else rows

        if self.peers is not None:
            return self.peers.call(self, "vocab_rows", (table, ids), local)
        return local()

    def norm(self, index: int, part: str, x: Tensor, dtype: torch.dtype) -> Tensor:
        """Layer `index`'s input norm (part "mixer_in") or post-mixer norm ("mlp_in") of the residual rows x
        [N, hidden] fp32 (not changed), in `dtype` (shadow verification replays it from the served pass's rows)."""
        scale = self.layers[index].input_scale if part == "mixer_in" else self.layers[index].post_scale
        return self.ops.add_rms_norm(x.float().clone(), None, scale, self.config.rms_norm_eps, dtype=dtype)

    def mlp(self, index: int, h: Tensor, lora: AdapterBatch | None = None, *, replay: bool = False) -> Tensor:
        """Layer `index`'s MLP on its normed input h [N, hidden] (position-wise: shadow verification replays it,
        replay=True, from the served pass's rows). Summed over the tensor-parallel ranks."""
        if replay and self.peers is not None:
            return self.peers.call(self, "mlp", (index, h), lambda: self._mlp(index, h, lora))
        return self._mlp(index, h, lora)

    def _mlp(self, index: int, h: Tensor, lora: AdapterBatch | None) -> Tensor:
        layer = self.layers[index]
        act = self.ops.silu_mul(self._linear(h, layer.gate_up, lora, index, "gate_up"))
        out = self._linear(act, layer.down, lora, index, "down")
        return self.collectives.all_reduce(out) if self.collectives is not None else out

    def _linear(self, x: Tensor, weight: Weight, lora: AdapterBatch | None, index: int, fused: str) -> Tensor:
        """A fused GEMM (an int8 weight dequantized first, by this trunk's ops), plus the variants' LoRA
        deltas on their rows' columns of it."""
        impl = self.int8_impl(x.shape[0]) if isinstance(weight, Int8Weight) else None
        if impl == "fused" and x.shape[0] <= INT8_FUSED_MAX_ROWS:
            y = self.ops.int8_linear(x, weight.qweight, weight.scale)
            if weight.dense_tail is not None:  # the fused in_proj's b and a rows, kept in the serving dtype
                y = torch.cat([y, F.linear(x, weight.dense_tail)], dim=1)
        elif impl == "int8pack_mm" and weight.dense_tail is None:
            y = torch._weight_int8pack_mm(x, weight.qweight, weight.scale)
        elif impl is not None:
            with self.scratch.lock:
                y = F.linear(x, self.scratch.weight(weight, self.ops))
        else:
            y = F.linear(x, weight)
        if lora is not None:
            lora.apply(y, x, index, fused)
        return y

    def _delta_net(
        self,
        w: _DeltaNetWeights,
        h: Tensor,
        batch: ChunkBatch,
        cache: TrunkCache,
        i: int,
        index: int,
        lora: AdapterBatch | None,
    ) -> Tensor:
        c = self.config
        n, hv, dv = h.shape[0], c.linear_num_value_heads, c.linear_value_head_dim
        proj = self._linear(h, w.in_proj, lora, index, "in_proj")
        mixed = proj[:, : c.conv_dim]  # a strided view: the conv reads it in place
        z = proj[:, c.conv_dim : c.conv_dim + c.value_dim]
        b = proj[:, c.conv_dim + c.value_dim : c.conv_dim + c.value_dim + hv]
        a = proj[:, c.conv_dim + c.value_dim + hv :]
        conv = self.ops.causal_conv1d_fwd(
            mixed,
            w.conv_weight,
            None,
            cache.conv_states[i],
            batch.cu_seqlens,
            batch.state_slots,
            batch.has_initial_state,
        )
        # The key band is channels [key_dim, 2 key_dim): the one the seed's conv lost.
        q = conv[:, : c.key_dim].view(n, c.linear_num_key_heads, c.linear_key_head_dim)
        k = conv[:, c.key_dim : 2 * c.key_dim].view(n, c.linear_num_key_heads, c.linear_key_head_dim)
        v = conv[:, 2 * c.key_dim :].view(n, hv, dv)
        beta = torch.sigmoid(b.float())
        g = -w.decay_rate * F.softplus(a.float() + w.dt_bias)
        kernel = self.delta_rule_choice(batch) if self.delta_rule_choice is not None else "auto"
        core = self.ops.gated_delta_rule_chunk(
            q,
            k,
            v,
            g,
            beta,
            cache.gdr_states[i],
            batch.cu_seqlens,
            batch.state_slots,
            batch.has_initial_state,
            kernel=kernel,
        )
        gated = self.ops.gated_rms_norm(core.view(n, hv, dv), z, w.norm_weight, c.rms_norm_eps)  # [N, Hv Dv]
        return self._linear(gated, w.out_proj, lora, index, "out_proj")

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [3, N] -> cos, sin [N, rotary/2] fp32: frequency j turns with the position on its axis."""
        freqs = positions[self.rope_axis].t().float() * self.inv_freq[None, :]
        return freqs.cos().contiguous(), freqs.sin().contiguous()

    def _attention(
        self,
        w: _AttentionWeights,
        h: Tensor,
        batch: ChunkBatch,
        cache: TrunkCache,
        i: int,
        cos: Tensor,
        sin: Tensor,
        index: int,
        lora: AdapterBatch | None,
    ) -> Tensor:
        c = self.config
        n, hq, hkv, d = h.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qkv = self._linear(h, w.qkv_proj, lora, index, "qkv_proj")
        query_gate = qkv[:, : hq * 2 * d].view(n, hq, 2 * d)
        k = qkv[:, hq * 2 * d : hq * 2 * d + hkv * d].view(n, hkv, d)
        v = qkv[:, hq * 2 * d + hkv * d :].view(n, hkv, d)
        # q/k norm + RoPE in one pass each, read in place from the fused GEMM's output (strided views).
        q = self.ops.rms_norm_rope(query_gate[..., :d], w.q_scale, cos, sin, c.rms_norm_eps)
        k = self.ops.rms_norm_rope(k, w.k_scale, cos, sin, c.rms_norm_eps)
        key_cache, value_cache = cache.key_cache[i], cache.value_cache[i]
        self.ops.reshape_and_cache(k, v, key_cache, value_cache, batch.slot_mapping)
        if self.attention_choice is not None:
            attn = self.attention_choice(batch)(q, key_cache, value_cache, batch)
        else:
            attn = self.ops.paged_attention(
                q,
                key_cache,
                value_cache,
                batch.cu_seqlens,
                batch.context_lens,
                batch.block_tables,
                max_query_len=max(batch.q_lens, default=0) or None,
            )
        gated = self.ops.sigmoid_gate(attn, query_gate[..., d:])  # [N, Hq D]
        return self._linear(gated, w.o_proj, lora, index, "o_proj")
