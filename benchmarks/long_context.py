#!/usr/bin/env python3
"""Long records on the CPU: our decision against the reference's (clef_finetune's systemone with max_length raised
past the record, so it reads all of it) at 4k to 256k tokens, on the same CPU and threads, in one run. Per length:
both times, the speed-up, our peak resident memory above the weights and the KV cache and state (the growth from the
shortest length to the longest is the memory target), attention's share of our time and its FLOP rate against this
machine's f32 GEMM rate measured in the same run (the FLOP-bound ratio).

Each side runs in a fresh process per length (peak resident memory is a process's high-water mark). The release is
clef_finetune's tiny one (clef-flash's layer pattern, 3 delta-rule layers to 1 attention layer, 4,096 trained
positions: long records are past them, which its random weights do not know of, so both sides are allowed).

    python benchmarks/long_context.py                               # 4k ... 256k (64k: about a minute on 2 cores)
    python benchmarks/long_context.py --tokens 4096,16384 --markdown benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from decision_latency import markdown_table, publish  # noqa: E402

# One decision in a fresh process: ours (its attention calls timed) or the reference's.
DECISION_PROBE = r"""
import json, resource, sys, time, torch
sys.path.insert(0, sys.argv[4])
kind, path, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
from clef_cuda import Decider
from decision_latency import request_of_length

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

# both sides encode the same request: our tokenizer is the release's (the reference's own tokenizer agrees)
decider = Decider.from_release(path, device="cpu", dtype=torch.float32, progress=False,
                               max_length=tokens + 1024, allow_long_context=True)
request = request_of_length(decider, tokens)
actual = decider.encode(request).num_tokens
result = {"tokens": actual}
if kind == "ours":
    ops, attention = decider.trunk.ops, decider.trunk.ops.paged_attention
    spent = [0.0]

    def timed_attention(*args, **kwargs):  # the kernel's own seconds (a profiler's start alone took 2 s)
        t = time.perf_counter()
        out = attention(*args, **kwargs)
        spent[0] += time.perf_counter() - t
        return out

    ops.paged_attention = timed_attention
    decider.decide(dict(request, state=request["state"][:2000]))  # warm-up: the kernels' first calls
    loaded_mb = rss_mb()
    spent[0] = 0.0
    t0 = time.perf_counter()
    body = decider.decide(request)
    result["seconds"] = time.perf_counter() - t0
    result["attention_seconds"] = spent[0]
    config = decider.trunk.config
    attention_layers = sum(t == "full_attention" for t in config.layer_types)
    chunk = decider.options.chunk_size
    pairs = sum(q * (q + 1) // 2 + q * start for start in range(0, actual, chunk) for q in [min(chunk, actual - start)])
    result["attention_flops"] = 4.0 * config.head_dim * config.num_attention_heads * pairs * attention_layers
    blocks = -(-actual // 16)
    kv_bytes = 2 * attention_layers * blocks * 16 * config.num_key_value_heads * config.head_dim * 4
    result["kv_mb"] = kv_bytes / 2**20
    result["loaded_mb"] = loaded_mb
    result["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
else:
    from clef_finetune.jsm import load_jsm
    jsm = load_jsm()
    model, processor = jsm.load_release_model(path, device="cpu", dtype=torch.float32)
    warm = dict(request, state=request["state"][:2000])
    jsm.systemone(model, processor, warm, max_length=tokens + 1024)
    t0 = time.perf_counter()
    body = jsm.systemone(model, processor, request, max_length=tokens + 1024)
    result["seconds"] = time.perf_counter() - t0
result["body"] = body
print(json.dumps(result))
"""


def decision(kind: str, path: Path, tokens: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", DECISION_PROBE, kind, str(path), str(tokens), str(ROOT / "benchmarks")],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"long_context: the {kind} decision at {tokens} tokens failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def gemm_rate() -> float:
    """This machine's f32 GEMM rate (GFLOP/s, best of 3 at 2048^3) on the threads the decisions use."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(3))
    return 2 * 2048**3 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def rounded_answers(body: dict) -> dict:
    return body["answers"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="4096,16384,65536,131072,262144")
    parser.add_argument("--no-reference", action="store_true", help="time ours only")
    parser.add_argument("--markdown", help="append the table to this file")
    args = parser.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    from clef_finetune.tiny import build_tiny_release

    rows, extras = [], []
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_release(Path(tmp) / "tiny")
        for n in lengths:
            gemm = gemm_rate()
            ours = decision("ours", path, n)
            ref = None if args.no_reference else decision("reference", path, n)
            extra = ours["peak_mb"] - ours["loaded_mb"] - ours["kv_mb"]
            extras.append(extra)
            attention_rate = ours["attention_flops"] / max(ours["attention_seconds"], 1e-9) / 1e9
            same = (
                "-"
                if ref is None
                else ("yes" if rounded_answers(ref["body"]) == rounded_answers(ours["body"]) else "NO")
            )
            rows.append(
                [
                    f"{ours['tokens']:,}",
                    f"{ours['seconds']:.2f}",
                    "-" if ref is None else f"{ref['seconds']:.2f}",
                    "-" if ref is None else f"{ref['seconds'] / ours['seconds']:.2f}x",
                    same,
                    f"{ours['kv_mb']:.0f}",
                    f"{extra:.0f}",
                    f"{100 * ours['attention_seconds'] / ours['seconds']:.0f}%",
                    f"{attention_rate:.1f}",
                    f"{gemm:.1f}",
                    f"{attention_rate / gemm:.0%}",
                ]
            )
            print("  " + " | ".join(rows[-1]), flush=True)
    header = [
        "tokens",
        "ours s",
        "reference s",
        "speed-up",
        "answers equal",
        "KV MB",
        "peak MB above weights + KV",
        "attention's share",
        "attention GFLOP/s",
        "f32 GEMM GFLOP/s",
        "FLOP-bound ratio",
    ]
    title = f"{time.strftime('%Y-%m-%d')}, CPU, {torch.get_num_threads()} threads, f32, clef_finetune's tiny release"
    lines = markdown_table(f"{title}: long records (python benchmarks/long_context.py)", header, rows)
    if len(extras) > 1:
        growth = (extras[-1] - extras[0]) / max(extras[0], 1e-9)
        lines += ["", f"Memory above weights + KV from {lengths[0]:,} to {lengths[-1]:,} tokens: {growth:+.1%}."]
    publish(lines, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
