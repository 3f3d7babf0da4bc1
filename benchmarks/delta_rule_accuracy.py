#!/usr/bin/env python3
"""The chunked delta rule's accuracy against the fp32 reference, per card: every state-pass variant each
tensor-core card in csrc/common/arch_limits.h runs at clef-flash's delta-net shapes (tests/test_gated_delta_rule.py
VARIANTS: the variant for 1 to 16 records), run in the CUDA simulator on that card's simulated device (its shared
memory; cp.async from sm_80, register fetches before) at head dim 128 (1 key / 2 value heads: the kernels' per-head
work is clef-flash's), f16 and, from sm_80, bf16; outputs and the states left in the slots; beside them the
token-serial kernel. Gates in two regimes: "fast" (-3 x rand, the range most of a real layer's tokens decay in) and
"mixed" (the self-check's: near 0, slow and fast by sequence and head,
clef_cuda.verification.selfcheck.delta_rule_gates). The same inputs for every row of a regime. Table last.

    python benchmarks/delta_rule_accuracy.py

Errors: relative norm error (|ours - ref| / |ref|) of the outputs and of the states, and the outputs' largest
absolute error over their largest reference value (what the self-check bounds: 2 f16 ulps = 2e-3, 1.6e-2 in bf16).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "cuda_sim"), str(ROOT)]

LENGTHS = (65, 1, 130)  # a tail, one token, three chunks
HEADS = (1, 2, 128)  # key heads, value heads, head dim


def inputs(regime: str, dtype: torch.dtype, seed: int = 0) -> tuple:
    from clef_cuda.verification.selfcheck import delta_rule_gates

    hk, hv, d = HEADS
    generator = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)
    mixed = torch.randn(n, 2 * hk * d + hv * d, generator=generator)
    q = mixed[:, : hk * d].view(n, hk, d).to(dtype)
    k = mixed[:, hk * d : 2 * hk * d].view(n, hk, d).to(dtype)
    v = mixed[:, 2 * hk * d :].view(n, hv, d).to(dtype)
    if regime == "fast":
        g, beta = -3.0 * torch.rand(n, hv, generator=generator), torch.rand(n, hv, generator=generator)
    else:
        g, beta = delta_rule_gates(LENGTHS, hv, generator)
    states = 0.3 * torch.randn(len(LENGTHS) + 1, hv, d, d, generator=generator)
    cu = torch.tensor([0, LENGTHS[0], LENGTHS[0] + LENGTHS[1], n], dtype=torch.int32)
    slots = torch.tensor([0, 1, 3], dtype=torch.int32)
    initial = torch.tensor([True, False, True])
    return q, k, v, g, beta, states, cu, slots, initial


def errors(sim_ops, kernel: str, regime: str, dtype: torch.dtype) -> tuple[float, float, float]:
    from clef_cuda.kernels import reference

    q, k, v, g, beta, states, cu, slots, initial = inputs(regime, dtype)
    expected_states = states.clone()
    out = sim_ops.gated_delta_rule_chunk(q, k, v, g, beta, states, cu, slots, initial, kernel=kernel)
    expected = reference.gated_delta_rule_chunk(q, k, v, g, beta, expected_states, cu, slots, initial)

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    worst = float((out.float() - expected).abs().max() / expected.abs().max())
    return rel(out, expected), rel(states, expected_states), worst


def main() -> int:
    from build import load_cuda_sim
    from conftest import simulated, simulated_cards
    from test_gated_delta_rule import VARIANTS

    sim_ops = load_cuda_sim()
    cards = simulated_cards()
    started = time.monotonic()
    rows = []
    for cc in sorted({cc for cc, hv in VARIANTS if hv == 32}):
        card, sms = cards[cc]
        variants = sorted(set(VARIANTS[(cc, 32)]), key=lambda v: (v[0] != "s", int(v[1:])))
        dtypes = (torch.float16, torch.bfloat16) if cc >= 80 else (torch.float16,)
        with simulated(compute_capability=cc, multiprocessors=sms):
            for dtype in dtypes:
                for kernel in ["serial"] + [f"chunked:{v}" for v in variants]:
                    for regime in ("fast", "mixed"):
                        out, states, worst = errors(sim_ops, kernel, regime, dtype)
                        name = str(dtype).removeprefix("torch.")
                        rows.append((card, f"sm_{cc}", kernel, name, regime, out, states, worst))
    print(
        f"\nchunked delta rule vs the fp32 reference, CUDA simulator, {len(LENGTHS)} sequences {LENGTHS}, "
        f"Hk {HEADS[0]} / Hv {HEADS[1]} x {HEADS[2]}, {time.monotonic() - started:.0f} s\n"
    )
    print(
        f"{'card':9s} {'arch':6s} {'kernel':13s} {'dtype':9s} {'gates':6s} {'outputs':>9s} {'states':>9s} "
        f"{'max/max':>9s}"
    )
    for card, arch, kernel, dtype, regime, out, states, worst in rows:
        print(f"{card:9s} {arch:6s} {kernel:13s} {dtype:9s} {regime:6s} {out:9.2e} {states:9.2e} {worst:9.2e}")
    chunked = [r for r in rows if r[2].startswith("chunked")]
    alike = all(
        len({r[5:] for r in chunked if r[3] == dtype and r[4] == regime}) == 1
        for dtype in ("float16", "bfloat16")
        for regime in ("fast", "mixed")
    )
    print(f"every variant on every card computes the same values (the same sums in the same order): {alike}")
    for dtype in ("float16", "bfloat16"):
        of = [r for r in chunked if r[3] == dtype]
        print(
            f"chunked, {dtype}: outputs {min(r[5] for r in of):.2e}-{max(r[5] for r in of):.2e}, states "
            f"{min(r[6] for r in of):.2e}-{max(r[6] for r in of):.2e}, largest/largest {max(r[7] for r in of):.2e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
