#!/usr/bin/env python3
"""What int8 weights and 16-bit activations cost in probabilities, per release, per activation dtype and per LoRA
variant: the figures behind tests/parity.py's INT8_BOUNDS and DTYPE_BOUNDS. CPU. Table last.

    python benchmarks/int8_bounds.py                  # 200 random requests a release and dtype, 15 per variant
    python benchmarks/int8_bounds.py --requests 40 --variant-requests 5
    python benchmarks/int8_bounds.py --weights stored --no-variants   # the 16-bit activations alone

Rows:
  release x dtype   max |p_int8 - p_f32|: the release loaded with --quantize int8 and `dtype` activations
                    against the same release in fp32 (the requests tests/test_quantize.py draws); with weights
                    "stored", the release as stored in f16 / bf16 activations against itself in fp32
  variant           max |p - p_merge|: a clef-finetune LoRA checkpoint served unmerged over the int8
                    upstream-tiny base (fp32 activations) against Cloudflare's reference on clef-finetune's fp32
                    merge of it (the long requests tests/test_adapters.py draws)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # before benchmarks/ (its conftest is not the tests')
sys.path.append(str(ROOT))

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def release_rows(requests: int, weights: list[str]) -> list[tuple[str, str, str, int, float]]:
    from test_quantize import RELEASES, max_abs_dp, requests_for

    from clef_cuda import Decider

    rows = []
    for name, build in RELEASES.items():
        path = build()
        f32 = Decider.from_release(path, device="cpu", progress=False)
        drawn = requests_for(name, requests)
        for stored in weights:
            for dtype_name, dtype in DTYPES.items():
                if stored == "stored" and dtype == torch.float32:
                    continue  # the reference itself
                quantize = "int8" if stored == "int8" else "none"
                other = Decider.from_release(path, device="cpu", dtype=dtype, progress=False, quantize=quantize)
                rows.append((name, stored, dtype_name, len(drawn), max_abs_dp(f32, other, drawn)))
                print(f"{name} {stored} {dtype_name}: {rows[-1][4]:.2e}", flush=True)
    return rows


def variant_rows(requests: int) -> list[tuple[str, str, int, float]]:
    from adapter_fixtures import merged
    from releases import tiny_release
    from test_adapters import VARIANTS, long_request, make_engine, reference_probabilities, registry_with, worst

    from clef_cuda import Decider
    from clef_cuda.request import answers

    seen: list[list[float]] = []
    real = answers.answer

    def record(question, probabilities, confidence="clef"):
        seen.append(list(probabilities.values()))
        return real(question, probabilities, confidence)

    answers.answer = record
    int8 = Decider.from_release(tiny_release(), device="cpu", progress=False, quantize="int8")
    engine = make_engine(int8, registry_with(int8, *VARIANTS))
    engine.start()
    rows = []
    try:
        for variant in VARIANTS:
            error = 0.0
            for seed in range(requests):
                request = long_request(100 + seed)
                seen.clear()
                engine.decide(request | {"model": variant}, timeout=300)
                error = max(error, worst(list(seen), reference_probabilities(merged(variant), request)))
            rows.append((f"upstream-tiny+lora:{variant}", "int8", "f32", requests, error))
            print(f"{variant}: {error:.2e}", flush=True)
    finally:
        engine.stop(10)
        answers.answer = real
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200, help="random requests per release and dtype")
    parser.add_argument("--variant-requests", type=int, default=15, help="long requests per LoRA variant")
    parser.add_argument("--weights", default="int8,stored", help="int8 and/or stored (the 16-bit activations alone)")
    parser.add_argument("--no-variants", action="store_true", help="leave out the LoRA variants' rows")
    args = parser.parse_args()
    rows = release_rows(args.requests, args.weights.split(","))
    if not args.no_variants:
        rows += variant_rows(args.variant_requests)

    from parity import DTYPE_BOUNDS, INT8_BOUNDS

    def bound_of(name: str, stored: str, dtype_name: str) -> float | None:
        return (INT8_BOUNDS if stored == "int8" else DTYPE_BOUNDS).get((name, dtype_name))

    print("\nagainst fp32 on the CPU: max |dp|, and the bound tests/parity.py holds")
    print(f"{'release / variant':28s} {'weights':7s} {'dtype':5s} {'requests':>8s} {'max |dp|':>10s} {'bound':>9s}")
    for name, stored, dtype_name, count, error in rows:
        bound = bound_of(name, stored, dtype_name)
        shown = f"{bound:.1e}" if bound is not None else "-"
        print(f"{name:28s} {stored:7s} {dtype_name:5s} {count:>8d} {error:>10.2e} {shown:>9s}")
    over = [r for r in rows if (bound := bound_of(r[0], r[1], r[2])) is not None and r[4] > bound]
    for name, stored, dtype_name, _, error in over:
        print(f"OVER THE BOUND: {name} {stored} {dtype_name} {error:.2e}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
