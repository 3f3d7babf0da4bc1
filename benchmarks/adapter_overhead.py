#!/usr/bin/env python3
"""What serving fine-tuned variants unmerged costs a trunk step: the torch segment loop of
clef_cuda.model.adapters on the mid release's shapes (hidden 1024, 8 layers, ~130M parameters), one packed step
of 4 records x 256 tokens, with the base only vs 1, 2 and 4 distinct variants at rank 16 and 64 (every
module adapted: the worst case), plus each variant's memory. The goal: at most 5% over the base step at
rank 16 with 4 variants (else the segment loop earns a fused op in csrc/). Runs interleaved, medians.
Table last.

    python benchmarks/adapter_overhead.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

RECORDS, TOKENS = 4, 256


def synthetic_adapter(base: Path, out: Path, config, rank: int, seed: int) -> Path:
    """A peft-format checkpoint with random A and B on every module (what clef-finetune would write)."""
    import shutil

    from safetensors.torch import save_file

    from clef_cuda.model.adapters import module_slots

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer, kind in enumerate(config.trunk.layer_types):
        mixer = "linear_attn" if kind == "linear_attention" else "self_attn"
        for module, slot in module_slots(config.trunk, kind).items():
            group = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else mixer
            key = f"base_model.model.model.language_model.layers.{layer}.{group}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, slot.in_features, generator=generator) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(slot.width, rank, generator=generator) * 0.01
    (out / "adapter").mkdir(parents=True)
    save_file(tensors, str(out / "adapter" / "adapter_model.safetensors"))
    (out / "adapter" / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none", "use_dora": False})
    )
    shutil.copy(base / "joint_head.safetensors", out / "joint_head.safetensors")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from decision_latency import build

    from clef_cuda import Decider
    from clef_cuda.model.adapters import AdapterBatch, AdapterRegistry
    from clef_cuda.model.trunk import ChunkBatch, SequenceChunk
    from clef_cuda.model.trunk_cache import TrunkCache

    work = Path(tempfile.mkdtemp(prefix="clef-adapter-bench-"))
    release = build("mid", work)
    decider = Decider.from_release(release, device="cpu", progress=False)
    trunk = decider.trunk
    blocks = TOKENS // 16
    cache = TrunkCache.allocate(decider.config.trunk, RECORDS, RECORDS * blocks, 16, "cpu", trunk.dtype)
    generator = torch.Generator().manual_seed(0)
    chunks = [
        SequenceChunk(
            torch.randint(0, 1000, (TOKENS,), generator=generator).tolist(),
            0,
            r,
            list(range(r * blocks, (r + 1) * blocks)),
        )
        for r in range(RECORDS)
    ]
    batch = ChunkBatch.build(chunks, 16, "cpu")

    cases = {"base only": None}
    memory = {}
    for rank in (16, 64):
        registry = AdapterRegistry(decider.config, trunk.lm_head, trunk.dtype, max_adapters=4, max_rank=64)
        variants = [
            registry.load(f"r{rank}-{i}", synthetic_adapter(release, work / f"r{rank}-{i}", decider.config, rank, i))
            for i in range(4)
        ]
        memory[rank] = variants[0].bytes
        for count in (1, 2, 4):
            # 4 records: split among `count` variants; with 1 variant, one record is adapted, three are base
            per = RECORDS // count if count > 1 else 1
            segments = [(i * per * TOKENS, (i + 1) * per * TOKENS, variants[i]) for i in range(count)]
            cases[f"rank {rank}, {count} variant{'s' if count > 1 else ''}"] = AdapterBatch(segments)

    def step(lora):
        with torch.inference_mode():
            trunk.forward(batch, cache, lora)

    times = {name: [] for name in cases}
    for lora in cases.values():
        step(lora)  # warm
    for _ in range(args.repeats):
        for name, lora in cases.items():  # interleaved: the machine's load falls on all alike
            started = time.perf_counter()
            step(lora)
            times[name].append(time.perf_counter() - started)
    base = statistics.median(times["base only"])
    print(
        f"\none trunk step, mid release (hidden 1024, 8 layers), {RECORDS} records x {TOKENS} tokens, CPU "
        f"({torch.get_num_threads()} threads), fp32"
    )
    print(f"{'case':<24} {'step ms':>9} {'overhead':>9}")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:<24} {1e3 * median:>9.1f} {100 * (median / base - 1):>8.1f}%")
    head = sum(t.numel() * t.element_size() for t in decider.head.w.values())
    print(
        "\nmemory per variant: "
        + ", ".join(f"rank {r}: {b / 2**20:.1f} MiB of deltas" for r, b in memory.items())
        + f" + a {head / 2**20:.1f} MiB head (shared when the bytes are equal)"
    )


if __name__ == "__main__":
    main()
