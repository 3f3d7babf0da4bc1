#!/usr/bin/env python3
"""What shadow verification costs the requests: latency percentiles under a saturating load (every request
submitted at once, `--concurrency` at a time) at --shadow-rate `--rate` (default 0.01, the server's) against
shadow off, the same requests, runs interleaved (off, idle, floor, off, ...). "idle": samples run only when
the engine is idle (no --shadow-min-interval), so under load they wait and the latencies should match;
"floor": --shadow-min-interval at `--min-interval` seconds, so once no sample has finished for that long the
steps give the shadow run chunks, at most 2% of their time: how many records it verified during the load, its
share of step time and what it costs the p99. Table last.

    python benchmarks/shadow_overhead.py --requests 1200 --concurrency 16 --rounds 3 --min-interval 1
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
    parser.add_argument("--min-interval", type=float, default=1.0, help="the floor's --shadow-min-interval, s")
    parser.add_argument("--rate", type=float, default=0.01, help="--shadow-rate of the idle and floor runs")
    args = parser.parse_args()
    from random_requests import random_request
    from releases import tiny_release

    from clef_cuda import Decider
    from clef_cuda.serving.engine import Engine, EngineConfig
    from clef_cuda.verification.shadow import ShadowConfig

    decider = Decider.from_release(tiny_release(), device="cpu", progress=False)
    rng = random.Random(3)
    requests = [random_request(rng, null_score_levels=False, state_words=(3, 60)) for _ in range(args.requests)]

    shadows = {
        "off": ShadowConfig(mode="off"),
        "idle": ShadowConfig(rate=args.rate, mode="warn", min_interval=None),
        "floor": ShadowConfig(rate=args.rate, mode="warn", min_interval=args.min_interval),
    }

    def run(mode: str) -> tuple[list[float], dict]:
        engine = Engine(
            decider, EngineConfig(max_model_len=8192, allow_long_context=True, kv_fraction=0.05, shadow=shadows[mode])
        )
        engine.start()
        try:

            def one(request):
                started = time.perf_counter()
                engine.decide(request, timeout=600)
                return time.perf_counter() - started

            with ThreadPoolExecutor(args.concurrency) as pool:
                latencies = list(pool.map(one, requests))
            stats = engine.shadow.stats
            share = stats.floor_shadow_seconds / stats.floor_step_seconds if stats.floor_step_seconds else 0.0
            # Read as the load ends: what was verified during it, not in the idle time after.
            return latencies, {"verified under load": stats.match + stats.mismatch, "floor share": f"{share:.1%}"}
        finally:
            engine.stop(60)

    results: dict[str, list[float]] = {mode: [] for mode in shadows}
    counts = {}
    for _ in range(args.rounds):
        for mode in shadows:
            latencies, counts[mode] = run(mode)
            results[mode] += latencies
    print(
        f"\nshadow verification under load: {args.requests} requests x {args.rounds} rounds, concurrency "
        f"{args.concurrency}, --shadow-rate {args.rate:g}, upstream tiny release, CPU"
    )
    print(f"{'shadow':8s} {'p50 ms':>8s} {'p90 ms':>8s} {'p99 ms':>8s}  last round's samples")
    for mode, latencies in results.items():
        print(
            f"{mode:8s} {statistics.median(latencies) * 1e3:8.1f} {percentile(latencies, 0.9) * 1e3:8.1f} "
            f"{percentile(latencies, 0.99) * 1e3:8.1f}  {counts[mode]}"
        )
    for mode in ("idle", "floor"):
        ratio = percentile(results[mode], 0.99) / percentile(results["off"], 0.99)
        print(f"p99 {mode} / off: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
