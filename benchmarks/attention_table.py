#!/usr/bin/env python3
"""Attention prefill on a GPU: our tensor-core kernels (WMMA v1 and v2) and SIMT paged_attention kernel
against torch's SDPA with each backend forced (flash, memory-efficient, math), then one full trunk step
split by op.

Attention at clef-flash's shapes (16 query / 4 KV heads x 256, KV blocks of 16, f16): 1 and 4 records,
contexts of 1k, 4k and 16k tokens, each step a 1024-token chunk at the end of the context (a fresh 1k
prefill; a chunk after a cached 3k or 15k prefix) and a 64-token one (a prefix-cache hit: few CTAs, where
v2's split-context pass runs), causal inside the chunk. Ours reads the paged cache
(blocks scattered); SDPA gets the same K/V already gathered into contiguous tensors and a lower-right
causal mask. Rate = 4 Hq D x (query, attended key) pairs / time, against an f16 GEMM measured in the same
run. The trunk step: clef-flash's 32 layers (24 Gated DeltaNet, 8 attention) on random weights, 4 records
x 1024 new tokens after a cached prefix, one forward under the torch profiler, device time grouped by
kernel. Tables last; --markdown writes them.

    python benchmarks/attention_table.py --markdown $OUT/attention_table.md     # a GPU (gpu_check.sh)
    python benchmarks/attention_table.py --dry-run   # anywhere: every case at toy sizes, run once, untimed
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases as bench_cases  # noqa: E402
from kernel_table import measured_peaks, timer  # noqa: E402
from selfcheck_cost import FLASH_LAYERS  # noqa: E402

from clef_cuda.kernels import ops  # noqa: E402
from clef_cuda.model.config import FULL_ATTENTION, LINEAR_ATTENTION, TrunkConfig  # noqa: E402
from clef_cuda.model.trunk import ChunkBatch, SequenceChunk, Trunk  # noqa: E402
from clef_cuda.model.trunk_cache import TrunkCache  # noqa: E402
from clef_cuda.model.weights import serving_dtype_for, trunk_shapes  # noqa: E402

HQ, HKV, D, BLOCK = (
    bench_cases.ATTN_Q_HEADS,
    bench_cases.ATTN_KV_HEADS,
    bench_cases.ATTN_HEAD_DIM,
    bench_cases.BLOCK_SIZE,
)
# clef-flash's trunk (Qwen3.5-9B text): selfcheck_cost's layer shapes, 8 x (3 Gated DeltaNet + 1 gated
# attention) layers; a small vocabulary (the step only embeds its ids).
FLASH_TRUNK = dataclasses.replace(FLASH_LAYERS, layer_types=((LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)) * 8)
# Device time of a trunk step, grouped by kernel name (first match wins).
KERNEL_GROUPS = [
    ("paged attention, tensor cores v2", r"paged_attention_wmma2|paged_attention_split_combine"),
    ("paged attention, tensor cores", r"paged_attention_wmma"),
    ("paged attention, SIMT", r"paged_attention_kernel"),
    ("paged attention, CPU", r"clef::paged_attention"),
    ("KV cache write", r"reshape_and_cache"),
    ("gated delta rule", r"gated_delta_rule"),
    ("causal conv1d", r"conv1d"),
    ("GEMMs (cuBLAS)", r"gemm|cutlass|xmma|nvjet|cublas|aten::(addmm|mm|linear|matmul)"),
]


@dataclasses.dataclass
class AttentionCase:
    records: int
    context: int
    chunk: int
    runs: dict[str, Callable[[], object]]  # method -> callable
    notes: dict[str, str]  # method -> why it cannot run, or how it was run
    auto: str  # the kernel paged_attention's dispatch picks

    @property
    def flops(self) -> float:
        pairs = self.chunk * (self.context - self.chunk) + self.chunk * (self.chunk + 1) // 2
        return 4.0 * HQ * D * self.records * pairs


def sdpa_runs(q, k, v, chunk: int, context: int) -> tuple[dict[str, Callable], dict[str, str]]:
    """SDPA with each backend forced. GQA natively (enable_gqa) where the backend takes it, else on K/V
    repeated to the query heads; a backend that takes neither is reported with its error."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(chunk, context)
    repeated = (k.repeat_interleave(HQ // HKV, dim=1), v.repeat_interleave(HQ // HKV, dim=1))
    runs, notes = {}, {}
    for name, backend in (
        ("SDPA flash", SDPBackend.FLASH_ATTENTION),
        ("SDPA mem-efficient", SDPBackend.EFFICIENT_ATTENTION),
        ("SDPA math", SDPBackend.MATH),
    ):

        def native(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

        def expanded(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, *repeated, attn_mask=mask)

        errors = []
        for fn, how in ((native, "GQA native"), (expanded, "K/V repeated to 16 heads")):
            try:
                fn()
            except RuntimeError as error:
                errors.append(str(error).splitlines()[0][:80])
                continue
            runs[name], notes[name] = fn, how
            break
        else:
            notes[name] = "n/a: " + "; ".join(dict.fromkeys(errors))
    return runs, notes


def attention_case(records: int, context: int, chunk: int, dtype, device) -> AttentionCase:
    key_cache, value_cache, block_tables = bench_cases._paged_context(records, context, dtype, device)
    query = torch.randn(records * chunk, HQ, D, dtype=dtype, device=device)
    cu = bench_cases._cu([chunk] * records, device)
    context_lens = torch.full((records,), context, dtype=torch.int32, device=device)
    out = torch.empty_like(query)
    args = (query, key_cache, value_cache, cu, context_lens, block_tables)
    kernels = ("wmma", "wmma2", "simt") if device.type == "cuda" else ("auto",)
    runs = {f"ours {k}": (lambda k=k: ops.paged_attention(*args, out=out, kernel=k)) for k in kernels}
    notes = {}
    for name, fn in list(runs.items()):
        try:
            fn()
        except (RuntimeError, ValueError) as error:
            del runs[name]
            notes[name] = "n/a: " + str(error).splitlines()[0][:80]
    q = query.view(records, chunk, HQ, D).transpose(1, 2)
    k = bench_cases._contiguous_kv(key_cache, block_tables, context)
    v = bench_cases._contiguous_kv(value_cache, block_tables, context)
    sdpa, sdpa_notes = sdpa_runs(q, k, v, chunk, context)
    auto = ops.paged_attention_dispatch(*args)
    return AttentionCase(records, context, chunk, runs | sdpa, notes | sdpa_notes, auto)


def random_trunk(config: TrunkConfig, device, dtype) -> Trunk:
    """Random weights drawn on the device (9 B parameters: drawing them on the host would take minutes)."""
    generator = torch.Generator(device=device).manual_seed(0)
    weights = {}
    for name, shape in trunk_shapes(config).items():
        w = torch.randn(shape, generator=generator, device=device, dtype=torch.float32).mul_(0.02)
        weights[name] = w.to(serving_dtype_for(name, dtype))
    return Trunk(config, weights, dtype)


def trunk_step_profile(config: TrunkConfig, records: int, chunk: int, context: int, dtype, device, measure):
    """(step ms, [(group, device ms)]) of one trunk forward: `records` records of `chunk` new tokens at
    the end of a `context`-token context (the prefix's cache blocks are there, zeros)."""
    from torch.profiler import ProfilerActivity, profile

    trunk = random_trunk(config, device, dtype)
    blocks = -(-context // BLOCK)
    cache = TrunkCache.allocate(config, records, records * blocks, BLOCK, device, dtype)
    start = context - chunk
    chunks = [
        SequenceChunk([b % config.vocab_size] * chunk, start, b, list(range(b * blocks, (b + 1) * blocks)))
        for b in range(records)
    ]
    batch = ChunkBatch.build(chunks, BLOCK, device)

    def step():
        with contextlib.suppress(Exception):  # random weights may overflow f16 at the end: timing is what counts
            trunk.forward(batch, cache)

    step_s = measure(step)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    groups = {name: 0.0 for name, _ in KERNEL_GROUPS} | {"other (norms, RoPE, gates, elementwise)": 0.0}
    for event in prof.key_averages():
        on_device = device.type == "cuda" and _device_time(event) > 0 and _is_kernel(event)
        on_host = device.type != "cuda" and event.key.startswith(("clef::", "aten::addmm", "aten::mm"))
        if not (on_device or on_host):
            continue
        seconds = (_device_time(event) if on_device else event.self_cpu_time_total) / 1e6
        for name, pattern in KERNEL_GROUPS:
            if re.search(pattern, event.key):
                groups[name] += seconds
                break
        else:
            if on_device:
                groups["other (norms, RoPE, gates, elementwise)"] += seconds
    return step_s, groups


def _device_time(event) -> float:
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)


def _is_kernel(event) -> bool:
    device_type = getattr(event, "device_type", None)
    return device_type is not None and str(device_type).endswith("CUDA")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["f16", "bf16"], default="f16")
    parser.add_argument("--records", default="1,4")
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--hit-chunk", type=int, default=64, help="a prefix-cache hit's chunk (0: none)")
    parser.add_argument("--trunk-context", type=int, default=4096, help="context of the profiled trunk step")
    parser.add_argument("--no-trunk", action="store_true", help="skip the trunk step (it needs ~20 GB)")
    parser.add_argument("--markdown", help="write the tables, with date and device, to this file")
    parser.add_argument("--dry-run", action="store_true", help="toy sizes, each case run once, nothing timed")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    records = [int(r) for r in args.records.split(",")]
    contexts, chunk, trunk_config = [int(c) for c in args.contexts.split(",")], args.chunk, FLASH_TRUNK
    hit_chunk = args.hit_chunk
    trunk_context = args.trunk_context
    if args.dry_run:
        dtype = dtype if device.type == "cuda" else torch.float32  # the CPU kernels are fp32
        contexts, chunk, records, trunk_context, hit_chunk = [48, 80], 32, [1, 2], 80, 8
        trunk_config = dataclasses.replace(
            FLASH_TRUNK, hidden_size=256, intermediate_size=512, layer_types=FLASH_TRUNK.layer_types[:4]
        )
    torch.manual_seed(0)
    measure = (lambda fn: (fn(), 0.0)[1]) if args.dry_run else timer(device)
    _, gemm_tflops = measured_peaks(device, dtype, measure) if not args.dry_run else (0.0, 0.0)

    rows = []
    chunks = [c for c in dict.fromkeys([chunk, hit_chunk]) if c > 0]
    for n, context, q in ((n, context, q) for n in records for context in contexts for q in chunks):
        case = attention_case(n, context, min(q, context), dtype, device)
        label = f"B={n} ctx={context}" + ("" if q == chunk else f" hit q={case.chunk}")
        for method, fn in case.runs.items():
            seconds = measure(fn)
            rate = case.flops / seconds / 1e12 if seconds else 0.0
            peak = f"{100 * rate / gemm_tflops:.1f}%" if gemm_tflops else "-"
            rows.append([label, method, f"{seconds * 1e3:.3f}", f"{rate:.2f}", peak, case.notes.get(method, "")])
            print(f"  {label:24s} {method:20s} {seconds * 1e3:9.3f} ms {rate:8.2f} TFLOP/s", flush=True)
        rows += [[label, m, "-", "-", "-", note] for m, note in case.notes.items() if m not in case.runs]
        rows.append([label, "(auto picks)", "-", "-", "-", case.auto])
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()

    profile_rows, step_ms = [], 0.0
    if not args.no_trunk:
        step_s, groups = trunk_step_profile(trunk_config, max(records), chunk, trunk_context, dtype, device, measure)
        step_ms = step_s * 1e3
        total = sum(groups.values()) or 1.0
        profile_rows = [[name, f"{s * 1e3:.3f}", f"{100 * s / total:.1f}%"] for name, s in groups.items() if s > 0]

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    stamp = datetime.date.today().isoformat()
    dtype_name = str(dtype).removeprefix("torch.")
    lines = [
        f"### {stamp}, {name}, {dtype_name}, torch {torch.__version__}: attention prefill"
        + (" (dry run: toy sizes, untimed)" if args.dry_run else ""),
        "",
        f"H={HQ}/{HKV} D={D}, {chunk}-token chunks ending the context ('hit q=': a {hit_chunk}-token prefix-cache "
        f"hit), blocks of {BLOCK}. GEMM ({dtype_name}, "
        f"measured in this run): {gemm_tflops:.1f} TFLOP/s. SDPA runs on K/V gathered to contiguous tensors.",
        "",
        "| case | method | ms | TFLOP/s | % of GEMM | note |",
        "|---|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    if profile_rows:
        timed = "device time by kernel (torch profiler)" if device.type == "cuda" else "host time by op"
        lines += [
            "",
            f"One trunk step, {trunk_config.num_layers} layers, {max(records)} records x {chunk} new tokens after a "
            f"{trunk_context - chunk}-token prefix: {step_ms:.2f} ms; {timed}:",
            "",
            "| kernels | ms | share |",
            "|---|---|---|",
        ]
        lines += ["| " + " | ".join(row) + " |" for row in profile_rows]
    table = "\n".join(lines)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    print()
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
