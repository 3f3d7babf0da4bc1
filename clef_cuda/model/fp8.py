"""FP8 block-quantized releases, as community uploads of clef-flash are published: config.json's
`quantization_config` says `{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], ...}`, and
each quantized weight `X.weight` is stored as float8 e4m3 beside `X.weight_scale_inv` (fp32 or bf16), one scale
per [128, 128] block of the weight (the last blocks of a row or column cut short): weight = fp8 value x the
block's scale_inv.

We load such a release as we load any other: each weight is dequantized on the host as it streams in (in fp32,
where an e4m3 value, 4 significant bits, times an fp32 or bf16 scale is exact), then cast to the serving dtype
or quantized to int8 (--quantize int8) like a bf16 release's. The answers are those of the dequantized release
in that dtype (tests/test_release_loading.py measures it). Any other quantization is refused by name
(clef_cuda.model.config).
"""

from __future__ import annotations

import torch

SCALE_SUFFIX = "_scale_inv"  # "X.weight" -> "X.weight_scale_inv"
FP8_HEADER_DTYPE = "F8_E4M3"  # the safetensors header's name of float8 e4m3


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A [rows, cols] float8 e4m3 weight and its [ceil(rows / block[0]), ceil(cols / block[1])] scales -> the
    weight in fp32 (exact). ValueError naming the shapes when the scales do not tile the weight."""
    rows, cols = weight.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if weight.dim() != 2 or tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"its scales have shape {list(scale_inv.shape)}; a {list(weight.shape)} weight in {list(block)} blocks "
            f"needs {list(expected)}"
        )
    scales = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scales
