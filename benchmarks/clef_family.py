#!/usr/bin/env python3
"""The Clef family side by side: clef-flash (9B) and clef (27B).

1. Plans (no weights: the configs, tests/fixtures/clef-27b and clef-flash's): what `clef-serve --plan` says for
   each model on the cards people own, one card or tensor parallel, f16 or int8, the vocabulary tables where
   --vocab-tables auto puts them, at the seed's flags (4 records of 16k tokens, --kv-fraction 0.30, chunks of
   1,024) with the release's image size and with the hosted API's (1,048,576 pixels): KV tokens, and rank 0's
   needs before the cache over the most loaded other rank's.
2. Decision latency on this CPU (fp32) of two test releases of the same small width scale (widths / 16, every
   count and ratio kept: 32 layers against 64, GQA 4 against 6, 2 against 3 value heads a key head), with the
   ratio their FLOPs predict.
3. A projection of one 2,048-token clef 27B decision on 2 x V100-32GB (TP=2, f16), from its bytes and FLOPs,
   over NVLink and over PCIe, beside the hosted service's 209 ms median.

    python benchmarks/clef_family.py [--requests 6]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from card_plans import CARDS  # noqa: E402
from tensor_parallel import NVLINK_V100, PCIE3_X16, V100_F16_GEMM, per_token_bytes, ring_seconds  # noqa: E402

# (label, card in card_plans.CARDS, how many, dtype)
SETUPS = [
    ("1 x V100 16GB", "V100 16GB", 1, "f16"),
    ("1 x V100 32GB", "V100 32GB", 1, "f16"),
    ("2 x V100 16GB", "V100 16GB", 2, "f16"),
    ("2 x V100 32GB", "V100 32GB", 2, "f16"),
    ("4 x V100 16GB", "V100 16GB", 4, "f16"),
    ("2 x L4 24GB", "L4", 2, "f16"),
    ("1 x A100 80GB", "A100 80GB", 1, "bf16"),
]
HOSTED_IMAGE_PIXELS = 1_048_576
HOSTED_MEDIAN_MS = {"clef": 209, "clef-flash": 39}  # Workers AI's published medians
# The tensor-core attention kernel at GQA 6 (10 tokens in a 64-row tile, 4 rows idle): 40% of the f16 peak, a
# guess until it runs on a V100.
V100_WMMA_ATTENTION = 125e12 * 0.4
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}


def plans(release: Path, engine, gib: float, count: int, dtype, quantize: str, image_max_pixels):
    """--vocab-tables auto (clef_cuda.serving.plan.auto_vocab_tables)."""
    from clef_cuda.model.config import load_release_config
    from clef_cuda.serving.plan import GiB, auto_vocab_tables, plan_serving, plan_tensor_parallel

    config = load_release_config(release)
    options = dict(dtype=dtype, quantize=quantize, on_gpu=True, where="card", image_max_pixels=image_max_pixels)

    def plan(tables: str):
        if count == 1:
            return plan_serving(release, config, engine, int(gib * GiB), vocab_tables=tables, **options)
        return plan_tensor_parallel(release, config, engine, int(gib * GiB), count, vocab_tables=tables, **options)

    return auto_vocab_tables(plan("device"), plan("host"))[0]


def cell(p) -> str:
    if not p.fits:
        return "no"
    text = f"{p.cache.num_blocks * p.block_size / 1024:.0f}k"
    if p.vocab_tables == "host":
        text += " host"
    if p.other_ranks:
        text += f" {p.needed_bytes / max(o.needed_bytes for o in p.other_ranks):.2f}x"
    return text


def plan_table(releases: dict[str, Path]) -> None:
    from clef_cuda.serving.engine import EngineConfig

    engine = EngineConfig(max_num_seqs=4, kv_fraction=0.30, prefill_chunk_size=1024, max_model_len=16384)
    capacity = {name: gib for name, gib, *_ in CARDS}
    print("\n1. --plan at the seed's flags: KV tokens (k), 'host': the tables in host memory (--vocab-tables auto),")
    print("   Nx: rank 0's needs before the cache over the most loaded other rank's; 'no': does not fit")
    columns = [(model, quantize, pixels) for model in releases for quantize in ("none", "int8") for pixels in (None, 1)]
    header = " ".join(
        f"{model + (' int8' if q == 'int8' else '') + (' 1MP' if px else ''):>18s}" for model, q, px in columns
    )
    print(f"{'cards (torch GiB)':24s} {header}")
    for label, card, count, dtype in SETUPS:
        cells = []
        for model, quantize, pixels in columns:
            p = plans(
                releases[model],
                engine,
                capacity[card],
                count,
                DTYPES[dtype],
                quantize,
                HOSTED_IMAGE_PIXELS if pixels else None,
            )
            cells.append(f"{cell(p):>18s}")
        print(f"{label + f' ({capacity[card]})':24s} {' '.join(cells)}")


def shaped_release(out: Path, text: dict, head: dict, vocab: int) -> Path:
    from releases import build_release

    return build_release(out, text=text, head=head, vocab_size=vocab, max_shard_size=None)


def latency_table(requests: int) -> None:
    from random_requests import random_request
    from releases import CLEF_RATIO_HEAD, FLASH_HEAD, FLASH_TEXT

    from clef_cuda import Decider
    from clef_cuda.model.config import load_release_config
    from clef_cuda.model.weights import trunk_shapes

    fixture = json.loads((ROOT / "tests" / "fixtures" / "clef-27b" / "config.json").read_text())["text_config"]
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "layer_types", "num_attention_heads")
    keys += ("num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads")
    keys += ("linear_key_head_dim", "linear_value_head_dim", "rope_parameters")
    clef_text = {k: fixture[k] for k in keys}

    def scaled(text: dict) -> dict:  # widths / 16, every count and ratio kept
        return dict(
            text,
            hidden_size=text["hidden_size"] // 16,
            intermediate_size=text["intermediate_size"] // 16,
            head_dim=text["head_dim"] // 16,
            linear_key_head_dim=text["linear_key_head_dim"] // 16,
            linear_value_head_dim=text["linear_value_head_dim"] // 16,
        )

    shapes = {
        "clef-flash": (scaled(FLASH_TEXT), dict(FLASH_HEAD, hidden_size=256, width=64, feedforward=256)),
        "clef": (scaled(clef_text), dict(CLEF_RATIO_HEAD, hidden_size=320, width=64, feedforward=256)),
    }
    rng = random.Random(3)
    bodies = [random_request(rng, null_score_levels=False, state_words=(300, 400)) for _ in range(requests)]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (text, head) in shapes.items():
            path = shaped_release(Path(tmp) / name, text, dict(head, heads=4, layers=2), 2000)
            decider = Decider.from_release(path, device="cpu", progress=False)
            config = load_release_config(path).trunk
            params = sum(
                torch.Size(s).numel()
                for n, s in trunk_shapes(config).items()
                if "embed" not in n and "lm_head" not in n
            )
            records = [decider.encode(body) for body in bodies]
            decider.probabilities(records[0])  # warm
            times = []
            for record in records:
                started = time.perf_counter()
                decider.probabilities(record)
                times.append(time.perf_counter() - started)
            tokens = statistics.mean(r.num_tokens for r in records)
            rows[name] = (statistics.median(times), params, tokens)
    print(f"\n2. decision latency on this CPU, fp32, {requests} requests of ~{tokens:.0f} tokens, widths / 16")
    print(f"{'release':12s} {'layer params':>13s} {'median ms':>10s}")
    for name, (median, params, _) in rows.items():
        print(f"{name:12s} {params / 1e6:>12.1f}M {median * 1e3:>10.1f}")
    (t_flash, p_flash, _), (t_clef, p_clef, _) = rows["clef-flash"], rows["clef"]
    print(
        f"clef / clef-flash: measured {t_clef / t_flash:.2f}x, the layers' parameters predict {p_clef / p_flash:.2f}x"
    )


def projection(clef_release: Path, tokens: int = 2048) -> None:
    from clef_cuda.model.config import load_release_config
    from clef_cuda.model.weights import trunk_shapes

    config = load_release_config(clef_release).trunk
    params = sum(
        torch.Size(s).numel() for n, s in trunk_shapes(config).items() if "embed" not in n and "lm_head" not in n
    )
    ranks = 2
    gemm = 2 * tokens * params / ranks / V100_F16_GEMM
    # Causal attention over the prompt: QK^T and PV, half the square, each rank its heads.
    attention_flops = len(config.attention_layers) * 2 * 2 * tokens * tokens / 2 * config.num_attention_heads
    attention = attention_flops * config.head_dim / ranks / V100_WMMA_ATTENTION
    traffic = tokens * per_token_bytes(config, 2)
    nvlink, pcie = ring_seconds(traffic, ranks, NVLINK_V100), ring_seconds(traffic, ranks, PCIE3_X16)
    print(
        f"\n3. one {tokens:,}-token clef 27B decision on 2 x V100-32GB, TP=2, f16 (a projection from bytes and FLOPs)"
    )
    total, group = 2 * tokens * params / 1e12, config.num_attention_heads // config.num_key_value_heads
    print(f"   GEMMs: {total:.1f} TFLOP, {gemm * 1e3:.0f} ms a rank at {V100_F16_GEMM / 1e12:.0f} TFLOP/s")
    print(
        f"   attention ({len(config.attention_layers)} layers, GQA {group} on tensor cores): "
        f"{attention * 1e3:.0f} ms at {V100_WMMA_ATTENTION / 1e12:.0f} TFLOP/s"
    )
    print(f"   all-reduces: {traffic / 2**20:.0f} MiB a rank: NVLink {nvlink * 1e3:.0f} ms, PCIe {pcie * 1e3:.0f} ms")
    print(f"{'link':8s} {'projected ms':>13s} {'hosted median ms':>17s}")
    for link, seconds in (("NVLink", nvlink), ("PCIe", pcie)):
        print(f"{link:8s} {(gemm + attention + seconds) * 1e3:>13.0f} {HOSTED_MEDIAN_MS['clef']:>17d}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=6)
    args = parser.parse_args()
    from releases import clef_config_release, flash_config_release

    with tempfile.TemporaryDirectory() as tmp:
        releases = {
            "clef-flash": flash_config_release(Path(tmp) / "clef-flash"),
            "clef": clef_config_release(Path(tmp) / "clef"),
        }
        plan_table(releases)
        latency_table(args.requests)
        projection(releases["clef"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
