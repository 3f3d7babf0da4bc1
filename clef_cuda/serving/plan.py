"""The memory plan: what a release needs on a device before anything loads, and how the cache budget is
split once it has.

`plan_serving` reads only the release's config.json, safetensors headers and image-processor settings:
weights by part (int8 or not; the two vocabulary tables on the device or in host memory), the int8
dequantize scratch, the load's peak (the weights plus what fusing and quantizing add at once), one step's
activations (the trunk's, or the vision tower's over the largest image the processor allows, whichever is
larger, plus one step's image features: the records hold theirs in host memory), the CUDA context
(counted when the memory planned for is a card's total, as --gpu-memory and the card table give it; already
gone from a live device's free memory) and the workspaces, then the cache --kv-fraction buys from what is
left (state slots and KV blocks, as the engine will split it). It fits when the load's peak fits and the
weights leave room for one full-length record's cache and the step's activations. `clef-serve --plan`
prints it (exit 0 fits, 3 does not); at start-up the same plan runs against the device and a model that
cannot fit is a one-line error (exit 2) that names the numbers and says whether int8 weights or host
tables would fit. `plan_cache` is the split the engine applies to the measured free memory after loading.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from clef_cuda.model.config import ReleaseConfig, TrunkConfig, VisionConfig, context_length
from clef_cuda.model.footprint import (
    dtype_bytes,
    largest_quantized_weight,
    planned_host_tables,
    planned_weights,
    release_has_vision,
    vocab_split,
)
from clef_cuda.model.quantize import QUANTIZE_TRANSIENT_BYTES
from clef_cuda.model.shard import tower_rank
from clef_cuda.model.trunk_cache import TrunkCache
from clef_cuda.model.vision import ROW_CHUNK as VISION_ROW_CHUNK
from clef_cuda.model.weights import release_headers
from clef_cuda.request.images import load_processor_config
from clef_cuda.request.videos import load_video_processor_config

GiB = 2**30
MiB = 2**20
# The CUDA context torch creates (its modules loaded lazily, CUDA 11.7+): an allowance, counted when the memory
# planned for is a card's total capacity; a live device's free memory has it taken out already.
CUDA_CONTEXT_BYTES = 512 * MiB
# cuBLAS/cuDNN workspaces and the caching allocator's slack: counted always on a GPU.
CUDA_WORKSPACE_BYTES = 256 * MiB
CUDA_OVERHEAD_BYTES = CUDA_CONTEXT_BYTES + CUDA_WORKSPACE_BYTES
# On the CPU the memory planned for also holds the tokenizer, the image processor and the runtimes' own buffers.
HOST_RUNTIME_BYTES = 64 * MiB
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|kb|kib|mb|mib|gb|gib|tb|tib)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "kib": 2**10, "mb": 10**6, "mib": 2**20, "gb": 10**9, "gib": 2**30, "tb": 10**12}
_UNITS["tib"] = 2**40


def parse_memory_size(text: str) -> int:
    """'16GiB', '16 GB', '12000MiB' or a plain number of bytes -> bytes; ValueError naming the text."""
    match = _SIZE.match(text or "")
    if not match:
        raise ValueError(f"{text!r} is not a memory size (e.g. 16GiB, 24GB, 12000MiB)")
    value = float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()]
    if value < 1:
        raise ValueError(f"{text!r} is not a memory size (e.g. 16GiB, 24GB, 12000MiB)")
    return int(value)


@dataclass(frozen=True)
class CachePlan:
    budget_bytes: int
    slot_bytes: int
    block_bytes: int
    running_slots: int
    snapshot_slots: int
    num_blocks: int
    snapshot_budget_bytes: int

    @property
    def allocated_bytes(self) -> int:
        return self.num_blocks * self.block_bytes + (self.running_slots + self.snapshot_slots) * self.slot_bytes

    def describe(self, block_size: int, max_model_len: int) -> str:
        tokens = self.num_blocks * block_size
        allocated = self.allocated_bytes
        return (
            f"cache: {allocated / MiB:.0f} MiB allocated of a {self.budget_bytes / MiB:.0f} MiB budget: "
            f"{self.num_blocks} KV blocks x {block_size} = {tokens} tokens ({tokens / max_model_len:.1f} records of "
            f"{max_model_len}); {self.running_slots} running state slots + {self.snapshot_slots} prefix snapshots "
            f"({self.slot_bytes / MiB:.2f} MiB each)"
        )


def plan_cache(
    trunk: TrunkConfig,
    dtype: torch.dtype,
    config,
    free_bytes: int,
    where: str = "device",
    max_fraction: float = 1.0,
    remedies: tuple[str, ...] = (),
) -> CachePlan:
    """Split kv_fraction of `free_bytes` (config: the engine's EngineConfig) into running state slots,
    prefix snapshots and KV blocks. ValueError when it cannot hold one max_model_len record, saying the longest
    record it holds and the --kv-fraction that would hold one, or that none up to `max_fraction` (what a step's
    activations leave of the free memory) would: the advice is one that works."""
    budget = int(config.kv_fraction * max(0, free_bytes))
    slot_bytes = TrunkCache.slot_bytes(trunk, dtype)
    block_bytes = max(1, TrunkCache.block_bytes(trunk, dtype, config.block_size))
    blocks_per_record = -(-config.max_model_len // config.block_size)
    running = config.max_num_seqs
    snapshot_budget = int(config.snapshot_fraction * budget) if config.prefix_cache else 0
    snapshots = min(config.max_snapshots, snapshot_budget // max(slot_bytes, 1)) if config.prefix_cache else 0
    # Prefix snapshots are a cache: on a small budget they give way until one full-length record's blocks fit.
    spare = budget - running * slot_bytes - blocks_per_record * block_bytes
    snapshots = max(0, min(snapshots, spare // max(slot_bytes, 1)))
    blocks = (budget - running * slot_bytes - snapshots * slot_bytes) // block_bytes
    # More blocks than every running record at full length plus as much again for cached prefixes can
    # never be used: do not allocate (and, on the CPU, commit) them.
    blocks = int(min(blocks, 2 * running * blocks_per_record))
    if blocks < blocks_per_record:
        raise ValueError(
            f"--kv-fraction {config.kv_fraction} of the free {where} memory ({free_bytes / GiB:.1f} GiB) leaves "
            f"room for {max(blocks, 0)} KV blocks, fewer than one {config.max_model_len}-token record needs "
            f"({blocks_per_record}); "
            + cache_advice(config, free_bytes, slot_bytes, block_bytes, max_fraction, remedies)
        )
    return CachePlan(budget, slot_bytes, block_bytes, running, snapshots, blocks, snapshot_budget)


def cache_advice(
    config, free_bytes: int, slot_bytes: int, block_bytes: int, max_fraction: float, remedies: tuple[str, ...] = ()
) -> str:
    """What would let the cache hold one max_model_len record, each piece of advice one that works: the --kv-fraction
    that holds one (at most max_fraction of `free_bytes`, what a step's activations leave), else that none does and
    what frees memory (`remedies`, then a larger card); and the longest record that fits as things are (at
    --kv-fraction, or max_fraction when that is less)."""
    needed = config.max_num_seqs * slot_bytes + -(-config.max_model_len // config.block_size) * block_bytes
    fraction = math.ceil(100 * needed / max(free_bytes, 1)) / 100
    usable = min(config.kv_fraction, max_fraction)
    longest = max(0, int(usable * free_bytes) - config.max_num_seqs * slot_bytes) // block_bytes * config.block_size
    at = f"--kv-fraction {usable:.2f}" + (
        f" (the most a step's activations leave; {config.kv_fraction} leaves them too little)"
        if usable < config.kv_fraction
        else ""
    )
    shorter = f"at {at} the longest record that fits is {longest} tokens (--max-model-len {longest})"
    if fraction <= max_fraction:
        return f"--kv-fraction {fraction:.2f} holds one; or {shorter}"
    return (
        f"no --kv-fraction up to {max_fraction:.2f}"
        + (" (what a step's activations leave)" if max_fraction < 1 else "")
        + " holds one; "
        f"{shorter}; what frees memory for more: {', '.join((*remedies, 'a larger card'))}"
    )


def delta_rule_workspace_bytes(trunk: TrunkConfig, dtype: torch.dtype, tokens: int, sequences: int = 1) -> int:
    """The chunked delta rule kernel's workspace for a step of `tokens` tokens over `sequences` sequences (the
    CUDA kernel's gdr_chunked_workspace, csrc/gated_delta_rule/gated_delta_rule.h): per 64-token chunk (a pack
    has at most tokens / 64 + sequences) and value head its cumulative decay (fp32), W and U rows and the state at
    its start; per chunk and key head the normalised keys. Only f16/bf16 run that kernel: 0 otherwise."""
    width = dtype_bytes(dtype)
    if width != 2 or not trunk.linear_layers:
        return 0
    hk, hv, d = trunk.linear_num_key_heads, trunk.linear_num_value_heads, trunk.linear_value_head_dim
    chunks = -(-tokens // 64) + sequences
    per_value_head = 64 * 4 + 2 * 64 * d * width + d * d * width + d // 16 * 4
    return chunks * (hv * per_value_head + hk * 64 * d * width)


def step_activation_bytes(trunk: TrunkConfig, dtype: torch.dtype, tokens: int, sequences: int = 1) -> int:
    """The largest temporaries of one trunk step over `tokens` packed tokens of `sequences` sequences (an estimate
    from the trunk's code: the fp32 residual stream and its norms, plus the widest layer's projections and fp32
    copies, the delta net's with the chunked kernel's workspace)."""
    c, width = trunk, dtype_bytes(dtype)
    residual = 3 * tokens * c.hidden_size * 4  # x, its fp32 norm, the layer's fp32 output
    mlp = tokens * 2 * c.intermediate_size * width
    layers = [mlp]
    if c.linear_layers:
        in_proj = c.conv_dim + c.value_dim + 2 * c.linear_num_value_heads
        workspace = delta_rule_workspace_bytes(c, dtype, tokens, sequences)
        layers.append(tokens * (in_proj + c.conv_dim) * width + 4 * tokens * c.value_dim * 4 + workspace)
    if c.attention_layers:
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        layers.append(tokens * (2 * q + 2 * kv) * width + 2 * tokens * (2 * q + 2 * kv) * 4)
    return residual + max(layers)


# The tower's live tensors times this: what an allocator holds beyond them (the caching allocator's rounding and
# fragmentation on a GPU, malloc's on the CPU; measured: tests/test_plan.py, up to 1.1x on the CPU).
VISION_MARGIN = 1.25


def vision_peak_bytes(vision: VisionConfig, dtype: torch.dtype, patches: int) -> int:
    """The vision tower's largest live tensors over one image of `patches` patches (the engine runs the tower an
    image at a time), read off clef_cuda.model.vision's code. Held for every patch: the fp32 residual stream, each
    block's q, k and v in the serving dtype, the rotary angles and position-grid taps, the output features. Held
    for ROW_CHUNK patches at a time: the larger of the qkv step (the fp32 norm and its cast, the fused qkv, the
    fp32 rotary temporaries) and the rest of the block (the chunk's queries copied for SDPA, its output and the
    reshaped copy, the projection and its fp32 add, the norm and its cast, fc1 and its GELU in `intermediate`,
    fc2 and its fp32 add). The pixels stay in host memory and come over a chunk at a time."""
    h, i, w = vision.hidden_size, vision.intermediate_size, dtype_bytes(dtype)
    head_dim = h // vision.num_heads
    merge = vision.spatial_merge_size**2
    whole = 4 * h + 3 * w * h + 2 * 4 * head_dim + 4 * (8 + 4) + vision.out_hidden_size * w // merge
    patch_row = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    qkv_step = (4 + w + 3 * w + 20) * h + patch_row * 4
    mlp_step = (3 * w + w + 4 + 4 + w + w + 4) * h + 2 * w * i
    live = patches * whole + min(patches, VISION_ROW_CHUNK) * max(qkv_step, mlp_step)
    return int(VISION_MARGIN * live)


def image_feature_bytes(trunk: TrunkConfig, dtype: torch.dtype, step_tokens: int) -> int:
    """Image features on the device at once: one step's rows (the records hold theirs in host memory until their
    prefill reaches them, clef_cuda.serving.engine)."""
    return step_tokens * trunk.hidden_size * dtype_bytes(dtype)


def shadow_run_bytes(trunk: TrunkConfig, dtype: torch.dtype, max_model_len: int, headroom_bytes: int) -> int:
    """What a shadow run (clef_cuda.verification.shadow) holds on the device beside the pools: its own state slot,
    and what the reference attention's peak over a chunk (clef_cuda.kernels.reference.paged_attention_peak_bytes: the
    context's keys and values gathered, one KV head's fp32 scores and probabilities) needs beyond
    `headroom_bytes`, a step's activations (a shadow chunk runs between steps, on the engine's thread, never
    beside one; the run's chunks shrink as its context grows to keep the peak within SHADOW_SCORES_BYTES). Its
    KV blocks are lent from the engine's pool while free (real work takes them back)."""
    from clef_cuda.verification.shadow import shadow_scores_bytes

    scores = shadow_scores_bytes(trunk, max_model_len, dtype) if trunk.attention_layers else 0
    return TrunkCache.slot_bytes(trunk, dtype) + max(0, scores - headroom_bytes)


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


@dataclass(frozen=True)
class ServingPlan:
    release: str
    where: str  # what the device memory is, in words
    device_bytes: int  # the memory planned for
    dtype: torch.dtype
    quantize: str
    weights: dict[str, int]  # by part (clef_cuda.model.footprint.PARTS)
    scratch_bytes: int  # the int8 dequantize buffer (0 without int8)
    activation_bytes: int  # one step
    step_tokens: int
    overhead_bytes: int  # CUDA context (when counted) and workspaces (0 on the CPU)
    reserved_bytes: int  # adapters' pool, the vision cache
    cache: CachePlan | None  # None when the weights leave too little
    problem: str | None  # why it does not fit (None: it fits)
    block_size: int
    max_model_len: int
    kernels: str | None = None  # the attention tiles of the device planned on, when it is a real GPU
    vocab_tables: str = "device"  # where the embedding and LM-head tables live
    host_table_bytes: int = 0  # their pinned host memory, when on the host
    load_transient_bytes: int = 0  # what loading adds at its peak beyond the weights (a fused layer, a quantize block)
    trunk_activation_bytes: int = 0  # one trunk step
    vision_activation_bytes: int = 0  # the tower over the largest image (0 without a tower)
    feature_bytes: int = 0  # image features the running records hold
    image_patches: int = 0  # patches of the largest image the processor allows
    context_counted: bool = True  # whether overhead_bytes includes the CUDA context
    on_gpu: bool = True  # a GPU's plan (where the vocabulary tables can go to host memory)
    rank: int = 0  # tensor parallel: which rank of `ranks` this plan is for
    ranks: int = 1
    other_ranks: tuple[ServingPlan, ...] = ()  # rank 0's plan under tensor parallel: the others' (plan_tensor_parallel)
    vocab_rows: tuple[int, int] | None = None  # tensor parallel: this rank's rows of the vocabulary tables

    @property
    def fits(self) -> bool:
        return self.problem is None

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def needed_bytes(self) -> int:
        """What the device holds before the cache: weights, int8 scratch, a step's activations, the CUDA
        overhead, what is reserved."""
        return (
            self.weight_bytes + self.scratch_bytes + self.activation_bytes + self.overhead_bytes + self.reserved_bytes
        )

    @property
    def load_peak_bytes(self) -> int:
        """The device's peak while the weights load: all of them, the largest transient, the context."""
        return self.weight_bytes + self.load_transient_bytes + self.overhead_bytes

    def describe(self) -> str:
        gib = _size
        kind = "int8 weights (W8A16), " if self.quantize == "int8" else ""
        dtype = str(self.dtype).removeprefix("torch.")
        parts = ", ".join(f"{part} {gib(n)}" for part, n in self.weights.items() if n)
        lines = [
            f"memory plan: {self.release} on {gib(self.device_bytes)} ({self.where})"
            + (f", rank 0 of {self.ranks} such cards (tensor parallel)" if self.ranks > 1 else "")
            + f", {kind}{dtype} activations",
            f"  weights        {gib(self.weight_bytes):>10}  ({parts})",
        ]
        if self.vocab_tables == "host":
            whose = "rank 0's rows, " if self.ranks > 1 else ""
            lines.append(
                f"  vocab tables   {gib(self.host_table_bytes):>10}  {whose}in pinned host memory (--vocab-tables host)"
            )
        if self.scratch_bytes:
            lines.append(f"  int8 scratch   {gib(self.scratch_bytes):>10}  (the largest fused layer, dequantized)")
        step = f"the trunk {gib(self.trunk_activation_bytes)} for {self.step_tokens} tokens"
        if self.vision_activation_bytes:
            step += f"; the vision tower {gib(self.vision_activation_bytes)} for one {self.image_patches}-patch image"
            step += f", + {gib(self.feature_bytes)} of a step's image features (the rest wait in host memory)"
        lines.append(f"  activations    {gib(self.activation_bytes):>10}  (the larger step: {step})")
        if self.on_gpu:
            what = "context and workspaces" if self.context_counted else "workspaces; the context is already gone"
            lines.append(f"  CUDA overhead  {gib(self.overhead_bytes):>10}  ({what}: an allowance)")
        else:
            lines.append(
                f"  runtime        {gib(self.overhead_bytes):>10}  (tokenizer, processor, runtimes: an allowance)"
            )
        lines.append(
            f"  load peak      {gib(self.load_peak_bytes):>10}  (weights + {gib(self.load_transient_bytes)} while "
            "fusing and quantizing + overhead)"
        )
        if self.reserved_bytes:
            lines.append(f"  reserved       {gib(self.reserved_bytes):>10}  (adapter pool, vision cache, a shadow run)")
        if self.cache is not None:
            lines.append(f"  {self.cache.describe(self.block_size, self.max_model_len)}")
        if self.kernels:
            lines.append(f"  attention      {self.kernels}")
        lines += [other.describe_rank() for other in self.other_ranks]
        if self.other_ranks:
            most = max(other.needed_bytes for other in self.other_ranks)
            rows = [plan.vocab_rows[1] - plan.vocab_rows[0] for plan in (self, *self.other_ranks)]
            tower = next((plan.rank for plan in (self, *self.other_ranks) if plan.weights["vision"]), None)
            holds = "the joint head" + (f", rank {tower} the vision tower" if tower is not None else "")
            where = "in host memory" if self.vocab_tables == "host" else "on the cards"
            lines.append(
                f"  balance        rank 0 needs {self.needed_bytes / most:.2f}x the most loaded other rank before the "
                f"cache: rank 0 holds {holds}; the {sum(rows):,} vocabulary rows {where}: "
                + " / ".join(f"{n:,}" for n in rows)
            )
        lines.append(f"  fits: {'yes' if self.fits else 'NO: ' + self.problem}")
        return "\n".join(lines)

    def describe_rank(self) -> str:
        """One line for a tensor-parallel rank other than 0 (it holds rank 0's cache)."""
        parts = ", ".join(f"{part} {_size(n)}" for part, n in self.weights.items() if n)
        line = (
            f"  rank {self.rank:<9d} {_size(self.weight_bytes):>10}  weights ({parts}); load peak "
            f"{_size(self.load_peak_bytes)}, {_size(self.needed_bytes)} before the cache"
        )
        if self.vision_activation_bytes:
            line += (
                f" (the vision tower's step {_size(self.vision_activation_bytes)} for one {self.image_patches}-patch "
                "image)"
            )
        if self.host_table_bytes:
            line += f", {_size(self.host_table_bytes)} of table rows in host memory"
        if self.problem is not None:
            return line + f": does NOT fit: {self.problem}"
        if self.cache is None:
            return line + "; its load fits (rank 0 does not fit)"
        spare = self.device_bytes - self.needed_bytes - self.cache.allocated_bytes
        return line + f"; rank 0's cache fits, {_size(spare)} to spare"

    def summary(self) -> str:
        """One line for the start-up error and the log."""
        needed = self.weight_bytes + self.scratch_bytes + self.activation_bytes + self.overhead_bytes
        return (
            f"{self.release} in {str(self.dtype).removeprefix('torch.')}"
            f"{' with int8 weights' if self.quantize == 'int8' else ''} needs {needed / GiB:.2f} GiB before its "
            f"cache (weights {self.weight_bytes / GiB:.2f} GiB) of the {self.device_bytes / GiB:.2f} GiB {self.where}"
        )


def plan_serving(
    release: str | Path,
    config: ReleaseConfig,
    engine_config,
    device_bytes: int,
    *,
    dtype: torch.dtype,
    quantize: str = "none",
    on_gpu: bool,
    where: str,
    head_dtype: torch.dtype = torch.float32,
    reserved_bytes: int = 0,
    vocab_tables: str = "device",
    context_counted: bool = True,
    image_max_pixels: int | None = None,
    rank: int = 0,
    ranks: int = 1,
    vocab_rows: tuple[int, int] | None = None,
) -> ServingPlan:
    """The plan for `release` (config, headers and processor settings only) on `device_bytes` of memory, with
    the engine's settings `engine_config` (an EngineConfig). context_counted: device_bytes is a card's total
    (the CUDA context still to come out of it), not a live device's free memory. image_max_pixels: the resize
    budget per image (default: the release's processor's). rank, ranks: one tensor-parallel rank's plan alone
    (config: its local config; plan_tensor_parallel plans them together): its `vocab_rows` of the vocabulary
    tables; the head, `reserved_bytes` and a step's image features on rank 0 only, the tower and its
    activations on its rank only (tower_rank). The vision cache is device memory on one card; under tensor
    parallel the features come back to rank 0's host memory and the cache keeps them there."""
    release = Path(release)
    if engine_config.max_model_len is None:  # the engine's default: the release's, as Engine resolves it
        engine_config = dataclasses.replace(engine_config, max_model_len=context_length(config.trunk, None))
    release_vision = release_has_vision(config, release_headers(release))
    has_vision = release_vision and rank == tower_rank(ranks)
    weights = planned_weights(
        config, dtype, quantize, head_dtype, release_vision, vocab_tables, rank, ranks, vocab_rows
    )
    host_tables = planned_host_tables(config, dtype, quantize, vocab_rows) if vocab_tables == "host" else 0
    reserved_bytes = reserved_bytes if rank == 0 else 0
    scratch = largest_quantized_weight(config) * dtype_bytes(dtype) if quantize == "int8" else 0
    # Loading's peak beyond the weights: the trunk fuses each layer's projections into one weight (the parts and
    # the fused copy exist at once: the largest fused layer again), and int8 quantizes a block at a time.
    fused = largest_quantized_weight(config) * (1 if quantize == "int8" else dtype_bytes(dtype))
    transient = fused + (QUANTIZE_TRANSIENT_BYTES if quantize == "int8" else 0)
    tokens = engine_config.max_num_seqs * engine_config.prefill_chunk_size
    trunk_step = step_activation_bytes(config.trunk, dtype, tokens, engine_config.max_num_seqs)
    vision_step = patches = 0
    if has_vision:
        processor = load_processor_config(release)
        max_pixels = image_max_pixels or (processor.max_pixels if processor is not None else 16 * 2**20)
        patches = max_pixels // config.vision.patch_size**2
        video = load_video_processor_config(release)
        if video is not None:  # the tower runs a video a group of frames at a time: at most this many patches
            patches = max(patches, video.max_input_patches)
        vision_step = vision_peak_bytes(config.vision, dtype, patches)
    features = image_feature_bytes(config.trunk, dtype, tokens) if release_vision and rank == 0 else 0
    activations = max(trunk_step, vision_step) + features
    overhead = (CUDA_WORKSPACE_BYTES + (CUDA_CONTEXT_BYTES if context_counted else 0)) if on_gpu else HOST_RUNTIME_BYTES
    reserved = reserved_bytes + (engine_config.vision_cache_bytes if has_vision and ranks == 1 else 0)
    if engine_config.shadow.enabled:  # a shadow run's own slot, KV blocks and reference scores
        reserved += shadow_run_bytes(config.trunk, dtype, engine_config.max_model_len, activations)
    free = device_bytes - sum(weights.values()) - scratch - overhead - reserved
    cache, problem = None, None
    if sum(weights.values()) + transient + overhead > device_bytes:
        problem = (
            f"loading needs {(sum(weights.values()) + transient + overhead) / GiB:.2f} GiB at its peak (the weights, "
            f"what quantizing adds at once, the CUDA overhead)"
        )
    elif free <= 0:
        problem = f"the weights and what is reserved beside them need {(device_bytes - free) / GiB:.2f} GiB"
    else:
        try:
            # the most of the free memory the cache can have: what one step's activations leave
            max_fraction = math.floor(100 * max(0.0, 1 - activations / free)) / 100
            remedies = tuple(
                remedy
                for remedy, applies in (
                    ("--quantize int8", quantize != "int8"),
                    ("--vocab-tables host", on_gpu and vocab_tables == "device"),
                    ("--max-num-seqs 1", engine_config.max_num_seqs > 1),
                    ("a smaller --image-max-pixels (the tower's step is the largest)", vision_step > trunk_step),
                    ("--tensor-parallel-size 2", ranks == 1),
                )
                if applies
            )
            cache = plan_cache(config.trunk, dtype, engine_config, free, "planned", max_fraction, remedies)
        except ValueError as error:
            problem = str(error)
        if problem is None and activations > (1 - engine_config.kv_fraction) * free:
            problem = (
                f"one step's activations ({activations / GiB:.2f} GiB) do not fit beside a --kv-fraction "
                f"{engine_config.kv_fraction} cache; lower --prefill-chunk-size or --max-num-seqs"
                + (", or --image-max-pixels" if vision_step > trunk_step else "")
            )
    return ServingPlan(
        str(release),
        where,
        device_bytes,
        dtype,
        quantize,
        weights,
        scratch,
        activations,
        tokens,
        overhead,
        reserved,
        cache,
        problem,
        engine_config.block_size,
        engine_config.max_model_len,
        vocab_tables=vocab_tables,
        host_table_bytes=host_tables,
        load_transient_bytes=transient,
        trunk_activation_bytes=trunk_step,
        vision_activation_bytes=vision_step,
        feature_bytes=features,
        image_patches=patches,
        context_counted=context_counted,
        on_gpu=on_gpu,
        rank=rank,
        ranks=ranks,
        vocab_rows=vocab_rows,
    )


def auto_vocab_tables(on_device: ServingPlan, hosted: ServingPlan) -> tuple[ServingPlan, str | None]:
    """--vocab-tables auto on a GPU, given the plan with the tables on the device and the one with them in host
    memory: host when only that fits, or when the cache then holds more KV blocks (a step copies over at most
    its tokens' rows, a few milliseconds beside its GEMMs; a card with room to spare keeps the tables, since
    the cache never grows past what the running records can use and both plans hold as many blocks). Returns
    the plan chosen and why it is the host one (None: the device one)."""
    if not hosted.fits or (on_device.fits and hosted.cache.num_blocks <= on_device.cache.num_blocks):
        return on_device, None
    if not on_device.fits:
        return hosted, "the plan fits only so"
    return hosted, f"the cache holds {hosted.cache.num_blocks} KV blocks instead of {on_device.cache.num_blocks}"


def plan_tensor_parallel(
    release: str | Path, config: ReleaseConfig, engine_config, device_bytes: int, ranks: int, **options
) -> ServingPlan:
    """`ranks` cards of device_bytes each (config: the whole release's): rank 0's plan, the other ranks' in its
    other_ranks. Every rank allocates the state slots and KV blocks rank 0's plan sizes (the engine sizes them
    on rank 0; a rank's own --kv-fraction split does not matter), so a rank fits when its load fits and its
    weights, that cache and a step's activations do; the first rank that does not is rank 0's problem.
    options: plan_serving's."""
    from clef_cuda.model.shard import local_config

    local = dataclasses.replace(config, trunk=local_config(config.trunk, ranks))
    has_vision = release_has_vision(config, release_headers(Path(release)))
    quantize, head_dtype = options.get("quantize", "none"), options.get("head_dtype", torch.float32)
    split = vocab_split(config, options["dtype"], quantize, head_dtype, has_vision, ranks)
    first, *others = (
        plan_serving(release, local, engine_config, device_bytes, rank=r, ranks=ranks, vocab_rows=rows, **options)
        for r, rows in enumerate(split)
    )
    checked = []
    for other in others:
        problem = None
        if other.load_peak_bytes > other.device_bytes:
            problem = f"loading needs {other.load_peak_bytes / GiB:.2f} GiB at its peak"
        elif first.cache is not None and other.device_bytes < other.needed_bytes + first.cache.allocated_bytes:
            short = other.needed_bytes + first.cache.allocated_bytes - other.device_bytes
            problem = f"it cannot hold rank 0's cache beside its weights and a step ({short / GiB:.2f} GiB short)"
        other = dataclasses.replace(other, cache=first.cache, problem=problem)
        checked.append(other)
        if first.problem is None and problem is not None:
            first = dataclasses.replace(first, problem=f"rank {other.rank}: {problem}")
    return dataclasses.replace(first, other_ranks=tuple(checked))
