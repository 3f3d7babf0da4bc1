"""Model and head configuration of a clef-flash release: read config.json and joint_head_config.json,
validate every field the trunk and head rely on, fail with errors that name the file and field."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clef_cuda.errors import ReleaseError

LINEAR_ATTENTION = "linear_attention"
# How a release's weights are held (--quantize): as stored (the serving dtype), or int8 W8A16
# (clef_cuda.model.quantize).
QUANTIZE_MODES = ("none", "int8")
FULL_ATTENTION = "full_attention"


@dataclass(frozen=True)
class TrunkConfig:
    """The Qwen3.5 hybrid text trunk (see shared/specs/qwen35-trunk.md)."""

    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    vocab_size: int
    rms_norm_eps: float
    # full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    tie_word_embeddings: bool
    # Interleaved multimodal RoPE: how many rotary frequencies follow the T, H and W position axes
    # (frequency j follows H if j % 3 == 1 and j < 3 * section[1], W if j % 3 == 2 and j < 3 * section[2],
    # else T). Text-only tokens have three equal positions: plain 1-D RoPE.
    mrope_section: tuple[int, int, int] = (11, 11, 10)
    # The positions the release was trained to (text_config.max_position_embeddings; transformers' default when
    # absent): the ceiling of a record's length, past which positions are extrapolation (context_length).
    max_position_embeddings: int = 32768

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the delta net's conv: q | k | v bands."""
        return 2 * self.key_dim + self.value_dim

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)


@dataclass(frozen=True)
class HeadConfig:
    """The joint schema head (joint_head_config.json)."""

    hidden_size: int
    width: int
    routing_layers: int
    layers: int
    heads: int
    feedforward: int


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower (config.json's vision_config; weights under model.visual.)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    num_position_embeddings: int
    in_channels: int = 3
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class MediaTokens:
    """The token ids that frame and stand for an image in a record."""

    image: int
    video: int
    vision_start: int
    vision_end: int


@dataclass(frozen=True)
class ReleaseConfig:
    trunk: TrunkConfig
    head: HeadConfig
    # Where the trunk's tensors live: "model.language_model." (Qwen3_5ForConditionalGeneration, the release
    # layout) or "model." (a text-only Qwen3_5ForCausalLM save).
    weight_prefix: str
    # The vision tower's config, when config.json has one (whether the release ships its weights is known
    # only when they load: clef_cuda.model.weights).
    vision: VisionConfig | None = None
    media_tokens: MediaTokens | None = None
    # The release's revision when it sits in a Hugging Face cache (.../snapshots/<revision>/): adapters
    # trained on another revision are warned about.
    revision: str | None = None
    # An fp8 block-quantized release's weight block size (clef_cuda.model.fp8): its weights are dequantized as
    # they load. None: stored unquantized.
    fp8_block_size: tuple[int, int] | None = None


def read_json_object(path: Path, error: type[Exception] = ReleaseError, missing: str = "") -> dict[str, Any]:
    """A JSON object from `path`, or `error` naming the file: missing (with the `missing` hint), unreadable
    or not an object."""
    if not path.is_file():
        raise error(f"{path}: missing{f' ({missing})' if missing else ''}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exception:
        raise error(f"{path}: not readable JSON ({exception})") from exception
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, missing="a clef-flash release needs config.json and joint_head_config.json")


class _Fields:
    """Typed access to one JSON object, with errors naming file and field."""

    def __init__(self, data: dict[str, Any], path: Path, where: str = "") -> None:
        self.data, self.path, self.where = data, path, where

    def _name(self, key: str) -> str:
        return f"{self.where}{key}"

    def fail(self, key: str, problem: str) -> ReleaseError:
        return ReleaseError(f"{self.path}: field '{self._name(key)}' {problem}")

    def positive_int(self, key: str, default: int | None = None) -> int:
        value = self.data.get(key, default)
        if value is None:
            raise self.fail(key, "is missing")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.fail(key, f"must be a positive integer, got {value!r}")
        return value

    def positive_float(self, key: str, default: float | None = None) -> float:
        value = self.data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise self.fail(key, f"must be a positive number, got {value!r}")
        return float(value)


def _trunk_config(text: dict[str, Any], top: dict[str, Any], path: Path, where: str) -> TrunkConfig:
    f = _Fields(text, path, where)
    hidden = f.positive_int("hidden_size")
    num_layers = f.positive_int("num_hidden_layers")
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = f.positive_int("full_attention_interval", 4)
        layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise f.fail("layer_types", f"must list one type per layer ({num_layers}), got {layer_types!r}")
    for i, kind in enumerate(layer_types):
        if kind not in (LINEAR_ATTENTION, FULL_ATTENTION):
            raise f.fail("layer_types", f"entry {i} is {kind!r}; expected '{LINEAR_ATTENTION}' or '{FULL_ATTENTION}'")
    if text.get("hidden_act", "silu") != "silu":
        raise f.fail("hidden_act", f"must be 'silu' (Qwen3.5), got {text.get('hidden_act')!r}")
    if text.get("attention_bias", False):
        raise f.fail("attention_bias", "must be false: Qwen3.5 has no attention biases")

    heads = f.positive_int("num_attention_heads")
    kv_heads = f.positive_int("num_key_value_heads")
    if heads % kv_heads:
        raise f.fail("num_attention_heads", f"({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    head_dim = f.positive_int("head_dim", hidden // heads)
    linear_k_heads = f.positive_int("linear_num_key_heads")
    linear_v_heads = f.positive_int("linear_num_value_heads")
    if linear_v_heads % linear_k_heads:
        raise f.fail(
            "linear_num_value_heads",
            f"({linear_v_heads}) must be a multiple of linear_num_key_heads ({linear_k_heads})",
        )
    conv_kernel = f.positive_int("linear_conv_kernel_dim", 4)
    if not 2 <= conv_kernel <= 8:
        raise f.fail("linear_conv_kernel_dim", f"must be in [2, 8], got {conv_kernel}")

    # RoPE: rope_parameters (transformers 5) or the legacy top-level fields. The class default theta (1e4)
    # is wrong for releases, so it is read, never assumed.
    rope = text.get("rope_parameters")
    if rope is None:
        rope = {k: text[k] for k in ("rope_theta", "partial_rotary_factor", "rope_type") if k in text}
    if not isinstance(rope, dict):
        raise f.fail("rope_parameters", f"must be an object, got {rope!r}")
    rf = _Fields(rope, path, f"{where}rope_parameters.")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise rf.fail("rope_type", f"is {rope_type!r}; only 'default' (plain/multimodal RoPE) is supported")
    theta = rf.positive_float("rope_theta", text.get("rope_theta"))
    factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor <= 1:
        raise rf.fail("partial_rotary_factor", f"must be in (0, 1], got {factor!r}")
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2 or rotary_dim == 0:
        raise rf.fail(
            "partial_rotary_factor", f"gives an odd or empty rotary dim ({rotary_dim}) for head_dim {head_dim}"
        )
    section = rope.get("mrope_section", [11, 11, 10])  # transformers' Qwen3.5 default when absent
    if not isinstance(section, list) or len(section) != 3 or not all(isinstance(s, int) and s >= 0 for s in section):
        raise rf.fail("mrope_section", f"must be three non-negative integers (T, H, W), got {section!r}")

    tie = text.get("tie_word_embeddings", top.get("tie_word_embeddings", False))
    return TrunkConfig(
        hidden_size=hidden,
        intermediate_size=f.positive_int("intermediate_size"),
        layer_types=tuple(layer_types),
        vocab_size=f.positive_int("vocab_size"),
        rms_norm_eps=f.positive_float("rms_norm_eps", 1e-6),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=theta,
        linear_num_key_heads=linear_k_heads,
        linear_num_value_heads=linear_v_heads,
        linear_key_head_dim=f.positive_int("linear_key_head_dim"),
        linear_value_head_dim=f.positive_int("linear_value_head_dim"),
        linear_conv_kernel_dim=conv_kernel,
        tie_word_embeddings=bool(tie),
        mrope_section=tuple(section),
        max_position_embeddings=f.positive_int("max_position_embeddings", 32768),
    )


def load_trunk_config(path: Path) -> tuple[TrunkConfig, str]:
    """config.json -> (trunk config, weight prefix). Accepts model_type qwen3_5 (text config nested under
    text_config: the release layout) and qwen3_5_text / Qwen3_5ForCausalLM (a text-only save)."""
    data = _read_json(path)
    load_fp8_block_size(data, path)  # any quantization but fp8 blocks is refused here, by name
    model_type = data.get("model_type")
    architectures = data.get("architectures") or []
    if model_type == "qwen3_5":
        text = data.get("text_config")
        if not isinstance(text, dict):
            raise ReleaseError(f"{path}: field 'text_config' must be an object for model_type 'qwen3_5'")
        return _trunk_config(text, data, path, "text_config."), "model.language_model."
    if model_type == "qwen3_5_text" or "Qwen3_5ForCausalLM" in architectures:
        return _trunk_config(data, data, path, ""), "model."
    raise ReleaseError(
        f"{path}: field 'model_type' is {model_type!r}; expected 'qwen3_5' (a clef-flash release) or "
        "'qwen3_5_text' (a text-only Qwen3.5 save)"
    )


def load_vision_config(path: Path, trunk: TrunkConfig) -> tuple[VisionConfig | None, MediaTokens | None]:
    """config.json's vision_config and media token ids (a qwen3_5 release), or (None, None)."""
    data = _read_json(path)
    vision = data.get("vision_config")
    if data.get("model_type") != "qwen3_5" or vision is None:
        return None, None
    if not isinstance(vision, dict):
        raise ReleaseError(f"{path}: field 'vision_config' must be an object")
    f = _Fields(vision, path, "vision_config.")
    rope = vision.get("rope_parameters") or {}
    config = VisionConfig(
        depth=f.positive_int("depth"),
        hidden_size=f.positive_int("hidden_size"),
        intermediate_size=f.positive_int("intermediate_size"),
        num_heads=f.positive_int("num_heads"),
        out_hidden_size=f.positive_int("out_hidden_size"),
        patch_size=f.positive_int("patch_size"),
        spatial_merge_size=f.positive_int("spatial_merge_size"),
        temporal_patch_size=f.positive_int("temporal_patch_size"),
        num_position_embeddings=f.positive_int("num_position_embeddings"),
        in_channels=f.positive_int("in_channels", 3),
        rope_theta=_Fields(rope, path, "vision_config.rope_parameters.").positive_float("rope_theta", 10000.0),
    )
    if config.out_hidden_size != trunk.hidden_size:
        raise f.fail(
            "out_hidden_size", f"({config.out_hidden_size}) differs from the trunk's hidden_size ({trunk.hidden_size})"
        )
    if config.hidden_size % config.num_heads or (config.hidden_size // config.num_heads) % 4:
        raise f.fail(
            "num_heads", f"must divide hidden_size ({config.hidden_size}) into head dims that are multiples of 4"
        )
    if vision.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise f.fail("hidden_act", f"must be 'gelu_pytorch_tanh' (Qwen3.5), got {vision.get('hidden_act')!r}")
    side = int(config.num_position_embeddings**0.5)
    if side * side != config.num_position_embeddings:
        raise f.fail(
            "num_position_embeddings", f"must be a square (a learned grid), got {config.num_position_embeddings}"
        )
    top = _Fields(data, path)
    tokens = MediaTokens(
        image=top.positive_int("image_token_id"),
        video=top.positive_int("video_token_id"),
        vision_start=top.positive_int("vision_start_token_id"),
        vision_end=top.positive_int("vision_end_token_id"),
    )
    return config, tokens


def load_head_config(path: Path, trunk: TrunkConfig) -> HeadConfig:
    data = _read_json(path)
    f = _Fields(data, path)
    config = HeadConfig(
        hidden_size=f.positive_int("hidden_size"),
        width=f.positive_int("width"),
        routing_layers=f.positive_int("routing_layers"),
        layers=f.positive_int("layers"),
        heads=f.positive_int("heads"),
        feedforward=f.positive_int("feedforward"),
    )
    if config.hidden_size != trunk.hidden_size:
        raise f.fail(
            "hidden_size", f"({config.hidden_size}) differs from the trunk's hidden_size ({trunk.hidden_size})"
        )
    if config.width % config.heads:
        raise f.fail("width", f"({config.width}) must be a multiple of heads ({config.heads})")
    return config


def load_fp8_block_size(data: dict[str, Any], path: Path) -> tuple[int, int] | None:
    """The weight block size of an fp8 block-quantized release (clef_cuda.model.fp8: quant_method fp8, e4m3,
    weight_block_size [rows, cols]), None for a release stored unquantized; ReleaseError naming any other
    quantization (GPTQ, AWQ, bitsandbytes, per-tensor fp8, ...): its tensors are not weights we can read."""
    found = None
    for where, fields in (("", data), ("text_config.", data.get("text_config"))):
        if not isinstance(fields, dict) or fields.get("quantization_config") is None:
            continue
        config = fields["quantization_config"]
        method = config.get("quant_method", "unknown") if isinstance(config, dict) else config
        block = config.get("weight_block_size") if isinstance(config, dict) else None
        blocks_ok = isinstance(block, list) and len(block) == 2
        blocks_ok = blocks_ok and all(type(n) is int and n > 0 for n in block)
        if method == "fp8" and config.get("fmt", "e4m3") == "e4m3" and blocks_ok:
            found = (block[0], block[1])
            continue
        kind = method
        if method == "fp8":
            kind = f"fp8 {config.get('fmt')}" if blocks_ok else "fp8, without a weight_block_size"
        raise ReleaseError(
            f"{path}: field '{where}quantization_config' ({kind}): this release is already quantized in a way "
            "clef-serve does not read; it loads bf16/f16/f32 releases and fp8 e4m3 ones with block scales "
            "(weight_block_size), and quantizes them itself (--quantize int8)"
        )
    return found


# A record's token budget when none is asked for: the reference's (`systemone(..., max_length=16384)`), or the
# positions the release was trained to when those are fewer.
DEFAULT_MAX_MODEL_LEN = 16384


def context_length(trunk: TrunkConfig, requested: int | None, allow_long_context: bool = False) -> int:
    """The token budget of one record (--max-model-len): `requested`, or DEFAULT_MAX_MODEL_LEN capped at the
    release's max_position_embeddings. The release's limit is the ceiling: past it, positions are extrapolation
    the model never saw in training, so a larger `requested` is a ValueError naming both numbers unless
    allow_long_context (--allow-long-context, vLLM's convention; the caller warns: past_training)."""
    trained = trunk.max_position_embeddings
    if requested is None:
        return min(DEFAULT_MAX_MODEL_LEN, trained)
    if requested <= 0:
        raise ValueError(f"the maximum model length must be positive, got {requested}")
    if requested > trained and not allow_long_context:
        raise ValueError(
            f"--max-model-len {requested} is over the release's max_position_embeddings ({trained}), the "
            "positions it was trained to; --allow-long-context serves it anyway (positions past training are "
            "extrapolation)"
        )
    return requested


def past_training(trunk: TrunkConfig, length: int) -> str | None:
    """The warning for a record budget past the release's training positions (None within them)."""
    trained = trunk.max_position_embeddings
    if length <= trained:
        return None
    return (
        f"--allow-long-context: records of up to {length} tokens on a release trained to {trained} positions; "
        f"positions {trained} to {length - 1} are extrapolation, answers there are not what the model was trained on"
    )


def load_release_config(model_dir: str | Path) -> ReleaseConfig:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ReleaseError(f"{model_dir}: not a directory (expected a Clef release directory)")
    trunk, prefix = load_trunk_config(model_dir / "config.json")
    head = load_head_config(model_dir / "joint_head_config.json", trunk)
    vision, media_tokens = load_vision_config(model_dir / "config.json", trunk)
    revision = model_dir.resolve().name if model_dir.resolve().parent.name == "snapshots" else None
    fp8_block_size = load_fp8_block_size(_read_json(model_dir / "config.json"), model_dir / "config.json")
    return ReleaseConfig(
        trunk=trunk,
        head=head,
        weight_prefix=prefix,
        vision=vision,
        media_tokens=media_tokens,
        revision=revision,
        fp8_block_size=fp8_block_size,
    )


# Cloudflare's Clef family by trunk shape (hidden size, layers): the name each is hosted under
# (@cf/cloudflare/<name> on Workers AI), which clients send as `model`, and what /v1/models says of it.
CLEF_FAMILY = {
    (4096, 32): ("clef-flash", "clef-flash System One decision model (9B)"),
    (5120, 64): ("clef", "clef System One decision model (27B)"),
}


def family_of(config: ReleaseConfig) -> tuple[str, str]:
    """(served name, description) of a release: clef 27B's shapes are `clef`; any other is served as clef-flash
    (clef-flash itself, its fine-tunes and merges, and the small releases the tests build)."""
    return CLEF_FAMILY.get((config.trunk.hidden_size, config.trunk.num_layers), CLEF_FAMILY[(4096, 32)])
