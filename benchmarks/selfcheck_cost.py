#!/usr/bin/env python3
"""What the on-device self-check (clef_cuda.verification.selfcheck) costs at start-up: measured on this machine for
the embedded clef-tiny, the test-suite's mid release and a trunk with clef-flash's layer shapes (one
delta-net and one attention layer, random weights: the check runs one real layer of each kind, so more
layers cost nothing), and the work it does there (FLOPs of the layer checks, bytes of weights read), from
which a GPU's time is estimated. Table last.

    python benchmarks/selfcheck_cost.py                  # CPU, fp32
    python benchmarks/selfcheck_cost.py --device cuda --dtype f16
    python benchmarks/selfcheck_cost.py --device cuda --dtype f16 --quantize int8 --only-flash
    python benchmarks/selfcheck_cost.py --count --against 26d1e7a   # no GPU: its work, against a revision's

--count runs the self-check at clef-flash's layer shapes in f16 on the CUDA simulator's kernels (a simulated H100,
tests/cuda_sim) and counts what a GPU would pay for: our kernel launches, the torch ops the references and layers
issue, and their FLOPs; with --against REV the self-check of that revision (its clef_cuda/verification/selfcheck.py, on
today's kernels) beside it, and the H200's measured warm cost (WARM_H200_S, 0.10 s on 2026-12-04: launch- and
dispatch-bound at these sizes, its FLOPs a fraction of a millisecond) scaled by the ratio of launches and op calls
(ours and torch's): the estimate where no GPU is lent.

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
from clef_cuda.verification.selfcheck import LAYER_STEPS, run_selfcheck  # noqa: E402

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
# The self-check's warm cost at clef-flash's shapes in f16, measured on an H200 (benchmarks/RESULTS.md, 2026-12-04),
# and the revision it ran: what --count scales.
# The H200's self-check (23 checks in f16: 2026-12-04's second GPU run, RESULTS' "the gate") was this revision's.
WARM_H200_S, WARM_H200_REVISION = 0.10, "26d1e7a"
# Where a revision kept the self-check, newest first, and the imports of its time mapped to today's rooms (the
# package moved into rooms on 2026-12-06: the kernel layer out of the package root, guarded ops into verification/).
SELFCHECK_PATHS = ("clef_cuda/verification/selfcheck.py", "clef_cuda/serving/selfcheck.py")
MOVED_IMPORTS = {
    "from clef_cuda import ops, reference\n": "from clef_cuda.kernels import ops, reference\n",
    "clef_cuda.serving.guarded_ops": "clef_cuda.verification.guarded_ops",
}


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


def count_work(selfcheck_module, trunk) -> dict:
    """Kernel launches, torch ops (by the references, the layers' GEMMs, the glue around them) and their FLOPs of
    one run of `selfcheck_module`'s run_selfcheck on `trunk` (whose ops are the simulator's)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.torch_ops = self.ours = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "clef_sim":
                self.ours += 1
            elif func.namespace not in ("prim",):
                self.torch_ops += 1
            return func(*args, **(kwargs or {}))

    launches = torch.ops.clef_sim.launch_count()
    flops = FlopCounterMode(display=False)
    with flops, CountOps() as counted:
        report = selfcheck_module.run_selfcheck(trunk)
    return dict(
        checks=len(report.checks),
        passed=report.passed,
        launches=torch.ops.clef_sim.launch_count() - launches,
        our_ops=counted.ours,
        torch_ops=counted.torch_ops,
        flops=flops.get_total_flops(),
    )


def count(against: str | None) -> int:
    """--count: the self-check's work on the simulator at clef-flash's layer shapes, and the GPU estimate."""
    import importlib.util
    import subprocess
    import tempfile

    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "cuda_sim")]
    from build import load_cuda_sim
    from conftest import simulated

    from clef_cuda.verification import selfcheck

    sim_ops = load_cuda_sim()
    trunk = random_trunk(FLASH_LAYERS, torch.device("cpu"), torch.float16).with_ops(sim_ops)
    modules = {"today": selfcheck}
    if against:
        for where in SELFCHECK_PATHS:
            source = subprocess.run(["git", "show", f"{against}:{where}"], cwd=ROOT, capture_output=True, text=True)
            if source.returncode == 0:
                break
        else:
            print(f"selfcheck_cost: --against {against}: {source.stderr.strip()}", file=sys.stderr)
            return 2
        text = source.stdout
        for then, now in MOVED_IMPORTS.items():
            text = text.replace(then, now)
        path = Path(tempfile.mkdtemp(prefix="selfcheck-")) / "selfcheck_then.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location("selfcheck_then", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
        modules = {against: module, "today": selfcheck}
    rows = {}
    with simulated(compute_capability=90, multiprocessors=132), torch.inference_mode():
        for name, module in modules.items():
            started = time.perf_counter()
            rows[name] = count_work(module, trunk)
            print(f"{name}: {rows[name]} ({time.perf_counter() - started:.0f} s in the simulator)", flush=True)
    print("\nthe self-check's work at clef-flash's layer shapes, f16, a simulated H100 (CUDA simulator)")
    print(
        f"{'revision':10s} {'checks':>6s} {'passed':>6s} {'launches':>8s} {'our ops':>7s} {'torch ops':>9s} "
        f"{'GFLOP':>7s}"
    )
    for name, row in rows.items():
        print(
            f"{name:10s} {row['checks']:>6d} {str(row['passed']):>6s} {row['launches']:>8d} {row['our_ops']:>7d} "
            f"{row['torch_ops']:>9d} {row['flops'] / 1e9:>7.2f}"
        )
    if against == WARM_H200_REVISION:
        then, now = rows[against], rows["today"]

        def calls(row):  # what a GPU pays per call at these sizes: a launch, or a host-side op dispatch
            return row["launches"] + row["our_ops"] + row["torch_ops"]

        ratio = calls(now) / calls(then)
        print(
            f"\nGPU estimate: {WARM_H200_S:.2f} s warm on an H200 at {against} (measured), x {ratio:.2f} launches and "
            f"op calls = {WARM_H200_S * ratio:.2f} s today; the FLOPs ({now['flops'] / 1e9:.1f} GFLOP) are "
            f"{1e3 * now['flops'] / 400e12:.2f} ms at 400 TFLOP/s"
        )
    return 0 if all(row["passed"] for row in rows.values()) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    parser.add_argument("--quantize", choices=["none", "int8"], default="none", help="int8 weights (W8A16)")
    parser.add_argument("--only-flash", action="store_true", help="only the clef-flash layer shapes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--count", action="store_true", help="count its work on the CUDA simulator (no GPU needed)")
    parser.add_argument("--against", help="with --count: a git revision whose self-check to count beside today's")
    args = parser.parse_args()
    if args.count:
        return count(args.against)
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
