#!/usr/bin/env python3
"""int8 weights (--quantize int8) against the release's own dtype, in the same run: load time, host memory
while and after loading (each configuration in a fresh process), and decision latency at 512 and 2,048
tokens (interleaved medians); then the dequantize overhead of one clef-flash-shaped layer (the MLP's down
projection, 4,096 x 12,288) from 1 to 4,096 rows a step, dequantize + GEMM and (up to 64 rows) the fused W8A16
kernel against the GEMM alone on this device, and its projection for V100 and T4 from bytes and FLOPs. Prints
the tables last.

    python benchmarks/int8_table.py                       # CPU, a 51M-parameter random release (f32 vs int8)
    python benchmarks/int8_table.py --release mid --repeats 5
    python benchmarks/int8_table.py --device cuda --dtype f16 --release 9b
    python benchmarks/int8_table.py --device cuda --dtype float16 --layer-only --rows 64,256,1024,4096

Memory is read from /proc/self/status: RssAnon (what the process allocated: weights, scratch) sampled every
2 ms during the load for its peak, and after it; the release's own file pages (RssFile, mapped while
reading) are left out, as the kernel can drop them. "resident" is what the loaded model's weights hold
(Decider.weight_bytes). `--probe CONFIG PATH DEVICE DTYPE` is one fresh-process measurement
(JSON), as tests/test_quantize.py uses it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "tests"))  # releases; appended, so a test importing this file keeps its own modules


def decision_latency():
    """benchmarks/decision_latency.py (its release specs and timing helper), loaded by path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("decision_latency", ROOT / "benchmarks" / "decision_latency.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Enough layers that one tensor (and the dequantize scratch) is a small part of the model.
MEMORY_RELEASE = dict(
    text=dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=12,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=128,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    ),
    head={"hidden_size": 512, "width": 128, "routing_layers": 2, "layers": 2, "heads": 4, "feedforward": 256},
    vocab_size=8000,
)


def build(name: str, directory: Path) -> Path:
    if name == "memory":
        from releases import build_release

        return build_release(directory / name, **MEMORY_RELEASE)
    return decision_latency().build(name, directory)


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def probe(quantize: str, path: str, device: str, dtype: str) -> dict:
    """One load in this (fresh) process: seconds, anonymous memory before / peak / after, weight bytes."""
    import torch

    import clef_cuda.kernels.ops  # noqa: F401  (the extension and torch's libraries: part of the baseline)
    from clef_cuda import Decider

    before = status_bytes("RssAnon")
    peak = [before]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], status_bytes("RssAnon"))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    decider = Decider.from_release(path, device=device, dtype=getattr(torch, dtype), quantize=quantize, progress=False)
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    after = status_bytes("RssAnon")
    weights = sum(decider.weight_bytes().values())
    return {
        "quantize": quantize,
        "seconds": seconds,
        "anon_before": before,
        "anon_peak": max(peak[0], after),
        "anon_after": after,
        "weights": weights,
    }


def fresh_probe(quantize: str, path: Path, device: str, dtype: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--probe", quantize, str(path), device, dtype],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def latencies(path: Path, device: str, dtype: str, repeats: int) -> dict[tuple[str, int], float]:
    import torch

    from clef_cuda import Decider

    helpers = decision_latency()
    interleaved_medians, request_of_length = helpers.interleaved_medians, helpers.request_of_length

    deciders = {
        q: Decider.from_release(path, device=device, dtype=getattr(torch, dtype), quantize=q, progress=False)
        for q in ("none", "int8")
    }
    out = {}
    for tokens in (512, 2048):
        records = {q: d.encode(request_of_length(d, tokens)) for q, d in deciders.items()}
        fns = [lambda q=q, r=records: deciders[q].probabilities(r[q]) for q in deciders]
        for q, seconds in zip(deciders, interleaved_medians(fns, repeats, torch.device(device)), strict=True):
            out[(q, tokens)] = seconds
    return out


# (name, memory bandwidth B/s, f16 tensor peak FLOP/s, fraction of bandwidth and of peak a large
# dequantize and GEMM reach): vendor peaks (shared/specs/memory.md), assumed efficiencies.
CARDS = [("V100", 900e9, 125e12, 0.8, 0.7), ("T4", 320e9, 65e12, 0.8, 0.5)]
FLASH_LINEAR_WEIGHTS = 6.94e9  # trunk linear weights of clef-flash (clef_cuda.model.footprint, int8)


def layer_overhead(
    device: str, dtype: str, repeats: int, rows_list=(64, 128, 256, 512, 1024, 4096)
) -> dict[int, tuple[float, float, float | None]]:
    """Seconds of the GEMM alone, of dequantize + GEMM and (at most 64 rows) of the fused W8A16 kernel
    (ops.int8_linear) for the down projection at each of `rows_list`, their runs interleaved."""
    import torch

    from clef_cuda.kernels import ops
    from clef_cuda.model.quantize import quantize_int8

    helpers = decision_latency()
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    weight = (torch.randn(4096, 12288) * 0.02).to(device=device, dtype=dt)
    q = quantize_int8(weight, dt)
    scratch = torch.empty_like(weight)
    out = {}
    for rows in rows_list:
        x = torch.randn(rows, 12288, device=device, dtype=dt)

        def dense(x=x):
            return torch.nn.functional.linear(x, weight)

        def int8(x=x):
            return torch.nn.functional.linear(x, ops.dequantize_int8(q.qweight, q.scale, out=scratch))

        def fused(x=x):
            return ops.int8_linear(x, q.qweight, q.scale)

        fns = [dense, int8] + ([fused] if rows <= 64 else [])
        times = helpers.interleaved_medians(fns, repeats, torch.device(device))
        out[rows] = (times[0], times[1], times[2] if rows <= 64 else None)
    return out


def projection(rows: int) -> list[tuple[str, float, float, float]]:
    """(card, dequantize ms, GEMM ms, overhead) for one clef-flash step of `rows` packed tokens: the
    dequantize reads 1 byte and writes 2 per weight, and the GEMM then reads the 2-byte copy in place of
    the f16 weight it would read anyway (so 3 extra bytes a weight); the GEMM is 2 x rows FLOPs a weight."""
    result = []
    for name, bandwidth, peak, bw_eff, flop_eff in CARDS:
        dequantize = 3 * FLASH_LINEAR_WEIGHTS / (bandwidth * bw_eff)
        gemm = 2 * rows * FLASH_LINEAR_WEIGHTS / (peak * flop_eff)
        result.append((name, dequantize * 1e3, gemm * 1e3, dequantize / gemm))
    return result


def print_layer(layer: dict[int, tuple[float, float, float | None]], device: str, dtype: str) -> None:
    print(f"\none clef-flash-shaped layer (down_proj 4096 x 12288) on {device} in {dtype}, same run")
    print(
        f"{'rows':>6s} {'GEMM ms':>9s} {'dequant+GEMM ms':>16s} {'overhead':>9s} {'fused ms':>9s} {'fused/GEMM':>10s}"
    )
    for rows, (dense, int8, fused) in layer.items():
        fused_cells = f"{fused * 1e3:9.3f} {fused / dense:10.2f}" if fused is not None else f"{'-':>9s} {'-':>10s}"
        print(f"{rows:>6d} {dense * 1e3:9.3f} {int8 * 1e3:16.3f} {int8 / dense - 1:8.1%} {fused_cells}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--release", default="memory", help="memory (default), tiny, mid, 9b, or a directory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", help="the serving dtype: float32, float16, bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--probe", nargs=4, metavar=("QUANTIZE", "PATH", "DEVICE", "DTYPE"), help=argparse.SUPPRESS)
    parser.add_argument("--layer-only", action="store_true", help="only the clef-flash-shaped layer's table")
    parser.add_argument(
        "--rows", default="1,16,64,128,256,512,1024,4096", help="rows a step of the layer table (comma-separated)"
    )
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(*args.probe)))
        return 0
    rows_list = tuple(int(r) for r in args.rows.split(","))
    if args.layer_only:
        print_layer(layer_overhead(args.device, args.dtype, args.repeats, rows_list), args.device, args.dtype)
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.release) if Path(args.release).is_dir() else build(args.release, Path(tmp))
        loads = {q: fresh_probe(q, path, args.device, args.dtype) for q in ("none", "int8")}
        times = latencies(path, args.device, args.dtype, args.repeats)
    layer = layer_overhead(args.device, args.dtype, args.repeats, rows_list)
    mib = 2**20
    base = loads["none"]
    print(f"\nint8 weights vs {args.dtype} on {args.device} ({args.release}); memory above the process baseline")
    print(
        f"{'weights':8s} {'load s':>7s} {'resident MiB':>13s} {'peak MiB':>9s} {'after MiB':>10s} "
        f"{'512 tok ms':>11s} {'2048 tok ms':>12s}"
    )
    for q, name in (("none", args.dtype), ("int8", "int8")):
        load = loads[q]
        peak, after = load["anon_peak"] - load["anon_before"], load["anon_after"] - load["anon_before"]
        print(
            f"{name:8s} {load['seconds']:7.2f} {load['weights'] / mib:13.1f} {peak / mib:9.1f} {after / mib:10.1f} "
            f"{times[(q, 512)] * 1e3:11.1f} {times[(q, 2048)] * 1e3:12.1f}"
        )
    int8 = loads["int8"]
    print(
        f"ratios int8/{args.dtype}: resident weights {int8['weights'] / base['weights']:.2f}, after load "
        f"{(int8['anon_after'] - int8['anon_before']) / (base['anon_after'] - base['anon_before']):.2f}, peak "
        f"{(int8['anon_peak'] - int8['anon_before']) / (base['anon_peak'] - base['anon_before']):.2f}, latency "
        f"{times[('int8', 512)] / times[('none', 512)]:.2f} (512) {times[('int8', 2048)] / times[('none', 2048)]:.2f}"
        " (2048)"
    )
    print_layer(layer, args.device, args.dtype)
    print("\nprojected per clef-flash step (6.94e9 int8 weights; 80% of bandwidth, 70% (V100) / 50% (T4) of peak)")
    print(f"{'card':6s} {'rows':>6s} {'dequant ms':>11s} {'GEMM ms':>9s} {'overhead':>9s}")
    for rows in (1024, 4096):
        for name, dequantize, gemm, overhead in projection(rows):
            print(f"{name:6s} {rows:>6d} {dequantize:11.1f} {gemm:9.1f} {overhead:8.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
