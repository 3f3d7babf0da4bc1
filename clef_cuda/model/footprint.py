"""What a release's weights take on the device, by part: planned from config.json (and the safetensors
headers, which say whether the vision tower is there) before anything loads, and measured on the loaded
model. Parts: trunk (its layers: linear weights, norms, conv taps, decay rates), embeddings (the token
embedding and the LM-head rows the joint head reads; one table when tied), vision (the tower), head (the
joint schema head). shared/specs/memory.md has clef-flash's figures.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import fields, is_dataclass

import torch

from clef_cuda.model.config import ReleaseConfig
from clef_cuda.model.quantize import Int8Weight, is_quantized_name
from clef_cuda.model.shard import tower_rank
from clef_cuda.model.vision import VisionTower
from clef_cuda.model.vocab_tables import VOCAB_TABLES, VocabShard, vocab_part
from clef_cuda.model.weights import (
    FP32_SUFFIXES,
    VISION_FP32_SUFFIXES,
    VISION_PREFIX,
    head_shapes,
    trunk_shapes,
    vision_shapes,
)

PARTS = ("trunk", "embeddings", "vision", "head")


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def planned_weights(
    config: ReleaseConfig,
    dtype: torch.dtype,
    quantize: str = "none",
    head_dtype: torch.dtype = torch.float32,
    has_vision: bool | None = None,
    vocab_tables: str = "device",
    rank: int = 0,
    ranks: int = 1,
    vocab_rows: tuple[int, int] | None = None,
) -> dict[str, int]:
    """Bytes per part the loader will hold on the device for `config` in `dtype` (int8 rows + an fp32 scale per
    row for the quantized tensors). `has_vision`: whether the release holds the tower's tensors (default: when
    config.json describes one). vocab_tables="host": the embedding tables are not on the device (0; see
    planned_host_tables). Tensor parallel (config: a rank's local config, clef_cuda.model.shard): rank `rank` of
    `ranks` holds its `vocab_rows` of each vocabulary table (default: an even split), the head only on rank 0 and
    the tower only on its rank (clef_cuda.model.shard.tower_rank)."""
    parts = dict.fromkeys(PARTS, 0)
    start, end = vocab_rows or vocab_part(config.trunk.vocab_size, rank, ranks)
    for name, shape in trunk_shapes(config.trunk).items():
        if name == "lm_head.weight" and config.trunk.tie_word_embeddings:
            continue
        if name in VOCAB_TABLES and vocab_tables == "host":
            continue
        if name in VOCAB_TABLES:
            shape = (end - start, *shape[1:])
        part = "embeddings" if name in VOCAB_TABLES else "trunk"
        if quantize == "int8" and is_quantized_name(name):
            parts[part] += _numel(shape) + 4 * shape[0]
        else:
            width = 4 if name.endswith(FP32_SUFFIXES) else dtype_bytes(dtype)
            parts[part] += _numel(shape) * width
    has_vision = config.vision is not None and (has_vision is None or has_vision)
    if has_vision and rank == tower_rank(ranks):
        for name, shape in vision_shapes(config.vision).items():
            parts["vision"] += _numel(shape) * (4 if name.endswith(VISION_FP32_SUFFIXES) else dtype_bytes(dtype))
    if rank == 0:
        parts["head"] = sum(_numel(shape) for shape in head_shapes(config.head).values()) * dtype_bytes(head_dtype)
    return parts


def planned_host_tables(
    config: ReleaseConfig, dtype: torch.dtype, quantize: str = "none", vocab_rows: tuple[int, int] | None = None
) -> int:
    """Host bytes of the vocabulary tables (or their `vocab_rows`) under vocab_tables="host" (pinned memory)."""
    return planned_weights(config, dtype, quantize, vocab_rows=vocab_rows)["embeddings"]


def vocab_split(
    config: ReleaseConfig, dtype: torch.dtype, quantize: str, head_dtype: torch.dtype, has_vision: bool, ranks: int
) -> list[tuple[int, int]]:
    """Each tensor-parallel rank's rows [start, end) of the vocabulary tables, so that the ranks' weights are as
    equal as they can be. Every rank's trunk shard is the same size; rank 0 also holds the joint head and the
    last rank the vision tower (tower_rank), so those take that much less of the tables (none when their part
    outweighs a fair share) and the others split the rest evenly: the tables fill the ranks up to one level."""
    vocab = config.trunk.vocab_size
    if ranks == 1:
        return [(0, vocab)]
    extra = [0] * ranks
    for rank in range(ranks):
        part = planned_weights(config, dtype, quantize, head_dtype, has_vision, rank=rank, ranks=ranks)
        extra[rank] = part["vision"] + part["head"]
    tables = planned_weights(config, dtype, quantize, head_dtype, has_vision)["embeddings"]
    filled = list(range(ranks))  # the ranks the tables reach: not those whose own part stands above the level
    while True:
        level = (tables + sum(extra[r] for r in filled)) / len(filled)
        if all(extra[r] <= level for r in filled):
            break
        filled = [r for r in filled if extra[r] <= level]
    shares = [level - extra[r] if r in filled else 0.0 for r in range(ranks)]
    bounds = [round(vocab * sum(shares[:r]) / tables) for r in range(ranks)] + [vocab]
    return [(bounds[r], bounds[r + 1]) for r in range(ranks)]


def release_has_vision(config: ReleaseConfig, headers: Iterable[str]) -> bool:
    """Whether the release holds a vision tower: config.json describes one and, when the safetensors are
    there, they hold its tensors (a text-only save of a vision config has none)."""
    headers = list(headers)
    return config.vision is not None and (not headers or any(name.startswith(VISION_PREFIX) for name in headers))


def largest_quantized_weight(config: ReleaseConfig) -> int:
    """Elements of the largest fused int8 weight (the dequantize scratch holds one in the serving dtype)."""
    c = config.trunk
    fused = [2 * c.intermediate_size * c.hidden_size, c.hidden_size * c.intermediate_size]
    if c.linear_layers:
        fused += [(c.conv_dim + c.value_dim + 2 * c.linear_num_value_heads) * c.hidden_size]
        fused += [c.hidden_size * c.value_dim]
    if c.attention_layers:
        q = c.num_attention_heads * c.head_dim
        fused += [(2 * q + 2 * c.num_key_value_heads * c.head_dim) * c.hidden_size, c.hidden_size * q]
    return max(fused)


# ---- measured -----------------------------------------------------------------------------------
def _tensors(obj, seen: set[int]) -> Iterator[torch.Tensor]:
    """Every tensor reachable from obj through dataclasses, Int8Weight, lists, tuples and dicts."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Int8Weight):
        yield from (t for t in (obj.qweight, obj.scale, obj.dense_tail) if t is not None)
    elif isinstance(obj, VocabShard):  # a tensor-parallel rank's rows of a table
        yield from _tensors(obj.local, seen)
    elif is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            yield from _tensors(getattr(obj, f.name), seen)
    elif isinstance(obj, list | tuple):
        for item in obj:
            yield from _tensors(item, seen)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, seen)


def tensor_bytes(*objects) -> int:
    """Bytes of the distinct storages the objects hold (a tensor shared by two of them counts once)."""
    storages: dict[int, int] = {}
    seen: set[int] = set()
    for obj in objects:
        for t in _tensors(obj, seen):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def resident_weights(trunk, head, vision) -> dict[str, int]:
    """Bytes per part of a loaded model (trunk: clef_cuda.model.trunk.Trunk; head: JointSchemaHead;
    vision: VisionTower, None, or a handle on the tower another tensor-parallel rank holds: none here). The int8
    dequantize scratch is not a weight: Trunk.scratch. Vocabulary tables in host memory (HostTable) hold no
    device bytes: host_table_bytes counts them."""
    tables = [trunk.embed] if trunk.lm_head is trunk.embed else [trunk.embed, trunk.lm_head]
    parts = {
        "trunk": tensor_bytes(trunk.layers, trunk.final_scale),
        "embeddings": tensor_bytes(tables),
        "vision": tensor_bytes(vars(vision)) if isinstance(vision, VisionTower) else 0,  # not another rank's
        "head": tensor_bytes(head.w),
    }
    return parts


def host_table_bytes(trunk) -> int:
    """Host bytes of the vocabulary tables kept in host memory (clef_cuda.model.vocab_tables.HostTable)."""
    from clef_cuda.model.vocab_tables import HostTable

    tables = [t.local if isinstance(t, VocabShard) else t for t in (trunk.embed, trunk.lm_head)]
    tables = {id(t): t for t in tables if isinstance(t, HostTable)}
    return sum(t.nbytes() for t in tables.values())
