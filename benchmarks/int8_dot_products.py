#!/usr/bin/env python3
"""Can the CPU's int8 dot products (torch._int_mm, oneDNN's s8 x s8 GEMM) carry a W8A8 prefill GEMM on this CPU?
First whether its sums are right, then what it saves: per prefill-step GEMM shape, torch._int_mm's largest error
against the exact integer sums (int64), with full-range int8 weights (|q| <= 127, what per-row absmax gives) and
with 7-bit ones (|q| <= 63); and the GEMM's time in f32, bf16, f16, f16 weights widened to f32 per call, and
int8 (torch._int_mm alone, no quantization of the activations or scaling). CPU, 2 threads by default, medians.

    python benchmarks/int8_dot_products.py
    CLEF_CPU_ISA=avx2 python benchmarks/int8_dot_products.py   # what an AVX2-only CPU runs (oneDNN capped too)

Why both weight ranges: without VNNI, oneDNN multiplies s8 x s8 as u8 x s8 (the activations shifted by 128, a
compensation subtracted afterwards) with vpmaddubsw, which adds each pair of products into 16 bits with
saturation: 255 x 127 x 2 > 32,767, so sums over full-range weights come out wrong, and its documentation asks
for 7-bit weights there. With VNNI (vpdpbusd sums into 32 bits) both are exact. An error is exit 1 only where the
weights are 7-bit (what the library promises); the full-range row is the finding, printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (rows, in, out): clef-flash-like prefill GEMMs at 2,048 rows (mid's in_proj, hidden 2,048's gate_up and down),
# and a short step.
SHAPES = [(2048, 1024, 3072), (2048, 2048, 6144), (2048, 6144, 2048), (64, 2048, 6144)]


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def int_mm_error(rows: int, cols: int, out: int, weight_limit: int, generator: torch.Generator) -> int:
    """max |torch._int_mm - exact| over random activations in [-127, 127] and weights in [-limit, limit]."""
    a = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=generator)
    w = torch.randint(-weight_limit, weight_limit + 1, (out, cols), dtype=torch.int8, generator=generator)
    exact = a.long() @ w.long().t()
    return int((torch._int_mm(a, w.t()).long() - exact).abs().max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from clef_cuda.kernels import ops  # applies CLEF_CPU_ISA (and caps oneDNN and MKL) before the first GEMM
    from clef_cuda.kernels.cpu_features import cpu_gemm_features, cpu_model

    torch.set_num_threads(args.threads)
    isa = ops.cpu_isa()
    print(f"{cpu_model()}, our kernels at {isa}, GEMMs: {cpu_gemm_features(isa).describe()}, {args.threads} threads")
    generator = torch.Generator().manual_seed(0)
    header = (
        "| GEMM (rows x in -> out) | _int_mm error, 8-bit weights | 7-bit weights | f32 | bf16 | f16 "
        "| f16 weights -> f32 GEMM | int8 (_int_mm) | int8 / f32 speed |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    wrong_7_bit = False
    for rows, cols, out in SHAPES:
        full = int_mm_error(min(rows, 256), cols, min(out, 512), 127, generator)
        seven = int_mm_error(min(rows, 256), cols, min(out, 512), 63, generator)
        wrong_7_bit |= seven != 0
        x = torch.randn(rows, cols, generator=generator)
        w = torch.randn(out, cols, generator=generator)
        xb, wb, xh, wh = x.bfloat16(), w.bfloat16(), x.half(), w.half()
        q = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=generator)
        qw = torch.randint(-127, 128, (out, cols), dtype=torch.int8, generator=generator)
        f32 = median_ms(lambda x=x, w=w: F.linear(x, w), args.repeats)
        bf16 = median_ms(lambda x=xb, w=wb: F.linear(x, w), args.repeats)
        f16 = median_ms(lambda x=xh, w=wh: F.linear(x, w), args.repeats)
        widened = median_ms(lambda x=x, w=wh: F.linear(x, w.float()), args.repeats)
        int8 = median_ms(lambda q=q, qw=qw: torch._int_mm(q, qw.t()), args.repeats)
        print(
            f"| {rows:,} x {cols:,} -> {out:,} | {full:,} | {seven:,} | {f32:.1f} ms | {bf16:.1f} ms | {f16:.1f} ms "
            f"| {widened:.1f} ms | {int8:.1f} ms | {f32 / int8:.2f}x |",
            flush=True,
        )
    if wrong_7_bit:
        print("torch._int_mm is wrong even with 7-bit weights on this CPU")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
