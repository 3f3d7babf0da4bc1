#!/usr/bin/env python3
"""Times every clef_cuda op at clef-flash layer shapes and prints a table (last).

For each case: our median time, its rate (GB/s for bandwidth-bound ops, TFLOP/s for compute-bound ones),
that rate as a % of a copy bandwidth / GEMM rate measured in this same run, the speed-up over the
upstream torch path on the same shapes (transformers' Qwen3.5 torch fallbacks) and over peers (torch's
fused SDPA for attention; FLA's Triton kernels on a GPU where importable). Ratios, not absolute times,
are what to compare across machines.

    python benchmarks/kernel_table.py                       # CPU: 1024 and 2048 tokens
    python benchmarks/kernel_table.py --device cuda         # GPU: 1024 .. 8192 tokens, f16
    python benchmarks/kernel_table.py --markdown benchmarks/RESULTS.md   # also append the table there
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases as bench_cases  # noqa: E402


def timer(device: torch.device):
    """Median seconds of fn over repeats (GPU: CUDA events; CPU: wall clock), after warm-up."""

    def measure(fn, min_repeats=3, min_seconds=0.5, max_repeats=50):
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
            times = []
            for _ in range(3):
                fn()
            while len(times) < max(min_repeats, 10) and (len(times) < max_repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            return statistics.median(times)
        times, spent = [], 0.0
        while len(times) < min_repeats or (spent < min_seconds and len(times) < max_repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            spent += times[-1]
        return statistics.median(times)

    return measure


def measured_peaks(device, dtype, measure) -> tuple[float, float]:
    """(copy bandwidth GB/s, GEMM TFLOP/s) on this machine, now."""
    n = (256 << 20) // 4 if device.type == "cuda" else (64 << 20) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    copy_s = measure(lambda: dst.copy_(src))
    size = 8192 if device.type == "cuda" else 2048
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    gemm_s = measure(lambda: a @ b)
    return 2 * src.numel() * 4 / copy_s / 1e9, 2 * size**3 / gemm_s / 1e12


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--tokens", help="comma-separated prefill token counts (default: CPU 1024,2048; GPU 1024..8192)"
    )
    parser.add_argument("--batches", default="1,4", help="sequences per pack (default 1,4)")
    parser.add_argument("--dtype", choices=["f32", "f16", "bf16"], help="default: f32 on CPU, f16 on GPU")
    parser.add_argument("--markdown", help="append the table, with date and device, to this file")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[
        args.dtype or ("f16" if device.type == "cuda" else "f32")
    ]
    default_tokens = "1024,2048,4096,8192" if device.type == "cuda" else "1024,2048"
    tokens = [int(t) for t in (args.tokens or default_tokens).split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    measure = timer(device)
    torch.manual_seed(0)
    bench_cases._qwen35()  # import transformers' module before FLA becomes importable (see cases.fla_ops)

    copy_gbs, gemm_tflops = measured_peaks(device, dtype, measure)
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
    rows = []
    for case in bench_cases.all_cases(tokens, batches, dtype, device):
        ours = measure(case.ours)
        reference = measure(case.reference)
        peers = {name: measure(fn) for name, fn in case.peers.items()}
        if case.flops and "decode" not in case.shape:
            rate, unit, peak = case.flops / ours / 1e12, "TFLOP/s", gemm_tflops
        else:
            rate, unit, peak = case.bytes / ours / 1e9, "GB/s", copy_gbs
        rows.append(
            [
                case.op,
                case.shape,
                f"{ours * 1e3:.3f}",
                f"{rate:.3f} {unit}",
                f"{100 * rate / peak:.1f}%",
                f"{reference * 1e3:.3f}",
                f"{reference / ours:.2f}x",
                ", ".join(f"{name} {t * 1e3:.3f} ms ({t / ours:.2f}x)" for name, t in peers.items()) or "-",
            ]
        )
        print(f"  {case.op:28s} {case.shape:48s} ours {ours * 1e3:9.3f} ms  ref {reference * 1e3:9.3f} ms", flush=True)

    header = ["op", "shape", "ours ms", "rate", "% of peak", "ref ms", "ours vs ref", "peers (ours vs peer)"]
    stamp = datetime.date.today().isoformat()
    lines = [
        f"### {stamp}, {device_name}, {str(dtype).removeprefix('torch.')}, torch {torch.__version__}",
        "",
        f"Measured in this run: copy {copy_gbs:.1f} GB/s, GEMM {gemm_tflops:.2f} TFLOP/s "
        f"({str(dtype).removeprefix('torch.')}). ref = transformers' Qwen3.5 torch fallbacks; peers: torch's fused "
        "SDPA on a contiguous context, FLA's Triton kernels (GPU); 'ours vs X' = X time / our time "
        "(> 1: we are faster). "
        "Decode rates above 100% of the copy bandwidth mean the state or context stayed in cache between repeats.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    table = "\n".join(lines)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n" + table + "\n")
    print()
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
