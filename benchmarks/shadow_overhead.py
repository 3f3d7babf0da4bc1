#!/usr/bin/env python3
"""What shadow verification costs the requests: latency percentiles under a saturating load (every request
submitted at once, `--concurrency` at a time) with --shadow-rate 1 against shadow off, the same requests,
runs interleaved (off, on, off, on, ...). A sample only runs when the engine is idle, so under load it is
dropped and counted and the latencies should match; and with sequential traffic (one request at a time)
the samples run between requests: how many were checked. Table last.

    python benchmarks/shadow_overhead.py --requests 200 --concurrency 16 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "tests"))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from random_requests import random_request
    from releases import tiny_release

    from clef_cuda import Decider
    from clef_cuda.serving.engine import Engine, EngineConfig
    from clef_cuda.serving.shadow import ShadowConfig

    decider = Decider.from_release(tiny_release(), device="cpu", progress=False)
    rng = random.Random(3)
    requests = [random_request(rng, null_score_levels=False, state_words=(3, 60)) for _ in range(args.requests)]

    def run(mode: str) -> tuple[list[float], dict]:
        shadow = ShadowConfig(rate=1.0, mode="warn") if mode == "on" else ShadowConfig(mode="off")
        engine = Engine(decider, EngineConfig(max_model_len=8192, kv_fraction=0.05, shadow=shadow))
        engine.start()
        try:

            def one(request):
                started = time.perf_counter()
                engine.decide(request, timeout=600)
                return time.perf_counter() - started

            with ThreadPoolExecutor(args.concurrency) as pool:
                latencies = list(pool.map(one, requests))
            time.sleep(0.5)  # the last sample's verdict
            stats = engine.shadow.stats
            return latencies, {"match": stats.match, "mismatch": stats.mismatch, "dropped": stats.dropped}
        finally:
            engine.stop(60)

    results: dict[str, list[float]] = {"off": [], "on": []}
    counts = {}
    for _ in range(args.rounds):
        for mode in ("off", "on"):
            latencies, counts[mode] = run(mode)
            results[mode] += latencies
    print(
        f"\nshadow verification under load: {args.requests} requests x {args.rounds} rounds, concurrency "
        f"{args.concurrency}, upstream tiny release, CPU"
    )
    print(f"{'shadow':8s} {'p50 ms':>8s} {'p90 ms':>8s} {'p99 ms':>8s}  last round's samples")
    for mode, latencies in results.items():
        print(
            f"{mode:8s} {statistics.median(latencies) * 1e3:8.1f} {percentile(latencies, 0.9) * 1e3:8.1f} "
            f"{percentile(latencies, 0.99) * 1e3:8.1f}  {counts[mode]}"
        )
    ratio = percentile(results["on"], 0.99) / percentile(results["off"], 0.99)
    print(f"p99 with / without: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
