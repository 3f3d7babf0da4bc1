#!/usr/bin/env python3
"""The healthy differences shadow verification must tolerate: records served by the engine (the fast ops,
batched, chunked, from the prefix cache) against the same records re-decided on the reference ops
(clef_cuda.serving.shadow), per release and serving dtype. The tolerance (SHADOW_TOLERANCE) is the worst
of these times SHADOW_MARGIN. Table last.

    python benchmarks/shadow_tolerance.py --records 60
    python benchmarks/shadow_tolerance.py --device cuda --dtypes f16,bf16 --gate

--gate exits 1 when a healthy record differs by more than the serving dtype's tolerance (the tolerance was
measured on the CPU; scripts/gpu_check.sh checks it holds on the GPU).
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
sys.path.append(str(ROOT / "tests"))
sys.path.append(str(ROOT))

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def requests_for(release: str, count: int) -> list[dict]:
    if release == "clef-tiny":
        from training import evaluate

        return [e.request | {"model": "clef-flash"} for e in evaluate.heldout(count)]
    from random_requests import random_request

    rng = random.Random(7)
    return [random_request(rng, null_score_levels=False, state_words=(5, 400)) for _ in range(count)]


def decide_each_and_wait(engine, requests: list[dict], timeout: float = 300):
    """Each request through a started engine, one at a time, each sample's verdict awaited before the next (its
    sample is offered just after the answer); the shadow's stats."""
    stats = engine.shadow.stats
    for done, request in enumerate(requests, 1):
        engine.decide(request, timeout=timeout)
        deadline = time.monotonic() + timeout
        while stats.match + stats.mismatch + stats.dropped < done and time.monotonic() < deadline:
            time.sleep(0.002)
    return stats


def measure(release_path: Path, requests: list[dict], device: str, dtype: torch.dtype) -> tuple[list[float], dict]:
    """max |p_served - p_reference| of each record (every record shadowed, one at a time), and per kind of layer
    output the worst layer fingerprint error of each record."""
    from clef_cuda import Decider
    from clef_cuda.serving.engine import Engine, EngineConfig
    from clef_cuda.serving.shadow import ShadowConfig

    decider = Decider.from_release(release_path, device=device, dtype=dtype, progress=False)
    config = EngineConfig(max_model_len=8192, kv_fraction=0.05, shadow=ShadowConfig(rate=1.0, mode="warn"))
    engine = Engine(decider, config)
    engine.start()
    try:
        stats = decide_each_and_wait(engine, requests)
        assert stats.dropped == 0, stats
        return list(stats.errors), {kind: list(errors) for kind, errors in stats.layer_errors.items()}
    finally:
        engine.stop(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="f32,f16,bf16")
    parser.add_argument("--records", type=int, default=60)
    parser.add_argument("--gate", action="store_true", help="exit 1 if a healthy record exceeds the tolerance")
    args = parser.parse_args()
    from releases import mid_release, tiny_release

    from clef_cuda.model.default_model import default_release
    from clef_cuda.serving.shadow import (
        FINGERPRINT_FLOOR,
        FINGERPRINT_GAIN,
        FINGERPRINT_KINDS,
        FINGERPRINT_MARGIN,
        FINGERPRINT_WORST_HEALTHY,
        REPLAY_TOLERANCE,
        REPLAY_WORST_HEALTHY,
        SHADOW_FLOOR,
        SHADOW_MARGIN,
        SHADOW_TOLERANCE,
    )

    releases = {"upstream-tiny": tiny_release, "mid": mid_release, "clef-tiny": default_release}
    rows, layer_rows = [], []
    for name, build in releases.items():
        requests = requests_for(name, args.records)
        for dtype_name in args.dtypes.split(","):
            errors, layers = measure(build(), requests, args.device, DTYPES[dtype_name])
            rows.append((name, dtype_name, len(errors), max(errors), statistics.median(errors)))
            for kind, values in layers.items():
                layer_rows.append((name, dtype_name, kind, len(values), max(values), statistics.median(values)))
    print(f"\nshadow verification: served (fast ops) vs reference ops, {args.device}, every record shadowed")
    print(f"{'release':14s} {'dtype':5s} {'records':>7s} {'worst |dp|':>11s} {'median':>9s} {'tolerance':>10s}")
    for name, dtype_name, count, worst, median in rows:
        tolerance = SHADOW_TOLERANCE[DTYPES[dtype_name]]
        print(f"{name:14s} {dtype_name:5s} {count:>7d} {worst:>11.2e} {median:>9.2e} {tolerance:>10.2e}")
    for dtype_name in args.dtypes.split(","):
        worst = max(r[3] for r in rows if r[1] == dtype_name)
        margin = SHADOW_MARGIN * worst
        print(f"worst {dtype_name}: {worst:.2e}; x{SHADOW_MARGIN:g} = {margin:.2e}, floor {SHADOW_FLOOR:g}")
    print("\nlayer fingerprints: each record's worst local drift of a kind (|served - ref| / |ref| of the output,")
    print(f"less {FINGERPRINT_GAIN:g} x its input's), and its worst norm and MLP replay channel gains")
    print(f"{'release':14s} {'dtype':5s} {'kind':10s} {'records':>7s} {'worst':>11s} {'median':>9s} {'in use':>10s}")

    def in_use_for(dtype_name: str, kind: str) -> float:
        if kind.endswith("replay"):
            return REPLAY_WORST_HEALTHY[DTYPES[dtype_name]]
        return FINGERPRINT_WORST_HEALTHY[DTYPES[dtype_name]][kind]

    def tolerance_for(dtype_name: str, kind: str) -> float:
        if kind.endswith("replay"):
            return REPLAY_TOLERANCE[DTYPES[dtype_name]]
        return FINGERPRINT_MARGIN * FINGERPRINT_WORST_HEALTHY[DTYPES[dtype_name]][kind]

    for name, dtype_name, kind, count, worst, median in layer_rows:
        in_use = in_use_for(dtype_name, kind)
        print(f"{name:14s} {dtype_name:5s} {kind:10s} {count:>7d} {worst:>11.2e} {median:>9.2e} {in_use:>10.2e}")
    for dtype_name in args.dtypes.split(","):
        for kind in FINGERPRINT_KINDS:
            worst = max((r[4] for r in layer_rows if r[1] == dtype_name and r[2] == kind), default=0.0)
            print(
                f"fingerprint worst {dtype_name} {kind}: local drift {worst:.2e}; the tolerance is "
                f"{FINGERPRINT_MARGIN:g} x ({FINGERPRINT_GAIN:g} x the input's drift + it), floor {FINGERPRINT_FLOOR:g}"
            )
        for test in ("norm replay", "MLP replay"):
            worst = max((r[4] for r in layer_rows if r[1] == dtype_name and r[2] == test), default=0.0)
            print(f"{test} worst {dtype_name}: {worst:.2e}; x{FINGERPRINT_MARGIN:g}, one tolerance at every depth")
    over = [r for r in rows if r[3] > SHADOW_TOLERANCE[DTYPES[r[1]]]]
    over += [
        (name, dtype_name, 0, worst, 0.0)
        for name, dtype_name, kind, _, worst, _ in layer_rows
        if worst > tolerance_for(dtype_name, kind)
    ]
    for name, dtype_name, _, worst, _ in over:
        print(f"OVER THE TOLERANCE: {name} {dtype_name} worst {worst:.2e} > {SHADOW_TOLERANCE[DTYPES[dtype_name]]:.2e}")
    return 1 if args.gate and over else 0


if __name__ == "__main__":
    sys.exit(main())
