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


def fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight block-quantized as the community FP8 uploads are: e4m3 values, one fp32 scale_inv per block
    (the block's absmax / 448)."""
    rows, cols = weight.shape
    w = weight.float()
    scale = torch.zeros(-(-rows // block[0]), -(-cols // block[1]))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / E4M3_MAX
    full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (w / full).to(torch.float8_e4m3fn), scale


def is_fp8_weight(name: str, tensor: torch.Tensor) -> bool:
    """What the uploads quantize: the trunk layers' projections (not norms, tables, tower or head)."""
    return ".layers." in name and name.endswith("proj.weight") and tensor.dim() == 2 and tensor.shape[0] > 8


def fp8_pair(tmp_path: Path, block: tuple[int, int], mtp: bool = False) -> tuple[Path, Path]:
    """(an fp8 block-quantized copy of the mid release, the dequantized release it stands for, stored in fp32)."""
    quantized, dequantized = copy_of(mid_release(), tmp_path / "fp8"), copy_of(mid_release(), tmp_path / "dequantized")

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
                values, scale = quantized_tensors[name], quantized_tensors[name + "_scale_inv"]
                rows, cols = values.shape
                full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
                out[name] = values.float() * full  # exact in fp32
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
    """Its weights in fp32 are the dequantized release's, bit for bit (e4m3 x an fp32 scale is exact), so it
    answers as the reference on the dequantized release; blocks cut short at the edges ((32, 48) on 96 x 160)
    and MTP tensors (skipped) included."""
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
