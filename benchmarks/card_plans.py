#!/usr/bin/env python3
"""What clef-flash gets on each card people own: the memory plan (clef_cuda.serving.plan, what
`clef-serve --plan --gpu-memory ...` prints) at clef-flash's shapes for the capacity torch reports for the card
(cited per card below), with and without int8 weights, the vocabulary tables on the device or, where only that
fits, in host memory (--vocab-tables auto), and the attention kernels its compute capability and shared memory
give it (the launcher's own tile rule, clef_cuda.kernels.ops.paged_attention_tiles); then the longest record each
card's plan fits (up to the trained 262,144 tokens) with each set of flags, and the --kv-fraction that gets it. No
weights are needed: a config-only release is written to a temporary directory. Prints two tables.

    python benchmarks/card_plans.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "tests"))

# (card, the total capacity torch reports for it in GiB (the figure its out-of-memory messages print, on Linux:
# what the plan may count on, below nvidia-smi's total), compute capability, shared memory a block with the
# opt-in in KB, the activation dtype it should serve in, where the capacity was read). The lowest figure seen
# for the card is used (P40: 22.38 with ECC on, 23.87 without).
CARDS = [
    ("P40", 22.38, 61, 48, "f32", "github.com/LinkSoul-AI/Chinese-Llama-2-7b/issues/56"),
    (
        "P100 16GB",
        15.90,
        60,
        48,
        "f16",
        "Colab's OOM messages (github.com/googlecolab/colabtools/issues/1761); nvidia-smi 16,280 MiB",
    ),
    (
        "V100 16GB",
        15.75,
        70,
        96,
        "f16",
        "github.com/XuyangBai/TransFusion/issues/49 (15.78: kchengiva/Shift-GCN/issues/34)",
    ),
    ("V100 32GB", 31.73, 70, 96, "f16", "github.com/kvcache-ai/ktransformers/issues/526"),
    ("T4", 14.56, 75, 64, "f16", "github.com/Zheng-Chong/CatVTON/issues/133 (Colab: 14.75)"),
    ("RTX 3060 12GB", 11.75, 86, 99, "f16", "github.com/Kunhao-Liu/StyleGaussian/issues/12"),
    ("RTX 4060 Ti 16GB", 15.55, 89, 99, "f16", "github.com/boson-ai/higgs-audio/issues/48"),
    ("L4", 22.03, 89, 99, "f16", "github.com/ArcInstitute/evo2/issues/190"),
    ("A100 40GB", 39.50, 80, 163, "bf16", "github.com/TianheWu/CoSeR/issues/10 (39.56: threestudio/issues/402)"),
    ("A100 80GB", 79.25, 80, 163, "bf16", "github.com/wbfwonderful/Vad-R1/issues/11"),
    ("H100 80GB", 79.11, 90, 227, "bf16", "github.com/vllm-project/vllm/issues/27508"),
]
DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}
FRACTIONS = (0.30, 0.50, 0.70, 0.80, 0.90, 0.95)  # the --kv-fraction values the longest-record table tries


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    import torch
    from releases import flash_config_release

    from clef_cuda.kernels import ops
    from clef_cuda.model.config import load_release_config
    from clef_cuda.serving.engine import EngineConfig
    from clef_cuda.serving.plan import GiB, auto_vocab_tables, plan_serving

    with tempfile.TemporaryDirectory() as tmp:
        release = flash_config_release(Path(tmp) / "clef-flash")
        config = load_release_config(release)

        def plan(card_gib: float, dtype: str, quantize: str, tables: str = "device", **engine):
            return plan_serving(
                release,
                config,
                EngineConfig(**engine),
                int(card_gib * GiB),
                dtype=getattr(torch, DTYPES[dtype]),
                quantize=quantize,
                on_gpu=True,
                where="card",
                vocab_tables=tables,
            )

        def auto(card_gib: float, dtype: str, quantize: str, **engine):
            """--vocab-tables auto (clef_cuda.serving.plan.auto_vocab_tables)."""
            on_device = plan(card_gib, dtype, quantize, **engine)
            return auto_vocab_tables(on_device, plan(card_gib, dtype, quantize, "host", **engine))[0]

        def cell(p) -> str:
            if not p.fits:
                return f"no ({p.weight_bytes / GiB:.1f} GiB weights)"
            where = ", tables on host" if p.vocab_tables == "host" else ""
            return f"yes, {p.cache.num_blocks * 16 // 1024}k KV{where}"

        print("\nclef-flash (16k-token records, --max-num-seqs 4, --kv-fraction 0.30) by card, at torch's capacity")
        header = f"{'card':18s} {'GiB':>6s} {'cc':>3s} {'dtype':>5s} {'weights as stored':>30s}"
        print(header + f" {'--quantize int8':>30s}  prefill attention at D = 256")
        for name, gib, cc, smem, dtype, _ in CARDS:
            stored, int8 = auto(gib, dtype, "none"), auto(gib, dtype, "int8")
            print(
                f"{name:18s} {gib:>6.2f} {cc:>3d} {dtype:>5s} {cell(stored):>30s} {cell(int8):>30s}  "
                f"{ops.paged_attention_tiles(256, cc, smem * 1024)}"
            )

        def longest(card_gib: float, dtype: str, quantize: str, tables: str, **engine) -> tuple[int, float] | None:
            """The longest record the plan fits on the card with these flags, up to 262,144 tokens, and the
            --kv-fraction that gets it (the smallest of FRACTIONS that does: past some fraction a step's activations
            no longer fit beside the cache)."""
            best = None
            for fraction in FRACTIONS:

                def fits(n: int, fraction: float = fraction) -> bool:
                    return plan(card_gib, dtype, quantize, tables, max_model_len=n, kv_fraction=fraction, **engine).fits

                if not fits(16):
                    continue
                low, high = 16, 262_144
                if fits(high):
                    low = high
                while high - low > 16:  # bisect to a block
                    mid = (low + high) // 32 * 16
                    low, high = (mid, high) if fits(mid) else (low, mid)
                if best is None or low > best[0]:
                    best = (low, fraction)
            return best

        def length(found) -> str:
            return "none" if found is None else f"{found[0]:,} at {found[1]:.2f}"

        print(
            "\nthe longest clef-flash record the plan fits, up to 262,144 tokens (f16 KV cache), and its --kv-fraction"
        )
        settings = [
            ("weights as stored", "none", "device", {}),
            ("--quantize int8", "int8", "device", {}),
            ("int8, host tables", "int8", "host", {}),
            ("int8, host tables, 1 seq", "int8", "host", {"max_num_seqs": 1}),
        ]
        print(f"{'card':18s} {'GiB':>6s} " + " ".join(f"{title:>26s}" for title, *_ in settings))
        for name, gib, _, _, dtype, _ in CARDS:
            cells = [length(longest(gib, dtype, q, tables, **engine)) for _, q, tables, engine in settings]
            print(f"{name:18s} {gib:>6.2f} " + " ".join(f"{cell:>26s}" for cell in cells))
        print("\ncapacities: " + "; ".join(f"{name} {gib} GiB ({source})" for name, gib, _, _, _, source in CARDS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
