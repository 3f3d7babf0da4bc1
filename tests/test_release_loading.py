"""Release directories: configs in both layouts, sharded and single-file weights, and every broken
release a user can hand us failing with a message that names the file and the field or tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from releases import mid_release, tiny_release

from clef_cuda import Decider
from clef_cuda.errors import ReleaseError
from clef_cuda.model.config import load_release_config
from clef_cuda.model.weights import head_shapes, load_release_weights, trunk_shapes


def copy_release(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "release"
    shutil.copytree(source, target)
    return target


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_clef_flash_head_has_122_tensors():
    from clef_cuda.model.config import HeadConfig

    config = HeadConfig(hidden_size=4096, width=1024, routing_layers=2, layers=4, heads=16, feedforward=4096)
    shapes = head_shapes(config)
    assert len(shapes) == 122
    parameters = sum(int(torch.Size(s).numel()) for s in shapes.values())
    assert parameters == 121_762_820  # the published head size (clef-decision.md)


def test_sharded_and_single_file_releases_load_the_same_tensors(tmp_path):
    sharded = mid_release()
    config = load_release_config(sharded)
    weights = load_release_weights(sharded, config, progress=False)
    assert set(weights.trunk) == set(trunk_shapes(config.trunk))
    assert weights.trunk["layers.0.linear_attn.A_log"].dtype == torch.float32
    # Re-save as one file under the text-only layout (Qwen3_5ForCausalLM: model.* names, qwen3_5_text).
    single = tmp_path / "text-only"
    single.mkdir()
    from safetensors.torch import save_file

    tensors = {("model." + k if k != "lm_head.weight" else k): v.to(torch.bfloat16) for k, v in weights.trunk.items()}
    save_file(tensors, str(single / "model.safetensors"))
    text = json.loads((sharded / "config.json").read_text())["text_config"]
    text |= {"model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"]}
    (single / "config.json").write_text(json.dumps(text))
    shutil.copy(sharded / "joint_head_config.json", single)
    shutil.copy(sharded / "joint_head.safetensors", single)
    other = load_release_weights(single, load_release_config(single), progress=False)
    for name, tensor in weights.trunk.items():
        assert torch.equal(tensor, other.trunk[name]), name


def test_text_only_config_layout_reads_the_same_trunk(tmp_path):
    release = copy_release(tiny_release(), tmp_path)
    nested = load_release_config(release)
    text = json.loads((release / "config.json").read_text())["text_config"]
    (release / "config.json").write_text(json.dumps(text | {"model_type": "qwen3_5_text"}))
    flat = load_release_config(release)
    assert flat.trunk == nested.trunk and flat.weight_prefix == "model."


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda c: c.update(model_type="llama"), "field 'model_type' is 'llama'"),
        (lambda c: c["text_config"].pop("hidden_size"), "field 'text_config.hidden_size' is missing"),
        (lambda c: c["text_config"].update(num_key_value_heads=3), "must be a multiple of num_key_value_heads"),
        (lambda c: c["text_config"].update(layer_types=["linear_attention"]), "field 'text_config.layer_types'"),
        (lambda c: c["text_config"].update(layer_types=["linear_attention"] * 3 + ["mamba"]), "entry 3 is 'mamba'"),
        (lambda c: c["text_config"].update(linear_conv_kernel_dim=9), "linear_conv_kernel_dim' must be in [2, 8]"),
        (lambda c: c["text_config"]["rope_parameters"].update(rope_type="yarn"), "rope_parameters.rope_type"),
        (lambda c: c["text_config"]["rope_parameters"].update(rope_theta=-1), "rope_parameters.rope_theta"),
        (lambda c: c["text_config"].update(hidden_act="gelu"), "field 'text_config.hidden_act'"),
    ],
)
def test_bad_config_names_the_field(tmp_path, change, words):
    release = copy_release(tiny_release(), tmp_path)
    edit_json(release / "config.json", change)
    with pytest.raises(ReleaseError) as info:
        load_release_config(release)
    assert words in str(info.value) and "config.json" in str(info.value)


def test_head_config_must_match_the_trunk(tmp_path):
    release = copy_release(tiny_release(), tmp_path)
    edit_json(release / "joint_head_config.json", lambda c: c.update(hidden_size=128))
    with pytest.raises(ReleaseError, match="joint_head_config.json: field 'hidden_size'"):
        load_release_config(release)


@pytest.mark.parametrize(
    "missing",
    ["config.json", "joint_head_config.json", "joint_head.safetensors", "tokenizer.json", "model.safetensors"],
)
def test_missing_files_are_named(tmp_path, missing):
    release = copy_release(tiny_release(), tmp_path)
    (release / missing).unlink()
    with pytest.raises(ReleaseError) as info:
        Decider.from_release(release, device="cpu", progress=False)
    assert missing in str(info.value) or "model.safetensors" in str(info.value)


def test_missing_shard_is_named(tmp_path):
    release = copy_release(mid_release(), tmp_path)
    shard = sorted(release.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ReleaseError, match=f"{shard.name}: missing"):
        Decider.from_release(release, device="cpu", progress=False)


def test_truncated_safetensors_is_reported(tmp_path):
    release = copy_release(tiny_release(), tmp_path)
    path = release / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ReleaseError) as info:
        Decider.from_release(release, device="cpu", progress=False)
    assert "model.safetensors" in str(info.value)


def test_garbage_safetensors_is_reported(tmp_path):
    release = copy_release(tiny_release(), tmp_path)
    (release / "joint_head.safetensors").write_bytes(b"\x00\x01not a safetensors file")
    with pytest.raises(ReleaseError, match="joint_head.safetensors: not a readable safetensors file"):
        Decider.from_release(release, device="cpu", progress=False)


def _rewrite(path: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def test_wrong_shape_names_tensor_and_file(tmp_path):
    release = copy_release(tiny_release(), tmp_path)
    name = "model.language_model.layers.1.linear_attn.in_proj_qkv.weight"
    _rewrite(release / "model.safetensors", lambda t: t.update({name: torch.zeros(127, 64, dtype=torch.bfloat16)}))
    with pytest.raises(ReleaseError) as info:
        Decider.from_release(release, device="cpu", progress=False)
    assert f"tensor {name} has shape [127, 64], expected [128, 64]" in str(info.value)
    assert "model.safetensors" in str(info.value)


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    release = copy_release(tiny_release(), tmp_path)
    _rewrite(release / "joint_head.safetensors", lambda t: t.pop("field_norm.bias"))
    with pytest.raises(ReleaseError, match="joint_head.safetensors: missing tensor field_norm.bias"):
        Decider.from_release(release, device="cpu", progress=False)
    release = copy_release(tiny_release(), tmp_path / "second")
    _rewrite(release / "model.safetensors", lambda t: t.update({"model.language_model.extra.weight": torch.zeros(2)}))
    with pytest.raises(ReleaseError, match="unexpected tensor model.language_model.extra.weight"):
        Decider.from_release(release, device="cpu", progress=False)


def test_python_in_the_model_directory_is_never_run(tmp_path):
    release = copy_release(tiny_release(), tmp_path)
    marker = tmp_path / "executed"
    (release / "joint_schema_model.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    (release / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    Decider.from_release(release, device="cpu", progress=False)
    assert not marker.exists()


def test_not_a_directory(tmp_path):
    with pytest.raises(ReleaseError, match="not a directory"):
        Decider.from_release(tmp_path / "nope", device="cpu", progress=False)


# ---- the vision tower -----------------------------------------------------------------------------
def test_the_vision_tower_loads_with_its_config_and_fp32_norms():
    decider = Decider.from_release(tiny_release(), device="cpu", dtype=torch.float16, progress=False)
    assert decider.vision is not None and decider.image_processor is not None
    assert (
        decider.vision.blocks[0].norm1[0].dtype == torch.float32 and decider.vision.patch_weight.dtype == torch.float16
    )


def test_vision_config_without_visual_weights_is_a_text_release(tmp_path):
    release = copy_release(tiny_release(), tmp_path)
    _rewrite(
        release / "model.safetensors", lambda t: [t.pop(k) for k in [k for k in t if k.startswith("model.visual.")]]
    )
    decider = Decider.from_release(release, device="cpu", progress=False)
    assert decider.vision is None
    from clef_cuda.request.images import ImageError

    with pytest.raises(ImageError, match="does not accept images"):
        decider.prepare_images([b"\x89PNG\r\n\x1a\n"])


def test_a_partial_vision_tower_names_the_missing_tensor(tmp_path):
    release = copy_release(tiny_release(), tmp_path)
    _rewrite(release / "model.safetensors", lambda t: t.pop("model.visual.blocks.0.attn.qkv.bias"))
    with pytest.raises(ReleaseError, match="missing tensor model.visual.blocks.0.attn.qkv.bias"):
        Decider.from_release(release, device="cpu", progress=False)


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda c: c["vision_config"].update(out_hidden_size=65), "vision_config.out_hidden_size"),
        (lambda c: c["vision_config"].update(num_position_embeddings=60), "must be a square"),
        (lambda c: c.pop("image_token_id"), "image_token_id"),
        (lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[1, 2]), "mrope_section"),
    ],
)
def test_bad_vision_config_names_the_field(tmp_path, change, words):
    release = copy_release(tiny_release(), tmp_path)
    edit_json(release / "config.json", change)
    with pytest.raises(ReleaseError, match=words):
        load_release_config(release)


def test_the_processor_config_is_read_not_assumed(tmp_path):
    from clef_cuda.request.images import load_processor_config

    release = copy_release(tiny_release(), tmp_path)
    edit_json(release / "processor_config.json", lambda c: c["image_processor"].update(resample=1))
    with pytest.raises(ReleaseError, match="resample"):
        load_processor_config(release)
    edit_json(
        release / "processor_config.json",
        lambda c: c["image_processor"].update(resample=3, size={"longest_edge": 50000, "shortest_edge": 1000}),
    )
    assert load_processor_config(release).max_pixels == 50000
