"""int8 weights (W8A16): every trunk linear layer and the embedding tables stored as int8 with one fp32
scale per output row (symmetric absmax / 127, no calibration), activations in the serving dtype.

Prefill is compute-bound, so a linear layer dequantizes its whole weight into a scratch buffer in the
serving dtype (clef_cuda.kernels.ops.dequantize_int8) and runs the ordinary GEMM: once per trunk step, shared by
every record packed into it. An embedding table dequantizes only the rows a lookup gathers. What stays
in the serving dtype: norms, conv taps, decay rates, the delta net's small in_proj_b / in_proj_a rows
(Hv x hidden: nothing to save; carried as `dense_tail` of the fused in_proj), the vision tower and the
joint head. shared/specs/memory.md has the recipe and the figures.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

Tensor = torch.Tensor
INT8_MAX = 127
# Elements quantized at a time while a release streams in (4 MiB of fp32 per temporary), whatever the
# tensor's size: 256 rows at clef-flash's hidden size.
QUANTIZE_BLOCK_ELEMENTS = 2**20
# What quantizing adds on the device at its peak: a block of the stored weight (at most 4 bytes an element) and
# its two fp32 temporaries. The memory plan counts it in the load's peak.
QUANTIZE_TRANSIENT_BYTES = 3 * 4 * QUANTIZE_BLOCK_ELEMENTS

# Trunk tensors stored as int8 (names relative to the text model). in_proj_b / in_proj_a are not.
QUANTIZED_SUFFIXES = (
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "linear_attn.in_proj_qkv.weight",
    "linear_attn.in_proj_z.weight",
    "linear_attn.out_proj.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
)
QUANTIZED_TABLES = ("embed_tokens.weight", "lm_head.weight")


def is_quantized_name(name: str) -> bool:
    """Whether trunk tensor `name` is stored as int8 under --quantize int8."""
    return name in QUANTIZED_TABLES or name.endswith(QUANTIZED_SUFFIXES)


@dataclass
class Int8Weight:
    """A [rows, cols] weight as int8 `qweight` with fp32 `scale` per row, dequantizing to `dtype`, plus
    optionally `dense_tail` rows kept in `dtype` after them (the fused in_proj's b and a rows).

    Duck-types the few tensor uses the model makes of a weight: `shape`, `device`, `dtype`, and
    `table[ids]` (rows, dequantized: an embedding lookup or the head's LM-head rows)."""

    qweight: Tensor  # [rows, cols] int8
    scale: Tensor  # [rows] fp32
    dtype: torch.dtype  # what it dequantizes to (the serving dtype)
    dense_tail: Tensor | None = None  # [tail_rows, cols] in dtype

    @property
    def quantized_rows(self) -> int:
        return self.qweight.shape[0]

    @property
    def shape(self) -> torch.Size:
        tail = 0 if self.dense_tail is None else self.dense_tail.shape[0]
        return torch.Size((self.quantized_rows + tail, self.qweight.shape[1]))

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def nbytes(self) -> int:
        tail = 0 if self.dense_tail is None else self.dense_tail.numel() * self.dense_tail.element_size()
        return self.qweight.numel() + self.scale.numel() * 4 + tail

    def dequantize(self, ops, out: Tensor | None = None) -> Tensor:
        """The whole weight [rows, cols] in `dtype`, into `out` when given (a reused scratch buffer)."""
        if out is None:
            out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        ops.dequantize_int8(self.qweight, self.scale, out=out[: self.quantized_rows])
        if self.dense_tail is not None:
            out[self.quantized_rows :].copy_(self.dense_tail)
        return out

    def rows(self, rows: Tensor, ops) -> Tensor:
        """Rows `rows` (int64 [n]) dequantized by `ops`: [n, cols] in `dtype`. Tables only (no dense tail)."""
        if self.dense_tail is not None:
            raise TypeError("row lookups are for quantized tables (embeddings), not fused projections")
        rows = rows.to(self.device)
        q, s = self.qweight.index_select(0, rows), self.scale.index_select(0, rows)
        return ops.dequantize_int8(q, s, dtype=self.dtype)

    def __getitem__(self, rows: Tensor) -> Tensor:
        """table[rows], as a tensor table is indexed (the joint head's LM-head rows)."""
        from clef_cuda.kernels import ops

        return self.rows(rows, ops)

    @staticmethod
    def cat(parts: list[Int8Weight | Tensor]) -> Int8Weight:
        """Fuse quantized parts, then dense ones (rows in that order), into one weight."""
        quantized = [p for p in parts if isinstance(p, Int8Weight)]
        dense = [p for p in parts if not isinstance(p, Int8Weight)]
        kinds = [isinstance(p, Int8Weight) for p in parts]
        if kinds != sorted(kinds, reverse=True) or not quantized or any(q.dense_tail is not None for q in quantized):
            raise ValueError("a fused int8 weight is its quantized parts followed by its dense ones")
        return Int8Weight(
            torch.cat([q.qweight for q in quantized]),
            torch.cat([q.scale for q in quantized]),
            quantized[0].dtype,
            torch.cat(dense).to(quantized[0].dtype) if dense else None,
        )


def quantize_int8(weight: Tensor, dtype: torch.dtype, device: torch.device | str | None = None) -> Int8Weight:
    """Symmetric per-row int8 of a [rows, cols] weight, computed in fp32 on `device` (default: weight's) a block
    of rows at a time: a block of the weight moved there and two fp32 temporaries of QUANTIZE_BLOCK_ELEMENTS
    at most (QUANTIZE_TRANSIENT_BYTES), so a table in host memory never lands on the device whole. scale =
    absmax(row) / 127 (1 for an all-zero row), qweight = round(w / scale), half to even."""
    rows, cols = weight.shape
    device = torch.device(device) if device is not None else weight.device
    qweight = torch.empty((rows, cols), dtype=torch.int8, device=device)
    scale = torch.empty(rows, dtype=torch.float32, device=device)
    step = max(1, QUANTIZE_BLOCK_ELEMENTS // max(cols, 1))
    for r0 in range(0, rows, step):
        block = weight[r0 : r0 + step].to(device).float()  # the tensor itself when it is fp32 there: read only
        low, high = block.aminmax(dim=1)
        absmax = torch.maximum(-low, high)
        # A tensor divisor, not the number 127: torch on a GPU divides by a Python number as a multiply by its
        # reciprocal, a last-bit different scale than the CPU's true quotient (a table quantized on the host
        # and on the device then dequantized to different rows).
        s = torch.where(absmax > 0, absmax / torch.full_like(absmax, INT8_MAX), torch.ones_like(absmax))
        scaled = block / s[:, None]
        qweight[r0 : r0 + step] = scaled.round_().clamp_(-INT8_MAX, INT8_MAX)
        scale[r0 : r0 + step] = s
        del block, scaled
    return Int8Weight(qweight, scale, dtype)


class DequantizeScratch:
    """The buffer the int8 layers dequantize into, one layer at a time, sized once for the largest (at
    clef-flash's shapes the fused gate_up: 2 x 12,288 x 4,096, 201 MB in f16). `lock` is held from a
    layer's dequantize to the end of the GEMM that reads it, so two threads running the trunk (the
    engine's scheduler, a test's Decider) never overwrite each other's weight."""

    def __init__(self, weights: list[Int8Weight], dtype: torch.dtype, device: torch.device) -> None:
        numel = max(w.shape[0] * w.shape[1] for w in weights)
        self.buffer = torch.empty(numel, dtype=dtype, device=device)
        self.lock = threading.Lock()

    def weight(self, weight: Int8Weight, ops) -> Tensor:
        """`weight` dequantized into the buffer (call with `lock` held)."""
        rows, cols = weight.shape
        return weight.dequantize(ops, out=self.buffer[: rows * cols].view(rows, cols))

    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()
