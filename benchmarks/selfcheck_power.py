#!/usr/bin/env python3
"""What the on-device self-check and the autotune's checks can see: every test-only fault of the CUDA kernels (each
CLEF_FAULT point in csrc/, tests/kernel_faults.py), switched on in turn in the CUDA simulator, against the
self-check the server runs (clef_cuda.verification.selfcheck.run_selfcheck, its real layers included) and the autotune's
checks (clef_cuda.tuning.autotune.autotune, inline, fast), on a release with clef-flash's per-head shapes and int8
weights in f16 (tests/releases.py flash_heads_release), each fault on its simulated device (the card of its arch in
csrc/common/arch_limits.h, with that card's SMs); beside them whether the op tests' own cases catch it
(tests/kernel_faults.py op_tests_catch). The self-check and the autotune are judged as on a GPU: the simulator's
own finite check (CLEF_CHECK_FINITE) is off for them, so what they catch is what their comparisons see; a fault
whose damage reaches no output (InjectedFault.reaches_outputs) is reported apart. Table last, then `caught by the
self-check: N of M`.

    python benchmarks/selfcheck_power.py                       # every fault (about 5 minutes on 2 cores)
    python benchmarks/selfcheck_power.py --faults gdr_w_rows_past_16_zeroed,wmma_last_warp_rows_doubled
    python benchmarks/selfcheck_power.py --no-autotune         # the self-check and the op tests only
    python benchmarks/selfcheck_power.py --gates fast          # the delta-rule cases' gates as they were: -3 x rand

Columns: the fault, its kernel and simulated card; "op tests" yes/no; "self-check" yes/no with its worst check's
error over its tolerance (the check named; "non-finite" where an output came back inf or NaN; "raised" where the
self-check's op raised: a deadlock, a launch over the device's shared memory, which a GPU raises or hangs on in the
kernel trials too); "autotune" yes/no (a candidate of the fault's kernel failed its check or raised), "-" where
the autotune has no candidates of that kernel (the conv, the glue, dequantize).
Exit 1 when a fault the op tests catch passes the self-check, or when the healthy kernels fail it on any card.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# tests/ first: its conftest (the simulator's controls), not benchmarks/conftest.py beside this file
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "cuda_sim"), str(ROOT)]

# The autotune's candidates of each kernel, as its report rows name them.
AUTOTUNE_CANDIDATES = {
    "paged_attention:wmma": ("ours", "ours-wmma"),
    "paged_attention:wmma2": ("ours-wmma2",),
    "gated_delta_rule_chunk:chunked": ("chunked",),
    "int8_linear:cuda": ("fused",),
}


@dataclass
class Outcome:
    fault: str
    kernel: str
    card: str
    op_tests: bool
    selfcheck: bool | None  # None: the fault's damage reaches no output (InjectedFault.reaches_outputs)
    worst: str  # the self-check's worst check: "1.9e+02 x (gated_delta_rule_chunk.chunked.s64)" or "raised: ..."
    autotune: bool | None  # None: no candidates of the kernel


def load_trunk(sim_ops):
    """The release with clef-flash's per-head shapes, int8 weights, f16 on the CPU, its ops the simulator's."""
    from releases import flash_heads_release

    from clef_cuda import Decider

    decider = Decider.from_release(
        flash_heads_release(), device="cpu", dtype=torch.float16, progress=False, quantize="int8"
    )
    return decider.trunk.with_ops(sim_ops)


def worst_check(report) -> str:
    raised = [c for c in report.checks if c.error]
    if raised:
        return f"raised: {raised[0].name}: {raised[0].error[:60]}"

    def ratio(c) -> float:  # an exact check (tolerance 0) that is off is infinitely off
        return c.max_abs_error / c.tolerance if c.tolerance else (math.inf if c.max_abs_error > 0 else 0.0)

    worst = max(report.checks, key=ratio)
    if math.isfinite(ratio(worst)):
        return f"{ratio(worst):.2g} x ({worst.name})"
    return f"{'exact, off' if worst.tolerance == 0 else 'non-finite'} ({worst.name})"


def autotune_catches(trunk, kernel: str) -> bool | None:
    """Whether the inline fast autotune on `trunk` refuses a candidate of `kernel` (fails its check or raises)."""
    from clef_cuda.serving.engine import EngineConfig
    from clef_cuda.tuning.autotune import autotune

    candidates = AUTOTUNE_CANDIDATES.get(kernel)
    if candidates is None:
        return None
    config = EngineConfig(max_num_seqs=1, prefill_chunk_size=64, max_model_len=128, block_size=16)
    try:
        report = autotune(trunk, config, "fast", None, trials="inline")
    except Exception:  # the tune itself stopped (a server would not start): refused
        return True
    refused = ("failed its check", "raised")
    return any(row.candidate in candidates and row.status.startswith(refused) for row in report.rows)


def run(fault_names: list[str] | None, with_autotune: bool) -> tuple[list[Outcome], list[str]]:
    from build import load_cuda_sim
    from conftest import simulated, simulated_cards
    from kernel_faults import BY_NAME, FAULTS, fault_points, op_tests_catch

    from clef_cuda.verification.selfcheck import run_selfcheck

    sim_ops = load_cuda_sim()
    missing = fault_points() - set(BY_NAME)
    if missing:
        raise SystemExit(f"selfcheck_power: CLEF_FAULT points not in tests/kernel_faults.py: {sorted(missing)}")
    faults = [BY_NAME[name] for name in fault_names] if fault_names else FAULTS
    cards = simulated_cards()
    base = load_trunk(sim_ops)
    key_band = (base.config.key_dim, 2 * base.config.key_dim)
    problems: list[str] = []
    healthy: set[int] = set()
    outcomes = []
    for fault in faults:
        cc = fault.compute_capability
        card, sms = cards[cc]
        with simulated(compute_capability=cc, multiprocessors=sms):
            if cc not in healthy:
                report = run_selfcheck(base.with_ops(sim_ops))
                if not report.passed:
                    problems.append(f"healthy kernels fail the self-check on a simulated {card}: {report.summary()}")
                healthy.add(cc)
            started = time.monotonic()
            op_tests = op_tests_catch(fault, sim_ops)
            band = key_band if fault.key_band else None
            with simulated(fault=fault.name, fault_band=band, finite_check=False):
                if fault.reaches_outputs:
                    report = run_selfcheck(base.with_ops(sim_ops))
                    caught, worst = not report.passed, worst_check(report)
                else:
                    caught, worst = None, "reaches no output: the simulator's finite check"
                autotune = autotune_catches(base.with_ops(sim_ops), fault.kernel) if with_autotune else None
        outcome = Outcome(fault.name, fault.kernel, card, op_tests, caught, worst, autotune)
        outcomes.append(outcome)
        print(
            f"{fault.name}: op tests {'yes' if op_tests else 'no'}, self-check {'-' if caught is None else caught}"
            f" ({outcome.worst}), {time.monotonic() - started:.1f} s",
            flush=True,
        )
        if op_tests and outcome.selfcheck is False:
            problems.append(f"{fault.name}: the op tests catch it, the self-check does not")
    return outcomes, problems


def table(outcomes: list[Outcome], with_autotune: bool) -> str:
    def yes(flag: bool | None) -> str:
        return "-" if flag is None else ("yes" if flag else "no")

    header = f"{'fault':38s} {'kernel':32s} {'card':8s} {'op tests':8s} {'self-check':10s} {'worst / tolerance':44s}"
    if with_autotune:
        header += " autotune"
    lines = [header]
    for o in outcomes:
        line = f"{o.fault:38s} {o.kernel:32s} {o.card:8s} {yes(o.op_tests):8s} {yes(o.selfcheck):10s} "
        line += f"{o.worst[:44]:44s}"
        if with_autotune:
            line += f" {yes(o.autotune)}"
        lines.append(line)
    counted = [o for o in outcomes if o.selfcheck is not None]
    apart = len(outcomes) - len(counted)
    if apart:
        lines.append(f"({apart} fault(s) whose damage reaches no output, seen by the op tests alone, left out of M)")
    lines.append(f"caught by the self-check: {sum(o.selfcheck for o in counted)} of {len(counted)}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", help="comma-separated CLEF_FAULT names (default: every one)")
    parser.add_argument("--no-autotune", action="store_true", help="leave the autotune's checks out")
    parser.add_argument(
        "--gates",
        choices=("mixed", "fast"),
        default="mixed",
        help="the delta-rule cases' log gates: the self-check's (mixed) or -3 x rand only (fast: before 2026-12-06)",
    )
    args = parser.parse_args()
    if args.gates == "fast":
        from clef_cuda.verification import selfcheck

        selfcheck.DELTA_RULE_GATES = (3.0,)
    torch.manual_seed(0)
    started = time.monotonic()
    names = args.faults.split(",") if args.faults else None
    outcomes, problems = run(names, not args.no_autotune)
    print(f"\nself-check power, CUDA simulator, {time.monotonic() - started:.0f} s, gates {args.gates}\n")
    for problem in problems:
        print(f"FAIL {problem}")
    print(table(outcomes, not args.no_autotune))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
