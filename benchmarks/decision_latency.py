#!/usr/bin/env python3
"""Decision latency of our Decider vs the upstream reference (transformers + the vendored joint head,
clef_finetune's load_release_model/systemone) on the same machine, in the same run and dtype, for
records of 512, 2048 and 8192 tokens, on a tiny and a mid-size (~130M parameter) random release; plus
peak host memory while loading each. Prints a table last: time, speed-up, and where our time goes
(trunk GEMMs, delta-net kernels, attention kernels, the rest of the trunk, the head).

    python benchmarks/decision_latency.py                 # CPU, fp32
    python benchmarks/decision_latency.py --device cuda --dtype f16 --release 9b   # a 9B-shaped release
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from releases import FLASH_HEAD, FLASH_TEXT, FLASH_VOCAB  # noqa: E402  (tests/ is on the path only now)

RELEASES = {
    "tiny": None,  # clef_finetune.tiny.build_tiny_release
    "mid": dict(
        text=dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            linear_num_key_heads=8,
            linear_num_value_heads=16,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            initializer_range=0.02,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        ),
        head={"hidden_size": 1024, "width": 256, "routing_layers": 2, "layers": 2, "heads": 8, "feedforward": 1024},
        vocab_size=32000,
    ),
    # clef-flash's shapes (Qwen3.5-9B trunk, the released head), random weights: for a GPU
    "9b": dict(text=dict(FLASH_TEXT, initializer_range=0.02), head=FLASH_HEAD, vocab_size=FLASH_VOCAB),
}
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def build(name: str, directory: Path) -> Path:
    if name == "tiny":
        from clef_finetune.tiny import build_tiny_release

        return build_tiny_release(directory / name)
    from releases import build_release

    spec = RELEASES[name]
    return build_release(
        directory / name, text=spec["text"], head=spec["head"], vocab_size=spec["vocab_size"], max_shard_size="2GB"
    )


def request_of_length(decider, tokens: int) -> dict:
    """A noul + choice + score request whose encoded record has about `tokens` tokens."""
    words = "Checkout has been failing for every customer; orders are blocked and refunds pile up. "
    request = {
        "model": "clef-flash",
        "state": "",
        "questions": {
            "outage": {"type": "noul", "instructions": "Is a service down?"},
            "department": {
                "type": "choice",
                "instructions": "Which team?",
                "criteria": {"billing": "Payments", "technical": "Bugs, outages", "sales": "Purchases"},
            },
            "urgency": {"type": "score", "instructions": "How soon?", "criteria": ["Can wait", "This week", "Today"]},
        },
    }
    fixed = decider.encode(request).num_tokens
    per_repeat = len(decider.tokenizer.encode(words))
    request["state"] = words * max(0, (tokens - fixed) // per_repeat)
    while decider.encode(request).num_tokens < tokens:
        request["state"] += "x"
    return request


def markdown_table(title: str, header: list[str], rows: list[list[str]]) -> list[str]:
    """A "### title" line and a markdown table: the form benchmarks/RESULTS.md keeps."""
    return [
        f"### {title}",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ] + ["| " + " | ".join(r) + " |" for r in rows]


def publish(lines: list[str], markdown: str | None) -> None:
    """Print the table last, and append it to `markdown` when given."""
    table = "\n".join(lines)
    if markdown:
        with open(markdown, "a") as f:
            f.write("\n" + table + "\n")
    print()
    print(table)


def interleaved_medians(fns: list, repeats: int, device) -> list[float]:
    """Median seconds of each fn, their runs interleaved (a, b, a, b, ...) so that a shared machine's
    changing load falls on all of them alike."""

    def run(fn):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        run(fn)  # warm-up
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            times[i].append(run(fn))
    return [statistics.median(t) for t in times]


LOAD_PROBE = """
import json, resource, sys, time, torch
kind, path, device, dtype = sys.argv[1:5]
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
if kind == "ours":
    from clef_cuda import Decider
    Decider.from_release(path, device=device, dtype=getattr(torch, dtype), progress=False)
else:
    from clef_finetune.jsm import load_jsm
    load_jsm().load_release_model(path, device=device, dtype=getattr(torch, dtype))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": time.perf_counter() - t0, "peak_mb": peak / 1024, "import_mb": base / 1024}))
"""


def load_footprint(kind: str, path: Path, device: str, dtype: torch.dtype) -> dict:
    """Peak resident host memory (MB) of a fresh process that only loads the release, and load time."""
    out = subprocess.run(
        [sys.executable, "-c", LOAD_PROBE, kind, str(path), device, str(dtype).removeprefix("torch.")],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def breakdown(decider, request) -> dict[str, float]:
    """Seconds of one decision by part: trunk GEMMs, delta-net kernels, attention kernels, rest of the
    trunk (norms, RoPE, casts, gathers), the head; from torch.profiler's self times."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if decider.device.type == "cuda" else [])
    head_consume, head_logits = decider.head.consume, decider.head.logits

    def consume(*a, **k):
        with record_function("clef::head"):
            return head_consume(*a, **k)

    def logits(*a, **k):
        with record_function("clef::head"):
            return head_logits(*a, **k)

    decider.head.consume, decider.head.logits = consume, logits
    try:
        record = decider.encode(request)
        with profile(activities=activities) as prof:
            decider.probabilities(record)
    finally:
        decider.head.consume, decider.head.logits = head_consume, head_logits
    cuda = decider.device.type == "cuda"
    events = prof.key_averages()

    def self_time(e):
        return (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e6

    parts = {"GEMMs": 0.0, "delta net": 0.0, "attention": 0.0, "head": 0.0, "other": 0.0}
    head_total = sum((e.device_time_total if cuda else e.cpu_time_total) / 1e6 for e in events if e.key == "clef::head")
    for e in events:
        if e.key == "clef::head":
            continue
        if e.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear") or "gemm" in e.key.lower():
            parts["GEMMs"] += self_time(e)
        elif e.key in ("clef::causal_conv1d_fwd", "clef::gated_delta_rule_chunk"):
            parts["delta net"] += self_time(e)
        elif e.key in ("clef::paged_attention", "clef::reshape_and_cache"):
            parts["attention"] += self_time(e)
        else:
            parts["other"] += self_time(e)
    # The head's own GEMMs and ops were counted above too: move them to the head.
    parts["head"] = head_total
    total = sum(v for k, v in parts.items() if k != "head")
    scale = max(total - head_total, 1e-9) / max(total, 1e-9)
    for k in ("GEMMs", "delta net", "attention", "other"):
        parts[k] *= scale
    return parts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="f32")
    parser.add_argument("--release", action="append", choices=list(RELEASES), help="default: tiny and mid")
    parser.add_argument("--tokens", default="512,2048,8192")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-reference", action="store_true", help="time ours only (e.g. 9b on a GPU)")
    parser.add_argument(
        "--autotune", choices=["fast", "full", "off"], default="fast", help="as clef-serve: the start-up autotune"
    )
    parser.add_argument("--markdown", help="append the table to this file")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    tokens = [int(t) for t in args.tokens.split(",")]
    from clef_cuda import Decider

    rows, loads = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.release or ["tiny", "mid"]:
            path = build(name, Path(tmp))
            ours_load = load_footprint("ours", path, args.device, dtype)
            ref_load = None if args.no_reference else load_footprint("reference", path, args.device, dtype)
            loads.append((name, ours_load, ref_load))
            # the tiny release declares 4,096 trained positions, which its random weights do not know of; the
            # table's 8,192-token records are past them
            decider = Decider.from_release(
                path, device=device, dtype=dtype, progress=False, max_length=16384, allow_long_context=True
            )
            if args.autotune != "off":  # as clef-serve does at start-up: the fastest checked kernels per call shape
                from clef_cuda.serving.engine import EngineConfig
                from clef_cuda.tuning.autotune import autotune

                config = EngineConfig(max_num_seqs=1, prefill_chunk_size=decider.options.chunk_size)
                print(autotune(decider.trunk, config, args.autotune).table(), flush=True)
            reference = None
            if not args.no_reference:
                from clef_finetune.jsm import load_jsm

                jsm = load_jsm()
                model, processor = jsm.load_release_model(path, device=str(device), dtype=dtype)
                reference = (jsm, model, processor)
            for n in tokens:
                request = request_of_length(decider, n)
                actual = decider.encode(request).num_tokens
                fns = [lambda r=request, d=decider: d.decide(r)]
                if reference is not None:
                    jsm, model, processor = reference
                    fns.append(lambda r=request, j=jsm, m=model, p=processor: j.systemone(m, p, r))
                times = interleaved_medians(fns, args.repeats, device)
                ours, ref = times[0], (times[1] if reference is not None else None)
                parts = breakdown(decider, request)
                share = "  ".join(f"{k} {100 * v / max(sum(parts.values()), 1e-9):.0f}%" for k, v in parts.items())
                rate = f"{actual / ours:,.0f}"
                rows.append(
                    [
                        name,
                        f"{actual}",
                        f"{ours * 1e3:.1f}",
                        rate,
                        "-" if ref is None else f"{ref * 1e3:.1f}",
                        "-" if ref is None else f"{ref / ours:.2f}x",
                        share,
                    ]
                )
                print(
                    f"  {name} {actual} tokens: ours {ours * 1e3:.1f} ms, reference "
                    f"{'-' if ref is None else f'{ref * 1e3:.1f} ms'} ({share})",
                    flush=True,
                )
            del decider, reference

    header = ["release", "tokens", "ours ms", "tokens/s", "reference ms", "speed-up", "where our time goes"]
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    title = f"{time.strftime('%Y-%m-%d')}, {device_name}, {args.dtype}, decision latency"
    lines = markdown_table(f"{title} (python benchmarks/decision_latency.py)", header, rows)
    lines += [
        "",
        "| release | peak host MB while loading: ours | reference | load s: ours | reference |",
        "|---|---|---|---|---|",
    ]
    for name, ours_load, ref_load in loads:
        ref_peak = "-" if ref_load is None else f"{ref_load['peak_mb']:.0f}"
        ref_seconds = "-" if ref_load is None else f"{ref_load['seconds']:.2f}"
        lines.append(
            f"| {name} | {ours_load['peak_mb']:.0f} (torch import alone {ours_load['import_mb']:.0f}) | "
            f"{ref_peak} | {ours_load['seconds']:.2f} | {ref_seconds} |"
        )
    publish(lines, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
