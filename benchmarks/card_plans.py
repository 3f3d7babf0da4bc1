#!/usr/bin/env python3
"""What clef-flash gets on each card people own: the memory plan (clef_cuda.serving.plan, what
`clef-serve --plan --gpu-memory ...` prints) at clef-flash's shapes for the card's usable memory, with and
without int8 weights, and the attention kernels its compute capability and shared memory give it
(the launcher's own tile rule, clef_cuda.ops.paged_attention_tiles). No weights are needed: a config-only release is
written to a temporary directory. Prints a table.

    python benchmarks/card_plans.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "tests"))

# (card, usable memory in MiB as nvidia-smi reports the total, compute capability, shared memory a block
# with the opt-in, activation dtype it should serve in)
CARDS = [
    ("P40", 24451, 61, 48, "f32"),  # f16 at 1/64 of the f32 rate: int8 weights, f32 activations
    ("P100 16GB", 16280, 60, 48, "f16"),
    ("V100 16GB", 16160, 70, 96, "f16"),
    ("V100 32GB", 32510, 70, 96, "f16"),
    ("T4", 15360, 75, 64, "f16"),
    ("RTX 3060 12GB", 12288, 86, 99, "f16"),
    ("RTX 4060 Ti 16GB", 16380, 89, 99, "f16"),
    ("L4", 23034, 89, 99, "f16"),
    ("A100 40GB", 40960, 80, 163, "bf16"),
    ("H100 80GB", 81559, 90, 227, "bf16"),
]
DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    import torch
    from releases import flash_config_release

    from clef_cuda import ops
    from clef_cuda.model.config import load_release_config
    from clef_cuda.serving.engine import EngineConfig
    from clef_cuda.serving.plan import MiB, plan_serving

    with tempfile.TemporaryDirectory() as tmp:
        release = flash_config_release(Path(tmp) / "clef-flash")
        config = load_release_config(release)

        def plan(card_mib: int, dtype: str, quantize: str, **engine):
            return plan_serving(
                release,
                config,
                EngineConfig(**engine),
                card_mib * MiB,
                dtype=getattr(torch, DTYPES[dtype]),
                quantize=quantize,
                on_gpu=True,
                where="card",
            )

        def cell(p) -> str:
            if not p.fits:
                return f"no ({p.weight_bytes / 2**30:.1f} GiB weights)"
            return f"yes, {p.cache.num_blocks * 16 // 1024}k KV tokens"

        print("\nclef-flash (16k-token records, --max-num-seqs 4, --kv-fraction 0.30 unless noted) by card")
        header = f"{'card':18s} {'MiB':>6s} {'cc':>3s} {'dtype':>5s} {'weights as stored':>26s}"
        print(header + f" {'--quantize int8':>26s}  prefill attention at D = 256")
        for name, mib, cc, smem, dtype in CARDS:
            stored, int8 = plan(mib, dtype, "none"), plan(mib, dtype, "int8")
            note = ""
            if not int8.fits:  # what it takes: fewer running records, more of the rest for the cache
                tuned = plan(mib, dtype, "int8", max_num_seqs=2, kv_fraction=0.7)
                note = " (with --max-num-seqs 2 --kv-fraction 0.7: " + cell(tuned) + ")"
            print(
                f"{name:18s} {mib:>6d} {cc:>3d} {dtype:>5s} {cell(stored):>26s} {cell(int8):>26s}  "
                f"{ops.paged_attention_tiles(256, cc, smem * 1024)}{note}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
