#!/usr/bin/env python3
"""Prefix affinity through a real load balancer: two clef-tiny replicas on loopback behind HAProxy,
hashing on X-Clef-Prefix-Key (consistent, bounded load) vs round-robin, on a workload where states repeat:
prefix-cache hit rate and decisions/s of each (each mode gets states of its own, so neither finds the
other's caches warm), and the cost of computing the key per request. Table last.

    python benchmarks/affinity.py [--states 16 --repeats 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def key_cost_us(state, repeats: int = 20) -> float:
    from clef_cuda.request.routing import prefix_key

    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        prefix_key("clef-flash", state)
        times.append(time.perf_counter() - started)
    return 1e6 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--states", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    from affinity import balancer, replicas, run, workload

    results = []
    with replicas(2) as urls:
        seed = 100
        for concurrency in sorted({1, args.concurrency}):
            for mode in ("hash", "round-robin"):
                seed += 1
                with balancer(urls, mode) as url:
                    results.append(
                        (concurrency, run(url, mode, workload(args.states, args.repeats, seed), concurrency))
                    )

    state_4k = {"ticket": "x" * 4000, "meta": {"n": 1, "tags": ["a", "b"]}}
    state_1m = "log line\n" * 110_000
    state_obj = {f"k{i}": [i, "v"] for i in range(10_000)}
    print(
        f"\nprefix affinity: 2 clef-tiny replicas behind HAProxy on loopback, {args.states} states x {args.repeats}"
        " requests each (CPU)"
    )
    print(
        f"{'routing':<14} {'clients':>7} {'requests':>8} {'hit rate':>9} {'decisions/s':>12} {'keys on 2 replicas':>19}"
    )
    for concurrency, r in results:
        split = sum("," in v for v in r.served_by.values())
        print(
            f"{r.mode:<14} {concurrency:>7} {r.requests:>8} {r.hit_rate:>8.0%} {r.per_second:>12.1f} "
            f"{split:>10} of {len(r.served_by)}"
        )
    print("\ncomputing the key (clef_cuda.request.routing.prefix_key), median per request:")
    for name, state in (
        ("4 KB object state", state_4k),
        ("1 MB string state", state_1m),
        ("10k-key object", state_obj),
    ):
        print(f"  {name:<20} {key_cost_us(state):>10.0f} us")


if __name__ == "__main__":
    main()
