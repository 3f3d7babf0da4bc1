"""FP8 block-quantized releases, as community uploads of clef-flash are published: config.json's
`quantization_config` says `{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], ...}`, and
each quantized weight `X.weight` is stored as float8 e4m3 beside `X.weight_scale_inv` (fp32 or bf16), one scale
per [128, 128] block of the weight (the last blocks of a row or column cut short): weight = fp8 value x the
block's scale_inv.

We load such a release as we load any other: each weight is dequantized on the host as it streams in, in fp32:
each element is the product e4m3 value x scale rounded once to fp32 (exact with a bf16 scale, 4 + 8 significant
bits; with an fp32 scale the product needs up to 4 + 24 = 28 and is rounded), then cast to the serving dtype or
quantized to int8 (--quantize int8) like a bf16 release's. Cast to f16 or bf16 that is the product rounded once
to that dtype (the fp32 rounding between never moves it: checked over every e4m3 and fp32 significand,
tests/test_publishing_variants.py). A tensor-parallel rank reads only its part of each weight and the scales of
the blocks that part touches, and dequantizes just that (Fp8Weight), bit for bit the part of the whole
dequantized weight. The answers are those of the dequantized release in that dtype. Any other quantization is
refused by name (clef_cuda.model.config).
"""

from __future__ import annotations

import torch

SCALE_SUFFIX = "_scale_inv"  # "X.weight" -> "X.weight_scale_inv"
FP8_HEADER_DTYPE = "F8_E4M3"  # the safetensors header's name of float8 e4m3


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def scales_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scales a [rows, cols] weight has in `block` blocks: one per block, the last ones cut short."""
    rows, cols = shape
    return -(-rows // block[0]), -(-cols // block[1])


def blocks_touched(start: int, stop: int, size: int) -> tuple[int, int]:
    """[first, end) of the blocks of `size` that rows (or columns) [start, stop) of a weight touch."""
    return (start // size, -(-stop // size)) if stop > start else (start // size, start // size)


def dequantize_fp8_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], origin: tuple[int, int] = (0, 0)
) -> torch.Tensor:
    """A [rows, cols] float8 e4m3 weight, or the part of one whose first element is the whole's element `origin`,
    and the scales of the blocks it touches ([ceil(rows / block[0]), ceil(cols / block[1])] for a whole weight)
    -> it in fp32, each element the product rounded once to fp32. ValueError naming the shapes when the scales
    do not tile it."""
    if weight.dim() != 2:
        raise ValueError(f"an fp8 weight has 2 dimensions; this one has shape {list(weight.shape)}")
    (row0, col0), (rows, cols) = origin, weight.shape
    first_row_block, end_row_block = blocks_touched(row0, row0 + rows, block[0])
    first_col_block, end_col_block = blocks_touched(col0, col0 + cols, block[1])
    touched = (end_row_block - first_row_block, end_col_block - first_col_block)
    if tuple(scale_inv.shape) != touched:
        part = "" if origin == (0, 0) else f" (at row {row0}, column {col0} of a weight)"
        raise ValueError(
            f"its scales have shape {list(scale_inv.shape)}; a {list(weight.shape)} weight{part} in "
            f"{list(block)} blocks needs {list(touched)}"
        )
    # each row's and column's block, counted from the first block the part touches
    row_blocks = torch.arange(row0, row0 + rows) // block[0] - first_row_block
    col_blocks = torch.arange(col0, col0 + cols) // block[1] - first_col_block
    return weight.float() * scale_inv.float()[row_blocks][:, col_blocks]


def _shape(tensor) -> tuple[int, ...]:  # a torch tensor's or a safetensors slice's
    return tuple(tensor.get_shape()) if hasattr(tensor, "get_shape") else tuple(tensor.shape)


class Fp8Weight:
    """An fp8 block-quantized weight read by parts: `weight` and `scale_inv` are tensors or safetensors slices
    (which read only the bytes asked for). w[a:b], w[:, a:b] and w[:] read those rows / columns of the fp8
    values and the scales of the blocks they touch, and return them dequantized (dequantize_fp8_blocks), so a
    tensor-parallel rank reads and dequantizes its part only. ValueError when the scales do not tile the
    weight."""

    def __init__(self, weight, scale_inv, block: tuple[int, int]) -> None:
        shape = _shape(weight)
        if len(shape) != 2:
            raise ValueError(f"an fp8 weight has 2 dimensions; this one has shape {list(shape)}")
        if _shape(scale_inv) != scales_shape(shape, block):
            raise ValueError(
                f"its scales have shape {list(_shape(scale_inv))}; a {list(shape)} weight in {list(block)} blocks "
                f"needs {list(scales_shape(shape, block))}"
            )
        self.weight, self.scale_inv, self.block = weight, scale_inv, block

    def get_shape(self) -> list[int]:
        return list(_shape(self.weight))

    def __getitem__(self, index: slice | tuple[slice, slice]) -> torch.Tensor:
        rows, cols = index if isinstance(index, tuple) else (index, slice(None))
        rows_count, cols_count = self.get_shape()
        r0, r1, row_step = rows.indices(rows_count)
        c0, c1, col_step = cols.indices(cols_count)
        if row_step != 1 or col_step != 1:
            raise IndexError("an fp8 weight is read by contiguous rows and columns")
        r1, c1 = max(r0, r1), max(c0, c1)
        row_blocks, col_blocks = blocks_touched(r0, r1, self.block[0]), blocks_touched(c0, c1, self.block[1])
        scales = self.scale_inv[slice(*row_blocks), slice(*col_blocks)]
        return dequantize_fp8_blocks(self.weight[r0:r1, c0:c1], scales, self.block, origin=(r0, c0))
