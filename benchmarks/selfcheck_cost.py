#!/usr/bin/env python3
"""What the on-device self-check (clef_cuda.serving.selfcheck) costs at start-up: measured on this machine for
the embedded clef-tiny, the test-suite's mid release and a trunk with clef-flash's layer shapes (one
delta-net and one attention layer, random weights: the check runs one real layer of each kind, so more
layers cost nothing), and the work it does there (FLOPs of the layer checks, bytes of weights read), from
which a GPU's time is estimated. Table last.

    python benchmarks/selfcheck_cost.py                  # CPU, fp32
    python benchmarks/selfcheck_cost.py --device cuda --dtype f16
    python benchmarks/selfcheck_cost.py --device cuda --dtype f16 --quantize int8 --only-flash

Exits 1 when a self-check fails (scripts/gpu_check.sh gates on it: at clef-flash's shapes the attention
check runs the tensor-core kernel at head dim 256, which clef-tiny's head dim 32 never reaches).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from clef_cuda import Decider  # noqa: E402
from clef_cuda.model.config import FULL_ATTENTION, LINEAR_ATTENTION, TrunkConfig  # noqa: E402
from clef_cuda.model.default_model import default_release  # noqa: E402
from clef_cuda.model.quantize import is_quantized_name, quantize_int8  # noqa: E402
from clef_cuda.model.trunk import Trunk  # noqa: E402
from clef_cuda.model.weights import serving_dtype_for, trunk_shapes  # noqa: E402
from clef_cuda.serving.selfcheck import LAYER_STEPS, run_selfcheck  # noqa: E402

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# clef-flash (Qwen3.5-9B text trunk), one layer of each kind; a small vocabulary (the check never embeds).
FLASH_LAYERS = TrunkConfig(
    hidden_size=4096,
    intermediate_size=12288,
    layer_types=(LINEAR_ATTENTION, FULL_ATTENTION),
    vocab_size=1024,
    rms_norm_eps=1e-6,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    rotary_dim=64,
    rope_theta=1e7,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=False,
)
# Rates for the GPU estimate (shared/specs/kernels.md): V100 SXM2, f16.
V100_GEMM_FLOPS, V100_BANDWIDTH = 100e12, 790e9


def random_trunk(config: TrunkConfig, device, dtype, quantize: str = "none") -> Trunk:
    """Random weights at `config`'s shapes; with quantize="int8" as the loader would store them."""
    generator = torch.Generator().manual_seed(0)
    weights = {}
    for name, shape in trunk_shapes(config).items():
        tensor = (torch.randn(shape, generator=generator) * 0.02).to(device, serving_dtype_for(name, dtype))
        weights[name] = quantize_int8(tensor, dtype) if quantize == "int8" and is_quantized_name(name) else tensor
    return Trunk(config, weights, dtype)


def mixer_work(config: TrunkConfig, dtype: torch.dtype) -> tuple[float, float]:
    """(FLOPs, weight bytes) of the two layer checks: every projection GEMM of one delta-net and one
    attention mixer, over both prefill steps, once on the ops and once on the references."""
    h, d = config.hidden_size, config.head_dim
    delta_net = (config.conv_dim + config.value_dim + 2 * config.linear_num_value_heads) * h + h * config.value_dim
    attention = (config.num_attention_heads * 2 * d + 2 * config.num_key_value_heads * d) * h
    attention += h * config.num_attention_heads * d
    tokens = sum(sum(step) for step in LAYER_STEPS)
    params = delta_net + attention
    bytes_per = torch.finfo(dtype).bits // 8
    return 2 * 2 * tokens * params, 2 * len(LAYER_STEPS) * params * bytes_per


def timed(trunk: Trunk, block_size: int, repeats: int) -> tuple[float, float, int, bool]:
    """(first run s, median of the next runs s, checks, passed): the first includes first-use set-up."""
    first = run_selfcheck(trunk, block_size=block_size)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        report = run_selfcheck(trunk, block_size=block_size)
        times.append(time.perf_counter() - started)
    return first.seconds, statistics.median(times), len(report.checks), first.passed and report.passed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    parser.add_argument("--quantize", choices=["none", "int8"], default="none", help="int8 weights (W8A16)")
    parser.add_argument("--only-flash", action="store_true", help="only the clef-flash layer shapes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    device, dtype, q = torch.device(args.device), DTYPES[args.dtype], args.quantize
    from releases import mid_release

    def release(path):
        return lambda: Decider.from_release(path, device, dtype, progress=False, quantize=q).trunk

    cases = {} if args.only_flash else {"clef-tiny (embedded)": release(default_release())}
    if not args.only_flash:
        cases["mid (tests/releases.py)"] = release(mid_release())
    cases["clef-flash layer shapes"] = lambda: random_trunk(FLASH_LAYERS, device, dtype, q)
    rows = []
    for name, build in cases.items():
        trunk = build()
        first, median, checks, passed = timed(trunk, args.block_size, args.repeats)
        flops, weight_bytes = mixer_work(trunk.config, dtype)
        rows.append((name, checks, passed, first, median, flops, weight_bytes))
        del trunk

    flops, weight_bytes = mixer_work(FLASH_LAYERS, torch.float16)
    device_ms = 1e3 * (flops / V100_GEMM_FLOPS + weight_bytes / V100_BANDWIDTH)
    weights = " with int8 weights" if q == "int8" else ""
    print(f"\nself-check cost on {args.device} ({torch.get_num_threads()} threads), {args.dtype}{weights}")
    print(
        f"{'model':<26} {'checks':>6} {'passed':>6} {'first run s':>11} {'median s':>9} "
        f"{'layer GFLOP':>11} {'weights MB':>10}"
    )
    for name, checks, passed, first, median, flops_, bytes_ in rows:
        print(
            f"{name:<26} {checks:>6} {str(passed):>6} {first:>11.3f} {median:>9.3f} "
            f"{flops_ / 1e9:>11.2f} {bytes_ / 1e6:>10.0f}"
        )
    print(
        f"\nGPU estimate at clef-flash shapes (V100, f16): the layer checks' GEMMs {flops / 1e9:.1f} GFLOP and "
        f"{weight_bytes / 1e6:.0f} MB of weight reads = {device_ms:.1f} ms of device time at "
        f"{V100_GEMM_FLOPS / 1e12:.0f} TFLOP/s and {V100_BANDWIDTH / 1e9:.0f} GB/s; the op checks move a few MB. "
        "The rest is launches (a few hundred, the references' Python loops) and the first use of cuBLAS/cuDNN "
        "on the device: about a second in all, dominated by that first use."
    )
    failed = [name for name, _, passed, *_ in rows if not passed]
    if failed:
        print(f"\nSELF-CHECK FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
