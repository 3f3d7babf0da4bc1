#!/usr/bin/env python3
"""The gated delta rule at clef-flash's shape (B sequences, Hk 16, Hv 32, D 128): our chunked tensor-core kernel,
our token-serial kernel and FLA's chunk_gated_delta_rule, each by the device time of its work alone, and where
the chunked kernel's time goes by pass. Prints a table last.

Device time: each implementation's calls are captured in a CUDA graph and replayed (host launch overhead, which
put FLA at a flat ~1.2 ms in the first GPU run's table, is out); where a capture fails (a host sync inside an
implementation), the sum of its kernels' device durations from torch.profiler instead, the smallest of a few
calls. The chunked kernel's passes (prepare, state, output) are split the same way, from the profiler.

    python benchmarks/delta_rule_table.py                        # a GPU: 2k, 8k and 16k tokens, f16
    python benchmarks/delta_rule_table.py --dtype bf16 --batch 4
    python benchmarks/delta_rule_table.py --device cpu --tokens 256   # the CPU op alone (wall clock)

Targets (issue 52): the chunked kernel at or under FLA's device time at 2k, 8k and 16k tokens.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases as bench_cases  # noqa: E402

HK, HV, D = bench_cases.GDN_KEY_HEADS, bench_cases.GDN_VALUE_HEADS, bench_cases.GDN_HEAD_DIM
PASSES = {"prepare": "gdr_chunk_prepare_kernel", "state": "gdr_chunk_state_kernel", "output": "gdr_chunk_output_kernel"}


def graph_ms(fn, calls: int = 10, replays: int = 5) -> float | None:
    """Device ms of one call from a CUDA graph of `calls` calls, the best of `replays` replays; None when the
    capture fails."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm-up on the capture stream (allocator pools, Triton's autotune)
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except Exception as error:  # a host sync or an allocation the capture refuses
        print(f"    (CUDA graph capture failed: {str(error).splitlines()[0][:100]}; profiler timing)", flush=True)
        torch.cuda.synchronize()
        return None
    best = float("inf")
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / calls)
    return best


def kernel_ms(fn, calls: int = 5) -> dict[str, float]:
    """Device ms of each kernel one call launches (torch.profiler), the smallest over `calls` calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    best: dict[str, float] = {}
    for _ in range(calls):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        spent: dict[str, float] = {}
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                spent[event.name] = spent.get(event.name, 0.0) + event.device_time / 1e3
        if sum(spent.values()) < sum(best.values()) or not best:
            best = spent
    return best


def device_ms(fn) -> tuple[float, str]:
    ms = graph_ms(fn)
    if ms is not None:
        return ms, "graph"
    return sum(kernel_ms(fn).values()), "profiler"


def wall_ms(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


# The chunked kernel's state-pass variants at head dim 128 (gated_delta_rule.h gdr_state_variants).
STATE_VARIANTS = ("s16", "s32", "s64", "d64", "d128")


def inputs(batch: int, tokens: int, dtype, device):
    """q, k, v as views of one conv output (as the trunk passes them), fresh sequences of tokens / batch."""
    length = tokens // batch
    n = batch * length
    mixed = torch.randn(n, 2 * HK * D + HV * D, dtype=dtype, device=device)
    q = mixed[:, : HK * D].view(n, HK, D)
    k = mixed[:, HK * D : 2 * HK * D].view(n, HK, D)
    v = mixed[:, 2 * HK * D :].view(n, HV, D)
    g = -torch.rand(n, HV, device=device) * 2
    beta = torch.rand(n, HV, device=device)
    cu = torch.arange(0, n + 1, length, dtype=torch.int32, device=device)
    return q, k, v, g, beta, cu


def measure_row(n: int, batch: int, dtype, device, fla) -> list[str]:
    """One table row: `n` tokens over `batch` fresh sequences."""
    from clef_cuda.kernels import ops

    q, k, v, g, beta, cu = inputs(batch, n, dtype, device)
    states = torch.zeros(batch, HV, D, D, device=device)
    slots = torch.arange(batch, dtype=torch.int32, device=device)
    fresh = torch.zeros(batch, dtype=torch.bool, device=device)
    out = torch.empty_like(v)

    def ours(kernel):
        return lambda: ops.gated_delta_rule_chunk(q, k, v, g, beta, states, cu, slots, fresh, out=out, kernel=kernel)

    if device.type != "cuda":  # the CPU's one implementation: the token-serial scan
        return [f"{n}", "-", f"{wall_ms(ours('auto')):.3f} (CPU, wall)", "-", "-", "-", "-"]
    timed: dict[str, tuple[float, str]] = {}
    try:
        ops.gated_delta_rule_dispatch(q, v, cu, "chunked")
        timed["chunked"] = device_ms(ours("chunked"))
        # Every state-pass variant this device can run, beside the rule's pick: whether residency picks the fastest.
        picked = ops.gated_delta_rule_variant(q, v, cu, "chunked")
        variants = []
        for variant in STATE_VARIANTS:
            try:
                ops.gated_delta_rule_dispatch(q, v, cu, f"chunked:{variant}")
            except ValueError:  # its shared memory does not fit this device
                continue
            ms, _ = device_ms(ours(f"chunked:{variant}"))
            variants.append(f"{variant} {ms:.3f}{' (the rule)' if picked.endswith(':' + variant) else ''}")
        print(f"    state-pass variants, ms: {', '.join(variants)}", flush=True)
    except ValueError as why:  # Pascal, bf16 before sm_80, fp32
        print(f"    chunked kernel: {why}", flush=True)
    timed["serial"] = device_ms(ours("serial"))
    if fla is not None:
        chunk, _ = fla
        # FLA's batched layout (its cu_seqlens path reads them on the host, which a graph capture refuses).
        flat = [t.reshape(batch, n // batch, *t.shape[1:]) for t in (q, k, v, g, beta)]
        timed["FLA"] = device_ms(
            lambda: chunk(*flat[:3], g=flat[3], beta=flat[4], output_final_state=True, use_qk_l2norm_in_kernel=True)
        )
    split = "-"
    if "chunked" in timed:
        per_kernel = kernel_ms(ours("chunked"))
        parts = {p: sum(ms for name, ms in per_kernel.items() if kernel in name) for p, kernel in PASSES.items()}
        total = max(sum(parts.values()), 1e-9)
        split = ", ".join(f"{p} {100 * ms / total:.0f}%" for p, ms in parts.items())
    cells = {name: f"{ms:.3f} ({how})" for name, (ms, how) in timed.items()}
    print(f"  {n} tokens: " + ", ".join(f"{k} {c} ms" for k, c in cells.items()) + f"; chunked: {split}", flush=True)
    ratio = verdict = "-"
    if "chunked" in timed and "FLA" in timed:
        ratio = f"{timed['FLA'][0] / timed['chunked'][0]:.2f}x"
        verdict = "yes" if timed["chunked"][0] <= timed["FLA"][0] else "no"
    return [f"{n}", cells.get("chunked", "-"), cells["serial"], cells.get("FLA", "-"), ratio, verdict, split]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["f16", "bf16", "f32"], help="default: f16 on a GPU, f32 on the CPU")
    parser.add_argument("--tokens", help="comma-separated (default: GPU 2048,8192,16384; CPU 256,1024)")
    parser.add_argument("--batch", type=int, default=1, help="sequences sharing the tokens (default 1)")
    parser.add_argument("--markdown", help="append the table to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[
        args.dtype or ("f16" if cuda else "f32")
    ]
    tokens = [int(t) for t in (args.tokens or ("2048,8192,16384" if cuda else "256,1024")).split(",")]
    if args.batch < 1 or any(t < args.batch for t in tokens):
        parser.error("--batch must be at least 1 and at most every --tokens value")
    torch.manual_seed(0)
    bench_cases._qwen35()  # transformers' module before FLA becomes importable (cases.fla_ops)
    fla = bench_cases.fla_ops() if cuda else None
    rows = [measure_row(n, args.batch, dtype, device, fla) for n in tokens]

    from decision_latency import markdown_table, publish

    where = torch.cuda.get_device_name(device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    title = (
        f"{datetime.date.today().isoformat()}, {where}, {str(dtype).removeprefix('torch.')}, the delta rule at B="
        f"{args.batch} Hk={HK} Hv={HV} D={D}, device ms a call (python benchmarks/delta_rule_table.py)"
    )
    header = ["tokens", "ours chunked ms", "ours serial ms", "FLA ms", "FLA / chunked", "chunked <= FLA", "passes"]
    publish(markdown_table(title, header, rows), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
