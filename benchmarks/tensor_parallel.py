#!/usr/bin/env python3
"""Tensor parallel: TP=2 against TP=1 decision latency on the CPU (gloo; both ranks share this machine's cores,
so on 2 cores this is a correctness run, not a speed-up), the bytes each rank all-reduces per token (counted in
the run, and from the formula), and what that traffic costs clef-flash on two V100-16GB over PCIe and over
NVLink, against the step's compute. Tables last.

    python benchmarks/tensor_parallel.py --requests 12 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

# Assumed link rates (one direction, sustained) and V100 compute, for the projection.
PCIE3_X16 = 11e9  # B/s: PCIe 3.0 x16 through the host bridge, about 11 GB/s measured by NCCL's bus bandwidth
NVLINK_V100 = 45e9  # B/s: two NVLink 2 bricks between a pair of V100 SXM2 (25 GB/s each, ~90% usable)
V100_F16_GEMM = 90e12  # FLOP/s sustained on the trunk's GEMMs (of 125 peak)


def per_token_bytes(config, dtype_bytes: int) -> int:
    """Bytes a token costs each rank's all-reduces per forward pass: one hidden row in the serving dtype after
    every mixer and MLP, and the fp32 embedded row (the ranks' shares of the vocabulary summed)."""
    return 2 * config.num_layers * config.hidden_size * dtype_bytes + config.hidden_size * 4


def ring_seconds(nbytes: float, ranks: int, link: float) -> float:
    """A ring all-reduce moves 2 (N - 1) / N of the buffer over each rank's link."""
    return 2 * (ranks - 1) / ranks * nbytes / link


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from random_requests import random_request
    from releases import flash_config_release, tiny_release

    from clef_cuda import Decider
    from clef_cuda.model.config import load_release_config
    from clef_cuda.parallel.tensor_parallel import TensorParallel

    path = tiny_release()
    rng = random.Random(5)
    requests = [random_request(rng, null_score_levels=False, state_words=(50, 300)) for _ in range(args.requests)]
    one = Decider.from_release(path, device="cpu", progress=False)
    group = TensorParallel(2)
    two = Decider.from_release(path, device="cpu", progress=False, tensor_parallel=group)
    counted = {"all_reduce": 0}
    collectives = two.trunk.collectives
    real_reduce = collectives.all_reduce

    def all_reduce(t):
        counted["all_reduce"] += t.numel() * t.element_size()
        return real_reduce(t)

    collectives.all_reduce = all_reduce
    times: dict[str, list[float]] = {"TP=1": [], "TP=2": []}
    tokens = 0
    worst = 0.0
    try:
        for _ in range(args.rounds):
            for request in requests:
                record_one, record_two = one.encode(request), two.encode(request)
                started = time.perf_counter()
                a = one.probabilities(record_one)
                times["TP=1"].append(time.perf_counter() - started)
                started = time.perf_counter()
                b = two.probabilities(record_two)
                times["TP=2"].append(time.perf_counter() - started)
                tokens += record_two.num_tokens
                worst = max(
                    worst, max(abs(x - y) for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True))
                )
    finally:
        group.stop()
    formula = per_token_bytes(two.trunk.config, 4)
    print(
        f"\ntensor parallel on the CPU (gloo, 2 cores shared by both ranks), upstream tiny release, fp32, "
        f"{args.requests} requests x {args.rounds} rounds"
    )
    print(f"{'':6s} {'median ms':>10s} {'p90 ms':>8s}")
    for name, values in times.items():
        ordered = sorted(values)
        print(f"{name:6s} {statistics.median(values) * 1e3:10.1f} {ordered[int(0.9 * len(ordered))] * 1e3:8.1f}")
    print(
        f"TP=2 / TP=1 median: {statistics.median(times['TP=2']) / statistics.median(times['TP=1']):.2f}; "
        f"max |dp| {worst:.1e}"
    )
    print(
        f"bytes a token all-reduced, counted: {counted['all_reduce'] / tokens:.0f} (the head's option rows "
        f"included); the forward's formula: {formula}"
    )

    import tempfile

    from clef_cuda.model.footprint import planned_weights

    release = load_release_config(flash_config_release(Path(tempfile.mkdtemp()) / "clef-flash-config"))
    flash = release.trunk
    reduced = per_token_bytes(flash, 2)
    params = planned_weights(release, torch.float16)["trunk"] / 2  # the layers' weights (not the tables)
    print("\nclef-flash in f16 on 2 x V100-16GB: the traffic against a step's compute (a projection)")
    print(f"per token and rank: all-reduced {reduced / 2**10:.0f} KiB")
    flops_per_token = 2 * params / 2  # each rank: half the weights, two FLOPs a weight (attention's scores aside)
    print(f"{'tokens a step':>14s} {'compute ms':>11s} {'PCIe ms':>8s} {'NVLink ms':>10s}")
    for step in (1, 64, 1024, 4096):
        compute = step * flops_per_token / V100_F16_GEMM * 1e3
        pcie = ring_seconds(step * reduced, 2, PCIE3_X16) * 1e3
        nvlink = ring_seconds(step * reduced, 2, NVLINK_V100) * 1e3
        print(f"{step:>14d} {compute:>11.2f} {pcie:>8.2f} {nvlink:>10.2f}")
    print("(65 all-reduces a step: at 1 token each is latency-bound, ~10-20 us over PCIe, not bandwidth)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
