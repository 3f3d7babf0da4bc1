"""Release directory -> tensors on the serving device.

Reads only safetensors (never Python from the model directory): the trunk (and, when config.json has a
vision_config, the vision tower under model.visual.) from model.safetensors or the shards listed in
model.safetensors.index.json, the head from joint_head.safetensors. Tensors stream one
at a time from the memory-mapped files, are converted (bf16 -> the serving dtype; norms, decay
parameters and conv weights to fp32) and moved to the device, so host memory stays near one shard and
the model is never held twice. Every missing, unexpected or mis-shaped tensor fails naming tensor and file.
With quantize="int8" the trunk's linear layers and embedding tables become int8 as they stream in (one
tensor in its stored dtype at a time, then its int8 copy: clef_cuda.model.quantize), so neither host nor
device ever holds the f16 model. A release that is already quantized (integer or fp8 tensors, GPTQ/AWQ
names) is refused by its safetensors headers before anything loads.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from clef_cuda.errors import ReleaseError
from clef_cuda.model.config import (
    FULL_ATTENTION,
    QUANTIZE_MODES,
    HeadConfig,
    ReleaseConfig,
    TrunkConfig,
    VisionConfig,
)
from clef_cuda.model.fp8 import FP8_HEADER_DTYPE, SCALE_SUFFIX, Fp8Weight, scale_name
from clef_cuda.model.quantize import Int8Weight, is_quantized_name, quantize_int8
from clef_cuda.model.shard import Shard, TensorReader, shard_tensor
from clef_cuda.model.vocab_tables import VOCAB_TABLES, HostTable, VocabShard

SKIPPED_PREFIXES = ("mtp.", "model.mtp.")
# Where the two vocabulary tables live (--vocab-tables; auto is the CLI's, decided by the memory plan).
VOCAB_TABLE_PLACEMENTS = ("device", "host")
VISION_PREFIX = "model.visual."  # read when config.json has a vision_config, else skipped
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
HEAD_FILE = "joint_head.safetensors"

# Kept in fp32 whatever the serving dtype: small, and precision-critical (norm gains, decay rates, the
# conv taps the kernels read as fp32).
FP32_SUFFIXES = ("layernorm.weight", "norm.weight", "A_log", "dt_bias", "conv1d.weight")


# The vision tower's LayerNorm gains and biases stay fp32 too (its residual stream is fp32).
VISION_FP32_SUFFIXES = ("norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias", "norm.weight", "norm.bias")


# Tensors of releases quantized by other tools (GPTQ, AWQ, bitsandbytes): never loadable as ours.
PREQUANTIZED_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx", ".SCB", ".weight_format", ".absmax")
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors header dtypes we load


@dataclass
class ReleaseWeights:
    # names relative to the text model ("layers.0.mlp.up_proj.weight"), plus lm_head; Int8Weight under int8
    trunk: dict[str, torch.Tensor | Int8Weight]
    head: dict[str, torch.Tensor]  # joint_head.safetensors names
    # names under model.visual.; None when the release has no vision tower (no vision_config, or none of
    # its tensors: a text-only release)
    vision: dict[str, torch.Tensor] | None = None


def trunk_shapes(config: TrunkConfig) -> dict[str, tuple[int, ...]]:
    """Every trunk tensor a release must contain, with its shape (lm_head only when untied)."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (v, h), "norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for layer, kind in enumerate(config.layer_types):
        p = f"layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        if kind == FULL_ATTENTION:
            d, hq, hkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
            shapes |= {
                p + "self_attn.q_proj.weight": (hq * 2 * d, h),
                p + "self_attn.k_proj.weight": (hkv * d, h),
                p + "self_attn.v_proj.weight": (hkv * d, h),
                p + "self_attn.o_proj.weight": (h, hq * d),
                p + "self_attn.q_norm.weight": (d,),
                p + "self_attn.k_norm.weight": (d,),
            }
        else:
            hv = config.linear_num_value_heads
            shapes |= {
                p + "linear_attn.in_proj_qkv.weight": (config.conv_dim, h),
                p + "linear_attn.in_proj_z.weight": (config.value_dim, h),
                p + "linear_attn.in_proj_b.weight": (hv, h),
                p + "linear_attn.in_proj_a.weight": (hv, h),
                p + "linear_attn.out_proj.weight": (h, config.value_dim),
                p + "linear_attn.conv1d.weight": (config.conv_dim, 1, config.linear_conv_kernel_dim),
                p + "linear_attn.A_log": (hv,),
                p + "linear_attn.dt_bias": (hv,),
                p + "linear_attn.norm.weight": (config.linear_value_head_dim,),
            }
    return shapes


def _norm_shapes(name: str, width: int) -> dict[str, tuple[int, ...]]:
    return {f"{name}.weight": (width,), f"{name}.bias": (width,)}


def _attention_shapes(name: str, width: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{name}.in_proj_weight": (3 * width, width),
        f"{name}.in_proj_bias": (3 * width,),
        f"{name}.out_proj.weight": (width, width),
        f"{name}.out_proj.bias": (width,),
    }


def head_shapes(config: HeadConfig) -> dict[str, tuple[int, ...]]:
    """Every joint-head tensor, with its shape (122 tensors for clef-flash's head)."""
    h, w, ff = config.hidden_size, config.width, config.feedforward
    shapes: dict[str, tuple[int, ...]] = {"prior_logit_scale": (), "joint_logit_scale": (), "residual_gate": ()}
    shapes |= _norm_shapes("hidden_norm", h)
    for name in (
        "memory_projection",
        "question_projection",
        "option_question_projection",
        "global_projection",
        "option_context_projection",
        "option_lexical_projection",
    ):
        shapes[f"{name}.weight"] = (w, h)
    shapes["type_embedding.weight"] = (3, w)
    for layer in range(config.routing_layers):
        p = f"evidence_layers.{layer}"
        for norm in ("query_norm", "memory_norm", "feedforward_norm"):
            shapes |= _norm_shapes(f"{p}.{norm}", w)
        shapes |= _attention_shapes(f"{p}.attention", w)
        shapes |= {f"{p}.feedforward.0.weight": (ff, w), f"{p}.feedforward.0.bias": (ff,)}
        shapes |= {f"{p}.feedforward.3.weight": (w, ff), f"{p}.feedforward.3.bias": (w,)}
    shapes |= _norm_shapes("option_summary_norm", w)
    for layer in range(config.layers):
        p = f"layers.{layer}"
        shapes |= _attention_shapes(f"{p}.self_attn", w) | _attention_shapes(f"{p}.multihead_attn", w)
        shapes |= {f"{p}.linear1.weight": (ff, w), f"{p}.linear1.bias": (ff,)}
        shapes |= {f"{p}.linear2.weight": (w, ff), f"{p}.linear2.bias": (w,)}
        for norm in ("norm1", "norm2", "norm3"):
            shapes |= _norm_shapes(f"{p}.{norm}", w)
    shapes |= _norm_shapes("field_norm", w) | _norm_shapes("option_norm", w)
    shapes |= {"residual_scorer.0.weight": (w, 4 * w), "residual_scorer.0.bias": (w,)}
    shapes |= {"residual_scorer.3.weight": (1, w), "residual_scorer.3.bias": (1,)}
    return shapes


def vision_shapes(config: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every vision-tower tensor (names under model.visual.) with its shape."""
    h, i, c = config.hidden_size, config.intermediate_size, config.in_channels
    t, p, merged = config.temporal_patch_size, config.patch_size, config.hidden_size * config.spatial_merge_size**2
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.proj.weight": (h, c, t, p, p),
        "patch_embed.proj.bias": (h,),
        "pos_embed.weight": (config.num_position_embeddings, h),
        "merger.norm.weight": (h,),
        "merger.norm.bias": (h,),
        "merger.linear_fc1.weight": (merged, merged),
        "merger.linear_fc1.bias": (merged,),
        "merger.linear_fc2.weight": (config.out_hidden_size, merged),
        "merger.linear_fc2.bias": (config.out_hidden_size,),
    }
    for b in range(config.depth):
        q = f"blocks.{b}."
        shapes |= {
            q + "norm1.weight": (h,),
            q + "norm1.bias": (h,),
            q + "norm2.weight": (h,),
            q + "norm2.bias": (h,),
            q + "attn.qkv.weight": (3 * h, h),
            q + "attn.qkv.bias": (3 * h,),
            q + "attn.proj.weight": (h, h),
            q + "attn.proj.bias": (h,),
            q + "mlp.linear_fc1.weight": (i, h),
            q + "mlp.linear_fc1.bias": (i,),
            q + "mlp.linear_fc2.weight": (h, i),
            q + "mlp.linear_fc2.bias": (h,),
        }
    return shapes


def trunk_files(model_dir: Path) -> dict[str, list[str]]:
    """file name -> the tensor names the index says it holds ([] for a single model.safetensors: all)."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise ReleaseError(f"{index}: not a safetensors index (expected a 'weight_map' object): {error}") from error
        if not isinstance(weight_map, dict):
            raise ReleaseError(f"{index}: 'weight_map' must map tensor names to file names")
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            if not isinstance(file, str) or "/" in file or "\\" in file or file.startswith("."):
                raise ReleaseError(f"{index}: tensor {name} maps to {file!r}, not a file name in the release directory")
            files.setdefault(file, []).append(name)
        for file in files:
            if not (model_dir / file).is_file():
                raise ReleaseError(f"{model_dir / file}: missing (listed in {INDEX_FILE})")
        return files
    if (model_dir / SINGLE_FILE).is_file():
        return {SINGLE_FILE: []}
    raise ReleaseError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}: not a clef-flash release directory")


@dataclass(frozen=True)
class TensorHeader:
    dtype: str  # safetensors' name: "BF16", "F16", "F32", "I8", ...
    shape: tuple[int, ...]


def safetensors_header(path: Path) -> dict[str, TensorHeader]:
    """The tensors a safetensors file declares, from its JSON header alone (reads a few KB, not the data)."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 * 2**20:
                raise ValueError(f"a {size}-byte header")
            header = json.loads(f.read(size))
        return {
            name: TensorHeader(str(entry["dtype"]), tuple(int(n) for n in entry["shape"]))
            for name, entry in header.items()
            if name != "__metadata__"
        }
    except (OSError, struct.error, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ReleaseError(f"{path}: not a readable safetensors file ({error})") from error


def release_headers(model_dir: Path) -> dict[str, tuple[TensorHeader, Path]]:
    """Every trunk/tower tensor the release's safetensors declare, with its file (headers only); empty for
    a directory with config files only (a plan for a model not downloaded yet; loading it fails later)."""
    if not (model_dir / INDEX_FILE).is_file() and not (model_dir / SINGLE_FILE).is_file():
        return {}
    headers: dict[str, tuple[TensorHeader, Path]] = {}
    for file in trunk_files(model_dir):
        path = model_dir / file
        headers |= {name: (header, path) for name, header in safetensors_header(path).items()}
    return headers


def check_not_prequantized(model_dir: str | Path, fp8_block_size: tuple[int, int] | None = None) -> None:
    """ReleaseError for a release quantized by another tool (integer or fp8 tensors, GPTQ/AWQ names): its
    tensors are not weights we can load, and --quantize int8 does the quantizing here. fp8_block_size (the
    release's config says fp8 with block scales, clef_cuda.model.fp8): fp8 e4m3 weights with their scales are
    read, an fp8 tensor without its scales (or scales without their weight) is refused."""
    model_dir = Path(model_dir)
    headers = release_headers(model_dir)
    for name, (header, path) in headers.items():
        if fp8_block_size is not None and name.endswith(SCALE_SUFFIX):
            weight = headers.get(name.removesuffix(SCALE_SUFFIX))
            if weight is None or weight[0].dtype != FP8_HEADER_DTYPE:
                raise ReleaseError(f"{path}: tensor {name} scales no fp8 weight of the release")
            continue
        if fp8_block_size is not None and header.dtype == FP8_HEADER_DTYPE:
            if scale_name(name) not in headers:
                raise ReleaseError(f"{path}: tensor {name} is fp8 without its block scales ({scale_name(name)})")
            continue
        if name.endswith(PREQUANTIZED_SUFFIXES) or header.dtype not in FLOAT_DTYPES:
            raise ReleaseError(
                f"{path}: tensor {name} is {header.dtype}: this release is already quantized (GPTQ, AWQ, int8 or "
                "fp8 without block scales in its config); clef-serve loads bf16/f16/f32 releases and fp8 ones "
                "with block scales, and quantizes them itself (--quantize int8)"
            )


def _fp8_dequantizer(model_dir: Path, config: ReleaseConfig):
    """name, stored tensor or safetensors slice -> what to load: an fp8 block-quantized weight with its scales
    (read from their file) as an Fp8Weight, from which a tensor-parallel rank reads and dequantizes its part
    only (a slice), or dequantized whole (a tensor: fp32, clef_cuda.model.fp8); everything else as it is."""
    if config.fp8_block_size is None:
        return lambda name, tensor: tensor
    headers = release_headers(model_dir)
    scale_files: dict[Path, object] = {}  # open while the release loads: each weight reads its scales' part

    def dequantize(name: str, tensor):
        if scale_name(name) not in headers:
            return tensor
        _, path = headers[scale_name(name)]
        if path not in scale_files:
            scale_files[path] = _open(path)
        try:
            weight = Fp8Weight(tensor, scale_files[path].get_slice(scale_name(name)), config.fp8_block_size)
            return weight if hasattr(tensor, "get_shape") else weight[:]
        except ValueError as error:
            raise ReleaseError(f"{path}: tensor {name}: {error}") from error

    return dequantize


def _open(path: Path):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as error:
        raise ReleaseError(f"{path}: not a readable safetensors file ({error})") from error


def _tensors(path: Path, names: list[str] | None, sliced: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from one safetensors file, lazily (memory-mapped); sliced=True: (name, a safetensors
    slice), from which a tensor-parallel rank reads only its part."""
    from safetensors import SafetensorError

    handle = _open(path)
    with handle as f:
        keys = list(f.keys())
        if names:
            missing = sorted(set(names) - set(keys))
            if missing:
                raise ReleaseError(f"{path}: does not hold {missing[0]} (the index says it does)")
            keys = [k for k in keys if k in set(names)]
        for name in keys:
            try:
                yield name, (f.get_slice(name) if sliced else f.get_tensor(name))
            except (SafetensorError, OSError, RuntimeError, ValueError) as error:
                raise ReleaseError(f"{path}: tensor {name} is unreadable ({error}); is the file truncated?") from error


def serving_dtype_for(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.endswith(FP32_SUFFIXES) else dtype


def _place(
    name: str, tensor: torch.Tensor, expected: tuple[int, ...], dtype: torch.dtype, device, path: Path
) -> torch.Tensor:
    if tuple(tensor.shape) != expected:
        raise ReleaseError(f"{path}: tensor {name} has shape {list(tensor.shape)}, expected {list(expected)}")
    if not tensor.is_floating_point():
        raise ReleaseError(f"{path}: tensor {name} has dtype {tensor.dtype}, expected a floating-point type")
    return tensor.to(device=device, dtype=dtype)


def _quantized(
    name: str, tensor: torch.Tensor, expected: tuple[int, ...], dtype: torch.dtype, device, path: Path
) -> Int8Weight:
    """The int8 copy of a linear weight or table on `device`, computed there a block of rows at a time from the
    stored tensor in host memory (quantize_int8): the device never holds the stored tensor, only its int8 copy
    and one block's temporaries (QUANTIZE_TRANSIENT_BYTES, which the memory plan counts)."""
    if tuple(tensor.shape) != expected:
        raise ReleaseError(f"{path}: tensor {name} has shape {list(tensor.shape)}, expected {list(expected)}")
    if not tensor.is_floating_point():
        raise ReleaseError(f"{path}: tensor {name} has dtype {tensor.dtype}, expected a floating-point type")
    return quantize_int8(tensor, dtype, device=device)


def load_release_weights(
    model_dir: str | Path,
    config: ReleaseConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    head_dtype: torch.dtype = torch.float32,
    progress: bool = True,
    quantize: str = "none",
    vocab_tables: str = "device",
    shard: Shard | None = None,
) -> ReleaseWeights:
    """Stream the trunk (in `dtype`, fp32 for norms/decays/conv; with quantize="int8" its linear layers
    and embedding tables as int8) and head (in `head_dtype`) onto `device`. vocab_tables="host": the embedding
    and LM-head tables stay in (pinned) host memory as HostTables (clef_cuda.model.vocab_tables).
    shard: a tensor-parallel rank's part only (clef_cuda.model.shard), read from the files by slices (an fp8
    weight's part with its blocks' scales, dequantized alone), so no rank ever reads or holds a whole sharded
    tensor; the vocabulary tables by rows (VocabShards), the head on rank 0 only and the vision tower on its
    rank only (clef_cuda.model.shard.tower_rank; the others get an empty head, no tower)."""
    if vocab_tables not in VOCAB_TABLE_PLACEMENTS:
        raise ValueError(f"vocab_tables must be one of {VOCAB_TABLE_PLACEMENTS}, got {vocab_tables!r}")
    from tqdm import tqdm

    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {quantize!r}")
    model_dir = Path(model_dir)
    check_not_prequantized(model_dir, config.fp8_block_size)
    stored = _fp8_dequantizer(model_dir, config)
    expected_trunk = trunk_shapes(config.trunk)
    expected_vision = vision_shapes(config.vision) if config.vision is not None else {}
    vision: dict[str, torch.Tensor] = {}
    expected_head = head_shapes(config.head)
    files = trunk_files(model_dir)
    head_path = model_dir / HEAD_FILE
    if not head_path.is_file():
        raise ReleaseError(f"{head_path}: missing (the joint schema head)")
    trunk: dict[str, torch.Tensor] = {}
    head: dict[str, torch.Tensor] = {}
    bar = tqdm(
        total=len(expected_trunk) + len(expected_head) + len(expected_vision),
        desc=f"loading {model_dir.name or model_dir}",
        unit="tensor",
        disable=not progress,
        file=sys.stderr,
    )
    prefix = config.weight_prefix
    sharded = shard is not None and shard.size > 1
    if sharded and not shard.holds_tower:  # one rank runs the tower (shard.tower_rank), rank 0 the head
        expected_vision = {}
    if sharded and not shard.holds_head:
        expected_head = {}
    with bar:
        for file, names in sorted(files.items()):
            path = model_dir / file
            for name, tensor in _tensors(path, names, sliced=sharded):
                if name.startswith(SKIPPED_PREFIXES) or (name.startswith(VISION_PREFIX) and not expected_vision):
                    continue
                if config.fp8_block_size is not None and name.endswith(SCALE_SUFFIX):
                    continue  # read with its weight
                tensor = stored(name, tensor)
                if sharded:
                    tensor = _shard_of(name, tensor, prefix, expected_trunk, config.trunk, shard, path)
                if name.startswith(VISION_PREFIX):
                    key = name[len(VISION_PREFIX) :]
                    if key not in expected_vision:
                        raise ReleaseError(
                            f"{path}: unexpected tensor {name} (not part of the configured vision tower)"
                        )
                    target = torch.float32 if key.endswith(VISION_FP32_SUFFIXES) else dtype
                    vision[key] = _place(name, tensor, expected_vision[key], target, device, path)
                    continue
                key = name[len(prefix) :] if name.startswith(prefix) else name
                if key not in expected_trunk or (key == name and name != "lm_head.weight"):
                    raise ReleaseError(f"{path}: unexpected tensor {name} (not part of the configured trunk)")
                if sharded:  # its shape was checked whole; the part's is the rank's own
                    expected_trunk[key] = tuple(tensor.shape)
                if key in trunk:
                    raise ReleaseError(f"{path}: tensor {name} appears twice in the release")
                # The vocabulary tables on the host are built there, then wrapped (rows go to `device`).
                where = "cpu" if vocab_tables == "host" and key in VOCAB_TABLES else device
                if quantize == "int8" and is_quantized_name(key):
                    trunk[key] = _quantized(name, tensor, expected_trunk[key], dtype, where, path)
                else:
                    trunk[key] = _place(name, tensor, expected_trunk[key], serving_dtype_for(key, dtype), where, path)
                if where != device:
                    trunk[key] = HostTable(trunk[key], device)
                if sharded and key in VOCAB_TABLES:  # this rank's rows of the table
                    start, _ = shard.vocab_rows(config.trunk.vocab_size)
                    trunk[key] = VocabShard(trunk[key], start, config.trunk.vocab_size)
                del tensor
                bar.update(1)
        for name, tensor in _tensors(head_path, None) if expected_head else ():
            if name not in expected_head:
                raise ReleaseError(f"{head_path}: unexpected tensor {name} (not part of the configured head)")
            head[name] = _place(name, tensor, expected_head[name], head_dtype, device, head_path)
            bar.update(1)
    checked = [(model_dir, expected_trunk, trunk), (head_path, expected_head, head)]
    if vision:  # some of the tower's tensors are there: then all of them must be
        checked.append(
            (
                model_dir,
                {VISION_PREFIX + k: v for k, v in expected_vision.items()},
                {VISION_PREFIX + k: v for k, v in vision.items()},
            )
        )
    for where, expected, got in checked:
        missing = [n for n in expected if n not in got]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ReleaseError(f"{where}: missing tensor {missing[0]}{more}")
    if config.trunk.tie_word_embeddings:
        trunk["lm_head.weight"] = trunk["embed_tokens.weight"]
    return ReleaseWeights(trunk=trunk, head=head, vision=vision or None)


def _shard_of(name: str, piece, prefix: str, expected: dict, config: TrunkConfig, shard: Shard, path: Path):
    """A tensor-parallel rank's part of trunk tensor `name` (a safetensors slice, or an Fp8Weight over one: its
    whole shape checked first, then only the part read). Vision tensors pass whole (one rank alone reads them)."""
    if name.startswith(VISION_PREFIX):
        return piece[:]
    key = name[len(prefix) :] if name.startswith(prefix) else name
    if key not in expected:
        raise ReleaseError(f"{path}: unexpected tensor {name} (not part of the configured trunk)")
    shape = tuple(piece.get_shape()) if hasattr(piece, "get_shape") else tuple(piece.shape)  # a slice or a tensor
    if shape != expected[key]:
        raise ReleaseError(f"{path}: tensor {name} has shape {list(shape)}, expected {list(expected[key])}")
    reader = TensorReader(lambda a, b: piece[a:b], lambda a, b: piece[:, a:b], lambda: piece[:])
    return shard_tensor(key, reader, config, shard)
