"""Fine-tuned variants over one trunk: clef-finetune's LoRA checkpoints and their joint heads, served
unmerged (shared/specs/adapters.md).

A variant is a checkpoint directory: adapter/adapter_config.json + adapter/adapter_model.safetensors
(peft LoRA) and joint_head.safetensors (a whole head). Only JSON and safetensors are read: the directory's
training_state.pt (a pickle) and any Python file are never opened. Every rule a checkpoint can break is a
one-line AdapterError naming the file and the field or tensor.

The math on our fused GEMMs: peft's y = x W^T + s (x A^T) B^T adds, for a LoRA on one part of a fused
weight (in_proj = qkv|z|b|a, qkv_proj = q|k|v, gate_up = gate|up), only to that part's columns:
y[:, off:off + n] += (x A^T)(s B)^T. The A's of one fused weight are stacked, so one shrink GEMM (fp32:
the rank-r intermediate keeps its precision) feeds one expand per adapted part; s is folded into B at
load. Rows of the base model get nothing added: today's arithmetic, bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from clef_cuda.errors import ClefError
from clef_cuda.model.config import FULL_ATTENTION, LINEAR_ATTENTION, ReleaseConfig, TrunkConfig, read_json_object

log = logging.getLogger("clef_cuda.model.adapters")
Tensor = torch.Tensor

ADAPTER_DIR = "adapter"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
HEAD_FILE = "joint_head.safetensors"
# peft's key grammar for clef-finetune's targets (a text-only training run drops "language_model.").
KEY = re.compile(
    r"base_model\.model\.model\.(?:language_model\.)?layers\.(\d+)\."
    r"(linear_attn|self_attn|mlp)\."
    r"(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj|q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    r"\.lora_([AB])\.weight"
)
MIXER_MODULES = {
    "linear_attn": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
# peft options that change the math this module implements: refused when set.
REFUSED_OPTIONS = {
    "use_dora": "DoRA",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "BD-LoRA",
    "lora_bias": "LoRA biases",
    "fan_in_fan_out": "fan_in_fan_out weights",
    "layer_replication": "layer replication",
    "target_parameters": "parameter targets",
    "alora_invocation_tokens": "activated LoRA",
    "trainable_token_indices": "trainable tokens",
}
# A variant's name is a routing key that clients send as `model` and that the log prints, never a path:
# what a model name looks like (letters, digits, ._-:/), each /-separated part starting with a letter or a
# digit (so no "..", no leading or doubled "/"), at most 128 characters, no whitespace or control characters.
VARIANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*(?:/[A-Za-z0-9][A-Za-z0-9._:-]*)*")
VARIANT_NAME_MAX = 128


def check_variant_name(name: str) -> None:
    """ValueError naming what is wrong with a variant name (--adapter NAME=DIR, load_lora_adapter's lora_name)."""
    if len(name) > VARIANT_NAME_MAX:
        raise ValueError(
            f"the variant name {name[:40]!r}... is {len(name)} characters long (at most {VARIANT_NAME_MAX})"
        )
    if not VARIANT_NAME.fullmatch(name):
        raise ValueError(
            f"the variant name {name!r} is not a model name: letters, digits and ._-:/ only, each /-separated "
            "part starting with a letter or a digit"
        )


class AdapterError(ClefError):
    """A variant directory that cannot be served (exit 2 at start-up, HTTP 400 at runtime). The message
    names the file and the field or tensor."""


@dataclass(frozen=True)
class FusedSlot:
    """Where one checkpoint module's output lands in our trunk: fused weight, column offset, width."""

    fused: str  # in_proj | out_proj | qkv_proj | o_proj | gate_up | down
    offset: int
    width: int
    in_features: int


def module_slots(config: TrunkConfig, kind: str) -> dict[str, FusedSlot]:
    """Checkpoint module name -> its slot, for a layer of `kind` (the mixer's modules and the MLP's)."""
    h, i = config.hidden_size, config.intermediate_size
    slots = {
        "gate_proj": FusedSlot("gate_up", 0, i, h),
        "up_proj": FusedSlot("gate_up", i, i, h),
        "down_proj": FusedSlot("down", 0, h, i),
    }
    if kind == LINEAR_ATTENTION:
        hv = config.linear_num_value_heads
        offsets = [0, config.conv_dim, config.conv_dim + config.value_dim, config.conv_dim + config.value_dim + hv]
        widths = [config.conv_dim, config.value_dim, hv, hv]
        for name, offset, width in zip(
            ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), offsets, widths, strict=True
        ):
            slots[name] = FusedSlot("in_proj", offset, width, h)
        slots["out_proj"] = FusedSlot("out_proj", 0, h, config.value_dim)
    else:
        d, hq, hkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        slots["q_proj"] = FusedSlot("qkv_proj", 0, hq * 2 * d, h)  # per head: query | gate (peft's row order)
        slots["k_proj"] = FusedSlot("qkv_proj", hq * 2 * d, hkv * d, h)
        slots["v_proj"] = FusedSlot("qkv_proj", hq * 2 * d + hkv * d, hkv * d, h)
        slots["o_proj"] = FusedSlot("o_proj", 0, h, hq * d)
    return slots


@dataclass
class FusedDelta:
    """Every LoRA on one fused weight of one layer: the stacked shrink and one expand per adapted part."""

    shrink: Tensor  # [sum of ranks, in] fp32: A's stacked
    parts: list[tuple[int, int, int, int, Tensor]]  # (column offset, width, rank start, rank end, s B [width, r])

    def add_to(self, y: Tensor, x: Tensor) -> None:
        """y [n, out] (a fused GEMM's output for rows x [n, in]) += this delta, in place."""
        low = F.linear(x.float(), self.shrink)  # fp32
        for offset, width, r0, r1, expand in self.parts:
            # addmm_ into the column slice: no temporary, one pass (1.5x the speed of a separate add)
            y[:, offset : offset + width].addmm_(low[:, r0:r1].to(expand.dtype), expand.t())


@dataclass
class Adapter:
    """One loaded variant: its deltas per (layer, fused weight), its head and its content digest."""

    name: str
    digest: bytes  # sha256 of the adapter config and both safetensors: what the caches key on
    deltas: dict[tuple[int, str], FusedDelta]
    head: object  # JointSchemaHead (shared with other variants whose head bytes are equal)
    head_digest: bytes
    rank: int
    bytes: int  # device memory of the deltas (the head's is counted by the registry, once per distinct head)
    modules: int
    # In-flight requests using it; an unloaded variant is freed when this falls to 0.
    users: int = 0
    unloaded: bool = False


def _read_json(path: Path) -> dict:
    return read_json_object(path, AdapterError)


def _check_directory(directory: Path) -> None:
    if not directory.is_dir():
        raise AdapterError(f"{directory}: not a directory (expected a clef-finetune checkpoint-N directory)")
    if (directory / ADAPTER_DIR).is_dir():
        return
    if (directory / "config.json").is_file() and any(directory.glob("model*.safetensors")):
        raise AdapterError(f"{directory}: a merged release, not an adapter checkpoint; serve it with --w")
    checkpoints = sorted(directory.glob("checkpoint-*"))
    if checkpoints:
        raise AdapterError(
            f"{directory}: a training run directory; point at one of its checkpoints, e.g. {checkpoints[-1]}"
        )
    raise AdapterError(f"{directory}: no {ADAPTER_DIR}/ directory (expected a clef-finetune checkpoint-N directory)")


def _scale(config: dict, path: Path, max_rank: int) -> tuple[int, float]:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: field 'peft_type' is {config.get('peft_type')!r}; only LORA adapters are served")
    for option, what in REFUSED_OPTIONS.items():
        if config.get(option) not in (None, False, [], {}, ""):
            raise AdapterError(f"{path}: field '{option}' is set: {what} is not supported")
    if config.get("modules_to_save"):
        raise AdapterError(f"{path}: field 'modules_to_save' is set: fully trained modules are not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{path}: field 'bias' is {config.get('bias')!r}; only 'none' is supported")
    for pattern in ("rank_pattern", "alpha_pattern"):
        if config.get(pattern):
            raise AdapterError(f"{path}: field '{pattern}' is not empty: per-module ranks are not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise AdapterError(f"{path}: field 'r' must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{path}: field 'r' is {rank}, over --max-adapter-rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise AdapterError(f"{path}: field 'lora_alpha' must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def _sha256(*paths: Path) -> bytes:
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.digest()


def _safetensors(path: Path) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise AdapterError(f"{path}: missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise AdapterError(f"{path}: not a readable safetensors file ({error})") from error


def load_adapter_tensors(
    directory: Path, base: ReleaseConfig, max_rank: int
) -> tuple[dict[tuple[int, str], dict[str, Tensor]], int, float, bytes, Path]:
    """Checks and reads a checkpoint's LoRA: ({(layer, module): {"A", "B"}} fp32, rank, scale, digest,
    head path). AdapterError for anything the rules refuse."""
    _check_directory(directory)
    config_path = directory / ADAPTER_DIR / ADAPTER_CONFIG
    weights_path = directory / ADAPTER_DIR / ADAPTER_WEIGHTS
    head_path = directory / HEAD_FILE
    rank, scale = _scale(_read_json(config_path), config_path, max_rank)
    tensors = _safetensors(weights_path)
    trunk = base.trunk
    pairs: dict[tuple[int, str], dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        match = KEY.fullmatch(key)
        if match is None:
            raise AdapterError(
                f"{weights_path}: tensor {key} is outside what clef serves (LoRA A/B of text-decoder linear layers)"
            )
        layer, mixer, module, which = int(match[1]), match[2], match[3], match[4]
        if layer >= trunk.num_layers:
            raise AdapterError(
                f"{weights_path}: tensor {key}: layer {layer} does not exist (the base has {trunk.num_layers})"
            )
        kind = trunk.layer_types[layer]
        expected_mixer = "linear_attn" if kind == LINEAR_ATTENTION else "self_attn"
        if mixer not in ("mlp", expected_mixer) or module not in MIXER_MODULES[mixer]:
            raise AdapterError(
                f"{weights_path}: tensor {key}: layer {layer} of the base is {kind}, it has no {mixer}.{module}"
            )
        slot = module_slots(trunk, kind)[module]
        shape = (rank, slot.in_features) if which == "A" else (slot.width, rank)
        if tuple(tensor.shape) != shape:
            raise AdapterError(f"{weights_path}: tensor {key} has shape {list(tensor.shape)}, expected {list(shape)}")
        if not tensor.is_floating_point() or not torch.isfinite(tensor).all():
            raise AdapterError(f"{weights_path}: tensor {key} is not finite floating-point data")
        pairs.setdefault((layer, module), {})[which] = tensor.float()
    if not pairs:
        raise AdapterError(f"{weights_path}: holds no LoRA tensors")
    for (layer, module), pair in pairs.items():
        for which in "AB":
            if which not in pair:
                raise AdapterError(f"{weights_path}: layer {layer} {module} has no lora_{which} (an A needs its B)")
    if all(not pair["B"].any() for pair in pairs.values()):
        log.warning("%s: every lora_B is zero: this adapter changes nothing (untrained?)", weights_path)
    _warn_on_revision(directory, base)
    if not head_path.is_file():
        raise AdapterError(f"{head_path}: missing (a clef-finetune checkpoint carries its joint head)")
    return pairs, rank, scale, _sha256(config_path, weights_path, head_path), head_path


def _warn_on_revision(directory: Path, base: ReleaseConfig) -> None:
    """train_config.json is provenance: a mismatch is a warning, not an error."""
    path = directory / "train_config.json"
    if not path.is_file():
        return
    try:
        model = json.loads(path.read_text(encoding="utf-8")).get("model") or {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        log.warning("%s: unreadable provenance (ignored)", path)
        return
    revision = model.get("revision") if isinstance(model, dict) else None
    served = base.revision
    if revision and served and revision != served:
        log.warning("%s: trained on revision %s of the base, serving revision %s", path, revision, served)


def build_deltas(
    pairs: dict[tuple[int, str], dict[str, Tensor]], trunk: TrunkConfig, scale: float, device, dtype
) -> dict[tuple[int, str], FusedDelta]:
    """Stack the A's of each fused weight (fp32) and fold the scale into the B's (serving dtype)."""
    by_fused: dict[tuple[int, str], list[tuple[FusedSlot, Tensor, Tensor]]] = {}
    for (layer, module), pair in sorted(pairs.items()):
        slot = module_slots(trunk, trunk.layer_types[layer])[module]
        by_fused.setdefault((layer, slot.fused), []).append((slot, pair["A"], pair["B"]))
    deltas = {}
    for key, entries in by_fused.items():
        entries.sort(key=lambda entry: entry[0].offset)  # the shrink's rank rows in the parts' order
        parts, r0 = [], 0
        for slot, a, b in entries:
            parts.append((slot.offset, slot.width, r0, r0 + a.shape[0], (b * scale).to(device, dtype)))
            r0 += a.shape[0]
        shrink = torch.cat([a for _, a, _ in entries]).to(device, torch.float32)
        deltas[key] = FusedDelta(shrink, parts)
    return deltas


@dataclass
class AdapterBatch:
    """The variants of one packed step: (row start, row end, adapter) per contiguous run of rows."""

    segments: list[tuple[int, int, Adapter]] = field(default_factory=list)

    def apply(self, y: Tensor, x: Tensor, layer: int, fused: str) -> None:
        for start, end, adapter in self.segments:
            delta = adapter.deltas.get((layer, fused))
            if delta is not None:
                delta.add_to(y[start:end], x[start:end])


def adapter_pool_bytes(base: ReleaseConfig, dtype, max_adapters: int, max_rank: int, head_dtype=torch.float32) -> int:
    """Device bytes of max_adapters variants at max_rank over `base`: their LoRA factors (per rank unit,
    every module of every layer: A in fp32, s B in the serving dtype) and their joint heads."""
    from clef_cuda.model.weights import head_shapes

    layers = {kind: base.trunk.layer_types.count(kind) for kind in (LINEAR_ATTENTION, FULL_ATTENTION)}
    per_rank = sum(
        layers[kind]
        * sum(
            4 * s.in_features + torch.finfo(dtype).bits // 8 * s.width for s in module_slots(base.trunk, kind).values()
        )
        for kind in layers
    )
    head = sum(math.prod(shape) for shape in head_shapes(base.head).values()) * torch.finfo(head_dtype).bits // 8
    return max_adapters * (max_rank * per_rank + head)


class AdapterRegistry:
    """The variants a server holds, by name: loaded at start-up or at runtime, at most `max_adapters`.
    Heads with equal bytes are stored once. Unloading hides a variant from new requests at once; its
    memory goes when the last in-flight request using it finishes."""

    def __init__(
        self,
        base: ReleaseConfig,
        lm_head: Tensor,
        dtype,
        *,
        max_adapters: int = 8,
        max_rank: int = 64,
        head_dtype=torch.float32,
    ) -> None:
        self.base, self.lm_head, self.dtype = base, lm_head, dtype
        self.max_adapters, self.max_rank, self.head_dtype = max_adapters, max_rank, head_dtype
        self._adapters: dict[str, Adapter] = {}
        self._heads: dict[bytes, tuple[object, int]] = {}  # head digest -> (head, variants using it)
        self._lock = threading.Lock()
        self.loads = {"ok": 0, "error": 0}

    @property
    def device(self):
        return self.lm_head.device

    def names(self) -> list[str]:
        with self._lock:
            return [name for name, a in self._adapters.items() if not a.unloaded]

    def get(self, name: str) -> Adapter | None:
        with self._lock:
            adapter = self._adapters.get(name)
            return None if adapter is None or adapter.unloaded else adapter

    def bytes(self) -> int:
        with self._lock:
            heads = {digest: head for digest, (head, _) in self._heads.items()}
            return sum(a.bytes for a in self._adapters.values()) + sum(_head_bytes(h) for h in heads.values())

    def pool_bytes(self) -> int:
        """What max_adapters variants at max_rank can take on the device: reserved before the KV budget."""
        return adapter_pool_bytes(self.base, self.dtype, self.max_adapters, self.max_rank, self.head_dtype)

    def load(self, name: str, directory: Path) -> Adapter:
        """Load a variant under a free name. AdapterError leaves what was served as it was."""
        from clef_cuda.model.head import JointSchemaHead
        from clef_cuda.model.weights import head_shapes

        try:
            with self._lock:
                if name in self._adapters:
                    raise AdapterError(f"{directory}: a variant named {name!r} is loaded already (unload it first)")
                live = [a for a in self._adapters.values() if not a.unloaded]
                if len(live) >= self.max_adapters:
                    raise AdapterError(f"{directory}: {self.max_adapters} adapters are loaded already (--max-adapters)")
            pairs, rank, scale, digest, head_path = load_adapter_tensors(Path(directory), self.base, self.max_rank)
            head_tensors = _safetensors(head_path)
            expected = head_shapes(self.base.head)
            for key in head_tensors:
                if key not in expected:
                    raise AdapterError(f"{head_path}: unexpected tensor {key} (not part of the base's joint head)")
            for key, shape in expected.items():
                if key not in head_tensors:
                    raise AdapterError(f"{head_path}: missing tensor {key}")
                if tuple(head_tensors[key].shape) != shape:
                    raise AdapterError(
                        f"{head_path}: tensor {key} has shape {list(head_tensors[key].shape)}, expected {list(shape)}"
                    )
                if not torch.isfinite(head_tensors[key]).all():
                    raise AdapterError(f"{head_path}: tensor {key} is not finite")
            head_digest = _sha256(head_path)
            deltas = build_deltas(pairs, self.base.trunk, scale, self.device, self.dtype)
        except AdapterError:
            self.loads["error"] += 1
            raise
        size = sum(
            d.shrink.numel() * 4 + sum(p[4].numel() * p[4].element_size() for p in d.parts) for d in deltas.values()
        )
        with self._lock:
            shared = self._heads.get(head_digest)
            if shared is None:
                weights = {k: v.to(self.device, self.head_dtype) for k, v in head_tensors.items()}
                shared = (JointSchemaHead(self.base.head, weights, self.lm_head), 0)
            self._heads[head_digest] = (shared[0], shared[1] + 1)
            adapter = Adapter(name, digest, deltas, shared[0], head_digest, rank, size, len(pairs))
            self._adapters[name] = adapter
            self.loads["ok"] += 1
        log.info(
            "adapter %s: rank %d, %d modules, %.1f MiB (+ its head), from %s",
            name,
            rank,
            len(pairs),
            size / 2**20,
            directory,
        )
        return adapter

    def unload(self, name: str) -> Adapter | None:
        """Hide the variant from new requests at once; None when no such variant is loaded."""
        with self._lock:
            adapter = self._adapters.get(name)
            if adapter is None or adapter.unloaded:
                return None
            self._retire(adapter)
            return adapter

    def _retire(self, adapter: Adapter) -> None:
        """Under the lock: hide it; free it now or when its last in-flight request finishes."""
        adapter.unloaded = True
        if self._adapters.get(adapter.name) is adapter:
            del self._adapters[adapter.name]
        if adapter.users == 0:
            self._free(adapter)

    def _free(self, adapter: Adapter) -> None:
        head, count = self._heads[adapter.head_digest]
        if count <= 1:
            del self._heads[adapter.head_digest]
        else:
            self._heads[adapter.head_digest] = (head, count - 1)
        adapter.deltas = {}

    def acquire(self, name: str) -> Adapter | None:
        """The live variant `name`, held for one request (None: not served)."""
        with self._lock:
            adapter = self._adapters.get(name)
            if adapter is None or adapter.unloaded:
                return None
            adapter.users += 1
            return adapter

    def hold(self, adapter: Adapter) -> None:
        """One more holder of an adapter the caller already holds (a shadow sample of its request)."""
        with self._lock:
            adapter.users += 1

    def release(self, adapter: Adapter) -> None:
        with self._lock:
            adapter.users -= 1
            if adapter.unloaded and adapter.users == 0:
                self._free(adapter)


def _head_bytes(head) -> int:
    return sum(t.numel() * t.element_size() for t in head.w.values())
