"""The memory plan: what a release needs on a device before anything loads, and how the cache budget is
split once it has.

`plan_serving` reads only the release's config.json and safetensors headers: weights by part (int8 or
not), the int8 dequantize scratch, one step's activations, an allowance for the CUDA context, then the
cache --kv-fraction buys from what is left (state slots and KV blocks, as the engine will split it). It
fits when the weights leave room for one full-length record's cache and the step's activations.
`clef-serve --plan` prints it (exit 0 fits, 3 does not); at start-up the same plan runs against the
device and a model that cannot fit is a one-line error (exit 2) that names the numbers and says
whether int8 weights would fit. `plan_cache` is the split the engine applies to the measured free
memory after loading.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from clef_cuda.model.config import ReleaseConfig, TrunkConfig
from clef_cuda.model.footprint import dtype_bytes, largest_quantized_weight, planned_weights, release_has_vision
from clef_cuda.model.trunk_cache import TrunkCache
from clef_cuda.model.weights import release_headers

GiB = 2**30
MiB = 2**20
# CUDA context, cuBLAS/cuDNN workspaces and allocator slack: an allowance (not measured here; a GPU run of
# scripts/gpu_check.sh prints the real figure).
CUDA_OVERHEAD_BYTES = 768 * MiB
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

    def describe(self, block_size: int, max_model_len: int) -> str:
        tokens = self.num_blocks * block_size
        allocated = self.num_blocks * self.block_bytes + (self.running_slots + self.snapshot_slots) * self.slot_bytes
        return (
            f"cache: {allocated / MiB:.0f} MiB allocated of a {self.budget_bytes / MiB:.0f} MiB budget: "
            f"{self.num_blocks} KV blocks x {block_size} = {tokens} tokens ({tokens / max_model_len:.1f} records of "
            f"{max_model_len}); {self.running_slots} running state slots + {self.snapshot_slots} prefix snapshots "
            f"({self.slot_bytes / MiB:.2f} MiB each)"
        )


def plan_cache(trunk: TrunkConfig, dtype: torch.dtype, config, free_bytes: int, where: str = "device") -> CachePlan:
    """Split kv_fraction of `free_bytes` (config: the engine's EngineConfig) into running state slots,
    prefix snapshots and KV blocks. ValueError when it cannot hold one max_model_len record."""
    budget = int(config.kv_fraction * max(0, free_bytes))
    slot_bytes = TrunkCache.slot_bytes(trunk, dtype)
    block_bytes = max(1, TrunkCache.block_bytes(trunk, dtype, config.block_size))
    blocks_per_record = -(-config.max_model_len // config.block_size)
    running = config.max_num_seqs
    snapshot_budget = int(config.snapshot_fraction * budget) if config.prefix_cache else 0
    snapshots = min(config.max_snapshots, snapshot_budget // max(slot_bytes, 1)) if config.prefix_cache else 0
    blocks = (budget - running * slot_bytes - snapshots * slot_bytes) // block_bytes
    # More blocks than every running record at full length plus as much again for cached prefixes can
    # never be used: do not allocate (and, on the CPU, commit) them.
    blocks = int(min(blocks, 2 * running * blocks_per_record))
    if blocks < blocks_per_record:
        raise ValueError(
            f"--kv-fraction {config.kv_fraction} of the free {where} memory ({free_bytes / GiB:.1f} GiB) leaves "
            f"room for {max(blocks, 0)} KV blocks, fewer than one {config.max_model_len}-token record needs "
            f"({blocks_per_record}); raise --kv-fraction or lower --max-model-len"
        )
    return CachePlan(budget, slot_bytes, block_bytes, running, snapshots, blocks, snapshot_budget)


def step_activation_bytes(trunk: TrunkConfig, dtype: torch.dtype, tokens: int) -> int:
    """The largest temporaries of one trunk step over `tokens` packed tokens (an estimate from the trunk's
    code: the fp32 residual stream and its norms, plus the widest layer's projections and fp32 copies)."""
    c, width = trunk, dtype_bytes(dtype)
    residual = 3 * tokens * c.hidden_size * 4  # x, its fp32 norm, the layer's fp32 output
    mlp = tokens * 2 * c.intermediate_size * width
    layers = [mlp]
    if c.linear_layers:
        in_proj = c.conv_dim + c.value_dim + 2 * c.linear_num_value_heads
        layers.append(tokens * (in_proj + c.conv_dim) * width + 4 * tokens * c.value_dim * 4)
    if c.attention_layers:
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        layers.append(tokens * (2 * q + 2 * kv) * width + 2 * tokens * (2 * q + 2 * kv) * 4)
    return residual + max(layers)


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
    overhead_bytes: int  # CUDA context allowance (0 on the CPU)
    reserved_bytes: int  # adapters' pool, the vision cache
    cache: CachePlan | None  # None when the weights leave too little
    problem: str | None  # why it does not fit (None: it fits)
    block_size: int
    max_model_len: int
    kernels: str | None = None  # the attention tiles of the device planned on, when it is a real GPU

    @property
    def fits(self) -> bool:
        return self.problem is None

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    def describe(self) -> str:
        gib = _size
        kind = "int8 weights (W8A16), " if self.quantize == "int8" else ""
        dtype = str(self.dtype).removeprefix("torch.")
        parts = ", ".join(f"{part} {gib(n)}" for part, n in self.weights.items() if n)
        lines = [
            f"memory plan: {self.release} on {gib(self.device_bytes)} ({self.where}), {kind}{dtype} activations",
            f"  weights        {gib(self.weight_bytes):>10}  ({parts})",
        ]
        if self.scratch_bytes:
            lines.append(f"  int8 scratch   {gib(self.scratch_bytes):>10}  (the largest fused layer, dequantized)")
        lines.append(f"  activations    {gib(self.activation_bytes):>10}  (one step: {self.step_tokens} tokens)")
        if self.overhead_bytes:
            lines.append(f"  CUDA overhead  {gib(self.overhead_bytes):>10}  (context and workspaces: an allowance)")
        if self.reserved_bytes:
            lines.append(f"  reserved       {gib(self.reserved_bytes):>10}  (adapter pool, vision cache)")
        if self.cache is not None:
            lines.append(f"  {self.cache.describe(self.block_size, self.max_model_len)}")
        if self.kernels:
            lines.append(f"  attention      {self.kernels}")
        lines.append(f"  fits: {'yes' if self.fits else 'NO: ' + self.problem}")
        return "\n".join(lines)

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
) -> ServingPlan:
    """The plan for `release` (config and headers only) on `device_bytes` of memory, with the engine's
    settings `engine_config` (an EngineConfig)."""
    has_vision = release_has_vision(config, release_headers(Path(release)))
    weights = planned_weights(config, dtype, quantize, head_dtype, has_vision=has_vision)
    scratch = largest_quantized_weight(config) * dtype_bytes(dtype) if quantize == "int8" else 0
    tokens = engine_config.max_num_seqs * engine_config.prefill_chunk_size
    activations = step_activation_bytes(config.trunk, dtype, tokens)
    overhead = CUDA_OVERHEAD_BYTES if on_gpu else 0
    reserved = reserved_bytes + (engine_config.vision_cache_bytes if has_vision else 0)
    free = device_bytes - sum(weights.values()) - scratch - overhead - reserved
    cache, problem = None, None
    if free <= 0:
        problem = f"the weights and what is reserved beside them need {(device_bytes - free) / GiB:.2f} GiB"
    else:
        try:
            cache = plan_cache(config.trunk, dtype, engine_config, free, "planned")
        except ValueError as error:
            problem = str(error)
        if problem is None and activations > (1 - engine_config.kv_fraction) * free:
            problem = (
                f"one step's activations ({activations / GiB:.2f} GiB) do not fit beside a --kv-fraction "
                f"{engine_config.kv_fraction} cache; lower --prefill-chunk-size or --max-num-seqs"
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
    )
