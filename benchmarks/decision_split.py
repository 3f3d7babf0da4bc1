#!/usr/bin/env python3
"""One whole decision at clef-flash's shapes (or the mid release's), timed and split by op: the trunk's GEMMs,
the delta rule, the conv, attention, the fused glue, int8 dequantization, the rest. Random weights are built
in device memory from the release's config alone (a 9B release written to disk and read back would take the
minutes a lent GPU does not have), with clef-tiny's tokenizer (its ids lie inside the vocabulary). Prints a
table last.

The split is each group's share of the decision's device time: on a GPU the kernels' durations (torch.profiler's
CUDA events, classified by kernel name: cuBLAS/CUTLASS GEMMs, our kernels by their names); on the CPU the ops'
self times. Targets (issue 52): the delta rule <= 10% of a 2,048-token decision, GEMMs >= 70%.

    python benchmarks/decision_split.py                                   # a GPU: 9B shapes, 2,048 tokens, f16
    python benchmarks/decision_split.py --quantize int8 --dtype f16
    python benchmarks/decision_split.py --device cpu --shape mid --tokens 256   # a smoke run on the CPU
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from decision_latency import RELEASES, interleaved_medians, markdown_table, publish, request_of_length  # noqa: E402

# Kernel (GPU) or op (CPU) names -> group, first match wins.
GROUPS = [
    ("delta rule", re.compile(r"gdr_chunk|gated_delta_rule")),
    ("conv", re.compile(r"conv1d")),
    ("attention", re.compile(r"paged_attention|reshape_and_cache|flash|sdpa|fmha|attention", re.I)),
    ("int8", re.compile(r"dequantize_int8|int8_linear|int8pack", re.I)),
    ("glue", re.compile(r"add_rms_norm|silu_mul|gated_rms_norm|rms_norm_rope|sigmoid_gate")),
    ("GEMMs", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|aten::(mm|addmm|bmm|matmul|linear)$|sm\d+_", re.I)),
]


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if pattern.search(name):
            return group
    return "other"


def random_decider(shape: str, device: torch.device, dtype: torch.dtype, quantize: str, directory: Path):
    """A Decider at `shape`'s config with random weights made on `device` (norms, decays and gates in realistic
    ranges so activations stay finite through every layer), int8 linear layers with quantize="int8"."""
    from releases import config_only_release

    from clef_cuda.decider import Decider, DecisionOptions
    from clef_cuda.model.config import load_release_config
    from clef_cuda.model.default_model import default_release
    from clef_cuda.model.head import JointSchemaHead
    from clef_cuda.model.quantize import is_quantized_name, quantize_int8
    from clef_cuda.model.trunk import Trunk
    from clef_cuda.model.weights import head_shapes, serving_dtype_for, trunk_shapes
    from clef_cuda.request.encoding import Tokenizer

    spec = RELEASES[shape]
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2)
    path = config_only_release(directory / shape, spec["text"], spec["head"], spec["vocab_size"], vision)
    config = load_release_config(path)
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(shape_, dtype_, std):
        return torch.randn(shape_, generator=generator, device=device, dtype=dtype_) * std

    trunk = {}
    for name, size in trunk_shapes(config.trunk).items():
        target = serving_dtype_for(name, dtype)
        if name.endswith("A_log"):
            tensor = torch.rand(size, generator=generator, device=device) * 2.5 - 1.0
        elif name.endswith("dt_bias"):
            tensor = randn(size, torch.float32, 0.5)
        elif name.endswith("norm.weight"):
            tensor = randn(size, target, 0.1)
        else:
            tensor = randn(size, target, 0.02)
        trunk[name] = quantize_int8(tensor, dtype) if quantize == "int8" and is_quantized_name(name) else tensor
        del tensor
    head = {name: randn(size, torch.float32, 0.02) for name, size in head_shapes(config.head).items()}
    tokenizer = Tokenizer.from_release(default_release(), "control")
    return Decider(
        config,
        Trunk(config.trunk, trunk, dtype),
        JointSchemaHead(config.head, head, trunk["lm_head.weight"]),
        tokenizer,
        DecisionOptions(max_length=65536),
    )


def split(decider, request) -> dict[str, float]:
    """Seconds of one decision by group (GROUPS): CUDA kernels' durations on a GPU, ops' self times on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    cuda = decider.device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        decider.decide(request)
        if cuda:
            torch.cuda.synchronize()
    parts: dict[str, float] = {}
    if cuda:
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                group = group_of(event.name)
                parts[group] = parts.get(group, 0.0) + event.device_time / 1e6
    else:
        for event in prof.key_averages():
            group = group_of(event.key)
            parts[group] = parts.get(group, 0.0) + event.self_cpu_time_total / 1e6
    return parts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=["9b", "mid"], default="9b", help="the release config (default 9b)")
    parser.add_argument("--dtype", choices=["f16", "bf16", "f32"], help="default: f16 on a GPU, f32 on the CPU")
    parser.add_argument("--quantize", choices=["none", "int8"], default="none")
    parser.add_argument("--tokens", default="2048", help="comma-separated record lengths (default 2048)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--autotune", choices=["fast", "off"], default="fast", help="as clef-serve at start-up")
    parser.add_argument("--markdown", help="append the table to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[
        args.dtype or ("f16" if device.type == "cuda" else "f32")
    ]
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.repeats < 1 or any(t < 64 for t in tokens):
        parser.error("--repeats must be positive and every --tokens value at least 64")
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        started = time.perf_counter()
        decider = random_decider(args.shape, device, dtype, args.quantize, Path(tmp))
        print(f"  built {args.shape} ({args.quantize}) in {time.perf_counter() - started:.1f} s", flush=True)
        if args.autotune != "off":
            from clef_cuda.serving.engine import EngineConfig
            from clef_cuda.tuning.autotune import autotune

            config = EngineConfig(max_num_seqs=1, prefill_chunk_size=decider.options.chunk_size)
            print(autotune(decider.trunk, config, args.autotune, trials="inline").table(), flush=True)
        for n in tokens:
            request = request_of_length(decider, n)
            actual = decider.encode(request).num_tokens
            (seconds,) = interleaved_medians([lambda r=request: decider.decide(r)], args.repeats, device)
            parts = split(decider, request)
            total = max(sum(parts.values()), 1e-12)
            share = {group: 100 * parts.get(group, 0.0) / total for group, _ in [*GROUPS, ("other", None)]}
            rows.append(
                [
                    f"{args.shape} {args.quantize}",
                    f"{actual}",
                    f"{seconds * 1e3:.1f}",
                    *(f"{share[g]:.1f}%" for g in share),
                    "yes" if share["delta rule"] <= 10 else "no",
                    "yes" if share["GEMMs"] >= 70 else "no",
                ]
            )
            print(f"  {actual} tokens: {seconds * 1e3:.1f} ms; " + ", ".join(f"{g} {v:.1f}%" for g, v in share.items()))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    title = (
        f"{time.strftime('%Y-%m-%d')}, {where}, {str(dtype).removeprefix('torch.')}, one decision split by op "
        "(python benchmarks/decision_split.py)"
    )
    header = ["model", "tokens", "decision ms", *(g for g, _ in GROUPS), "other", "delta rule <= 10%", "GEMMs >= 70%"]
    publish(markdown_table(title, header, rows), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
