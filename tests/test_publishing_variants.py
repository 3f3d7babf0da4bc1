"""Releases as people publish them, each against Cloudflare's reference on the same weights: the LM head in a
safetensors file of its own, tied embeddings (no lm_head tensor), and fp8 e4m3 block-quantized uploads (a
`quantization_config` of fp8 with `weight_block_size`, `X.weight_scale_inv` beside each weight, with or
without MTP tensors), read as the dequantized release they stand for; any other quantization is refused in
one line (exit 2), never loaded wrong."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from parity import INT8_BOUNDS, PARITY_BOUND
from random_requests import random_request
from releases import mid_release, reference_model
from safetensors.torch import load_file, save_file
from test_decider import check_against_reference, reference_probabilities

from clef_cuda import Decider
from clef_cuda.errors import ReleaseError
from clef_cuda.model.config import load_release_config
from clef_cuda.model.fp8 import Fp8Weight
from clef_cuda.model.weights import INDEX_FILE, load_release_weights

ROOT = Path(__file__).resolve().parents[1]
E4M3_MAX = 448.0
MAIN_FILE = "model-00001-of-00001.safetensors"
REQUESTS = [random_request(random.Random(seed)) for seed in range(4)]


def copy_of(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def rewrite(release: Path, change) -> None:
    """change(name -> tensor dict) -> the new dict, saved over the release's shards (the index follows)."""
    index = json.loads((release / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    tensors = {}
    for file in files:
        tensors |= load_file(str(release / file))
        (release / file).unlink()
    tensors = change(tensors)
    save_file(tensors, str(release / MAIN_FILE))  # not model.safetensors: transformers would read it alone
    index["weight_map"] = dict.fromkeys(tensors, MAIN_FILE)
    (release / INDEX_FILE).write_text(json.dumps(index))


def edit_config(release: Path, change) -> None:
    config = json.loads((release / "config.json").read_text())
    change(config)
    (release / "config.json").write_text(json.dumps(config))


def tiles(shape: tuple[int, ...], block: tuple[int, int]) -> Iterator[tuple[int, int, tuple[slice, slice]]]:
    """(block row, block column, the block's part of a [rows, cols] weight) for every block, the last ones of a
    row or column cut short."""
    rows, cols = shape
    for i in range(-(-rows // block[0])):
        for j in range(-(-cols // block[1])):
            yield i, j, (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))


def fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight block-quantized as the community FP8 uploads are: e4m3 values, one fp32 scale_inv per block
    (the block's absmax / 448)."""
    w = weight.float()
    scale = torch.zeros(-(-w.shape[0] // block[0]), -(-w.shape[1] // block[1]))
    values = torch.zeros(w.shape, dtype=torch.float8_e4m3fn)
    for i, j, tile in tiles(w.shape, block):
        scale[i, j] = w[tile].abs().max().clamp(min=1e-12) / E4M3_MAX
        values[tile] = (w[tile] / scale[i, j]).to(torch.float8_e4m3fn)
    return values, scale


def by_blocks(values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype=torch.float32) -> torch.Tensor:
    """fp8 `values` dequantized here, not by clef_cuda: each block's values times its scale, multiplied in
    float64 (exact: 4 + 24 significant bits of 53) and rounded once to `dtype`."""
    out = torch.empty(values.shape, dtype=dtype)
    for i, j, tile in tiles(values.shape, block):
        out[tile] = (values[tile].double() * scale[i, j].double()).to(dtype)
    return out


def is_fp8_weight(name: str, tensor: torch.Tensor) -> bool:
    """What the uploads quantize: the trunk layers' projections (not norms, tables, tower or head)."""
    return ".layers." in name and name.endswith("proj.weight") and tensor.dim() == 2 and tensor.shape[0] > 8


def fp8_pair(
    tmp_path: Path, block: tuple[int, int], mtp: bool = False, source: Path | None = None
) -> tuple[Path, Path]:
    """(an fp8 block-quantized copy of `source` (the mid release), the dequantized release it stands for, stored
    in fp32: each element the product of its e4m3 value and its block's scale rounded once to fp32)."""
    source = source or mid_release()
    quantized, dequantized = copy_of(source, tmp_path / "fp8"), copy_of(source, tmp_path / "dequantized")

    def to_fp8(tensors: dict) -> dict:
        out = {}
        for name, tensor in tensors.items():
            if is_fp8_weight(name, tensor):
                out[name], out[name + "_scale_inv"] = fp8_blocks(tensor, block)
            else:
                out[name] = tensor
        if mtp:  # the multi-token-prediction head some uploads keep (fp8 too): never loaded
            out["mtp.fc.weight"], out["mtp.fc.weight_scale_inv"] = fp8_blocks(torch.randn(96, 192), block)
            out["mtp.norm.weight"] = torch.ones(96, dtype=torch.bfloat16)
        return out

    def from_fp8(tensors: dict) -> dict:
        quantized_tensors = load_file(str(quantized / MAIN_FILE))
        out = {}
        for name, tensor in tensors.items():
            if name + "_scale_inv" in quantized_tensors:
                out[name] = by_blocks(quantized_tensors[name], quantized_tensors[name + "_scale_inv"], block)
            else:
                out[name] = tensor
        return out

    rewrite(quantized, to_fp8)
    edit_config(
        quantized,
        lambda c: c.update(
            quantization_config={
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": list(block),
                "modules_to_not_convert": ["lm_head", "model.visual"],
            }
        ),
    )
    rewrite(dequantized, from_fp8)
    return quantized, dequantized


# ---- the LM head in its own file, tied embeddings --------------------------------------------------------
def test_the_lm_head_in_a_file_of_its_own_answers_as_the_reference(tmp_path):
    release = copy_of(mid_release(), tmp_path / "release")

    def split(tensors: dict) -> dict:
        save_file({"lm_head.weight": tensors.pop("lm_head.weight")}, str(release / "lm_head.safetensors"))
        return tensors

    rewrite(release, split)
    index = json.loads((release / INDEX_FILE).read_text())
    index["weight_map"]["lm_head.weight"] = "lm_head.safetensors"
    (release / INDEX_FILE).write_text(json.dumps(index))
    decider, reference = Decider.from_release(release, device="cpu", progress=False), reference_model(release)
    assert max(check_against_reference(decider, reference, r) for r in REQUESTS) < PARITY_BOUND


def test_tied_embeddings_answer_as_the_reference(tmp_path):
    """No lm_head tensor: the head's lexical vectors are the embedding rows (one table on the device)."""
    release = copy_of(mid_release(), tmp_path / "release")
    rewrite(release, lambda tensors: {k: v for k, v in tensors.items() if k != "lm_head.weight"})
    edit_config(
        release, lambda c: (c.update(tie_word_embeddings=True), c["text_config"].update(tie_word_embeddings=True))
    )
    decider, reference = Decider.from_release(release, device="cpu", progress=False), reference_model(release)
    assert decider.trunk.lm_head is decider.trunk.embed
    assert max(check_against_reference(decider, reference, r) for r in REQUESTS) < PARITY_BOUND


# ---- fp8 block-quantized uploads ---------------------------------------------------------------------
@pytest.mark.parametrize(("block", "mtp"), [((128, 128), False), ((32, 48), True)])
def test_an_fp8_release_loads_as_the_release_it_dequantizes_to(tmp_path, block, mtp):
    """Its weights in fp32 are the dequantized release's, bit for bit (each the product of an e4m3 value and an
    fp32 scale rounded once to fp32: not exact, the product has up to 28 significant bits), so it answers as the
    reference on the dequantized release; blocks cut short at the edges ((32, 48) on 96 x 160) and MTP tensors
    (skipped) included."""
    quantized, dequantized = fp8_pair(tmp_path, block, mtp)
    config = load_release_config(quantized)
    assert config.fp8_block_size == block
    ours = load_release_weights(quantized, config, progress=False).trunk
    theirs = load_release_weights(dequantized, load_release_config(dequantized), progress=False).trunk
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    decider, reference = Decider.from_release(quantized, device="cpu", progress=False), reference_model(dequantized)
    assert max(check_against_reference(decider, reference, r) for r in REQUESTS) < PARITY_BOUND


# e4m3 keeps 3 fraction bits: x in [2^e, 2^(e+1)) with e >= -6 rounds to a multiple of 2^(e-3), at most 2^(e-4) <=
# 2^-4 |x| away; below 2^-6 (subnormals) to a multiple of 2^-9, at most 2^-10 away. With a block's scale s (its
# absmax / 448: every x = w / s is within e4m3's range, 448 at most) each weight w comes back within
# max(2^-4 |w|, 2^-10 s); the fp32 roundings of w / s (quantizing) and of e4m3 x s (dequantizing) add at most 2^-24
# |w| each, 2^-20 |w| covers both.
E4M3_RELATIVE = 2.0**-4
E4M3_SUBNORMAL = 2.0**-10  # in units of the block's scale
E4M3_SMALLEST_NORMAL = 2.0**-6


@pytest.mark.parametrize("block", [(32, 48), (128, 128)])
def test_fp8_dequantization_is_the_stored_product_rounded_once_and_within_e4m3s_error(block):
    """Known weights (five decades of magnitude, a zero row) quantized here to e4m3 blocks, dequantized by
    clef_cuda (Fp8Weight, the loader's path): each element is its e4m3 value times its block's fp32 scale
    rounded once to fp32, and cast to f16 / bf16 rounded once to those (never twice); and it is within e4m3's
    rounding error of the original weight, an error the worst element comes near (the bound is e4m3's)."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(100, 150, generator=generator) * 10 ** (-5 * torch.rand(100, 150, generator=generator))
    weight[7] = 0
    values, scale = fp8_blocks(weight, block)
    ours = Fp8Weight(values, scale, block)[:]
    block_scale = torch.empty_like(weight)
    for i, j, tile in tiles(weight.shape, block):
        block_scale[tile] = scale[i, j]
    error, magnitude = (ours.double() - weight.double()).abs(), weight.double().abs()
    bound = torch.maximum(E4M3_RELATIVE * magnitude, E4M3_SUBNORMAL * block_scale) + 2.0**-20 * magnitude
    assert (error <= bound).all(), (error - bound).max()
    normal = magnitude >= E4M3_SMALLEST_NORMAL * block_scale
    assert normal.sum() > 1000 and (~normal & (magnitude > 0)).sum() > 1000  # both kinds of e4m3 value ran
    assert 2.0**-5 < (error[normal] / magnitude[normal]).max() <= E4M3_RELATIVE + 2.0**-20
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert torch.equal(ours.to(dtype), by_blocks(values, scale, block, dtype)), dtype


def test_rounding_to_fp32_first_never_moves_an_fp8_product_rounded_to_16_bits():
    """Why an fp8 weight dequantized in fp32 and cast to f16 / bf16 is its product rounded once to those: for every
    fp32 significand s and every e4m3 significand a (odd ones; an even one is an odd one times a power of two),
    a x s rounded to fp32 and then to 16 bits is a x s rounded to 16 bits. (So too where the f16 result is
    subnormal: checked once, 12 exponents below f16's smallest normal.)"""
    significands = torch.arange(2**23, 2**24, dtype=torch.float64) / 2**23  # every fp32 one in [1, 2)
    for a in range(1, 16, 2):
        product = significands * a  # exact in float64
        for dtype in (torch.float16, torch.bfloat16):
            assert torch.equal(product.float().to(dtype), product.to(dtype)), (a, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_an_fp8_release_loads_as_its_products_rounded_once_to_the_serving_dtype(tmp_path, dtype):
    """Loaded in each serving dtype, every fp8 weight of a release is its stored e4m3 values times their block's
    scale, rounded once to that dtype (dequantized here, in float64)."""
    block = (32, 48)
    quantized, _ = fp8_pair(tmp_path, block)
    config = load_release_config(quantized)
    loaded = load_release_weights(quantized, config, dtype=dtype, progress=False).trunk
    stored = load_file(str(quantized / MAIN_FILE))
    fp8_names = [name for name in stored if name + "_scale_inv" in stored]
    assert len(fp8_names) > 20
    for name in fp8_names:
        expected = by_blocks(stored[name], stored[name + "_scale_inv"], block, dtype)
        assert torch.equal(loaded[name.removeprefix(config.weight_prefix)], expected), name


def test_an_fp8_release_served_as_int8_is_within_the_int8_bound(tmp_path):
    """--quantize int8 on an fp8 upload: quantized from the dequantized weights as they stream in, within the
    int8 bound of the mid release (tests/parity.py) of the reference on the dequantized release."""
    quantized, dequantized = fp8_pair(tmp_path, (128, 128))
    decider = Decider.from_release(quantized, device="cpu", progress=False, quantize="int8")
    jsm, model, processor = reference_model(dequantized)
    worst = 0.0
    for request in REQUESTS:
        record = decider.encode(request)
        _, expected = reference_probabilities(jsm, model, processor, request)
        for ours, theirs in zip(decider.probabilities(record), expected, strict=True):
            worst = max(worst, *(abs(a - b) for a, b in zip(ours, theirs, strict=True)))
    assert worst <= INT8_BOUNDS[("mid", "f32")], worst


# ---- refused ---------------------------------------------------------------------------------------
def clef_serve_fails(release: Path) -> str:
    """clef-serve on `release`: exit 2 and one line; returns it."""
    result = subprocess.run(
        [sys.executable, "-m", "app.cli", "--w", str(release), "--d", "cpu", "--plan"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("clef-serve: error:")
    return line


@pytest.mark.parametrize(
    ("quantization", "named"),
    [
        ({"quant_method": "awq", "bits": 4}, "(awq)"),
        ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "(bitsandbytes)"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "(fp8, without a weight_block_size)"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "(fp8 e5m2)"),
    ],
)
def test_any_other_quantization_is_refused_by_name(tmp_path, quantization, named):
    release = copy_of(mid_release(), tmp_path / "release")
    edit_config(release, lambda c: c.update(quantization_config=quantization))
    line = clef_serve_fails(release)
    assert f"quantization_config' {named}: this release is already quantized" in line, line
    with pytest.raises(ReleaseError, match="already quantized"):
        load_release_config(release)


def test_an_fp8_weight_without_its_scales_is_refused(tmp_path):
    quantized, _ = fp8_pair(tmp_path, (128, 128))
    rewrite(
        quantized, lambda tensors: {k: v for k, v in tensors.items() if not k.endswith("down_proj.weight_scale_inv")}
    )
    line = clef_serve_fails(quantized)
    assert "down_proj.weight is fp8 without its block scales" in line, line
