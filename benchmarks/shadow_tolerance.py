#!/usr/bin/env python3
"""The healthy differences shadow verification must tolerate: records served by the engine (the fast ops,
batched, chunked, from the prefix cache) against the same records re-decided on the reference ops
(clef_cuda.serving.shadow), per release and serving dtype. The tolerances (derived from the dtype's unit
roundoff, each layer's roundings and the depth: clef_cuda.serving.shadow) must hold over them with their
margin. Table last.

    python benchmarks/shadow_tolerance.py --records 60
    python benchmarks/shadow_tolerance.py --releases test-mix --records 200      # the healthy test's records
    python benchmarks/shadow_tolerance.py --device cuda --dtypes f16,bf16 --gate

--gate exits 1 when a healthy record differs by more than a tolerance (scripts/gpu_check.sh checks they hold
on the GPU).
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
    if release == "test-mix":  # tests/test_shadow.py's healthy records: an image every 10th, a variant every 4th
        from images import data_url, png
        from random_requests import random_request

        rng, requests = random.Random(5), []
        for i in range(count):
            request = random_request(rng, null_score_levels=False, state_words=(3, 120)) | {"model": "clef-flash"}
            if i % 10 == 3:
                request["images"] = [data_url(png(64 + i, 48, i))]
            if i % 4 == 1:
                request["model"] = "tuned"
            requests.append(request)
        return requests
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
        while stats.match + stats.marginal + stats.mismatch + stats.dropped < done and time.monotonic() < deadline:
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
    registry = None
    if any(r.get("model") == "tuned" for r in requests):  # the test mix's LoRA variant
        from adapter_fixtures import checkpoint

        from clef_cuda.model.adapters import AdapterRegistry

        registry = AdapterRegistry(decider.config, decider.trunk.lm_head, decider.trunk.dtype)
        registry.load("tuned", checkpoint("all"))
    engine = Engine(decider, config, registry)
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
    parser.add_argument(
        "--releases",
        default="upstream-tiny,mid,clef-tiny",
        help="upstream-tiny, mid, clef-tiny, or test-mix (tests/test_shadow.py's records: the upstream tiny release, "
        "an image every 10th record, a LoRA variant every 4th)",
    )
    parser.add_argument("--gate", action="store_true", help="exit 1 if a healthy record exceeds the tolerance")
    args = parser.parse_args()
    from releases import mid_release, tiny_release

    from clef_cuda.model.config import load_release_config
    from clef_cuda.model.default_model import default_release
    from clef_cuda.serving.shadow import (
        FINGERPRINT_FLOOR,
        FINGERPRINT_GAIN,
        FINGERPRINT_MARGIN,
        healthy_local_drift,
        probability_tolerance,
        replay_tolerance,
        unit_roundoff,
    )

    known = {"upstream-tiny": tiny_release, "mid": mid_release, "clef-tiny": default_release, "test-mix": tiny_release}
    releases = {name: known[name] for name in args.releases.split(",")}
    rows, layer_rows = [], []
    for name, build in releases.items():
        requests = requests_for(name, args.records)
        depth = load_release_config(build()).trunk.num_layers
        for dtype_name in args.dtypes.split(","):
            errors, layers = measure(build(), requests, args.device, DTYPES[dtype_name])
            tolerance = probability_tolerance(DTYPES[dtype_name], depth)
            rows.append((name, dtype_name, len(errors), max(errors), statistics.median(errors), tolerance))
            for kind, values in layers.items():
                layer_rows.append((name, dtype_name, kind, len(values), max(values), statistics.median(values)))
    print(f"\nshadow verification: served (fast ops) vs reference ops, {args.device}, every record shadowed")
    print("probabilities: max |p_served - p_reference| per record; the tolerance from the dtype's unit roundoff u")
    print("and the depth (clef_cuda.serving.shadow.probability_tolerance)")
    header = f"{'release':14s} {'dtype':5s} {'records':>7s} {'worst |dp|':>11s} {'median':>9s} {'tolerance':>10s}"
    print(f"{header} {'margin':>7s}")
    for name, dtype_name, count, worst, median, tolerance in rows:
        margin = tolerance / worst if worst else float("inf")
        print(
            f"{name:14s} {dtype_name:5s} {count:>7d} {worst:>11.2e} {median:>9.2e} {tolerance:>10.2e} {margin:>6.1f}x"
        )
    print("\nlayer fingerprints: each record's worst local drift of a kind (|served - ref| / |ref| of the output, less")
    print(f"{FINGERPRINT_GAIN:g} x its input's), and its worst norm and MLP replay channel gains; 'bound': the healthy")
    print(f"local drift derived, sqrt(roundings) x u (the tolerance: {FINGERPRINT_MARGIN:g} x it, at least the floor)")
    header = f"{'release':14s} {'dtype':5s} {'kind':11s} {'records':>7s} {'worst':>11s} {'in u':>6s} {'bound':>10s}"
    print(f"{header} {'tolerance':>10s}")

    def tolerance_for(dtype_name: str, kind: str) -> float:
        if kind.endswith("replay"):
            return replay_tolerance(DTYPES[dtype_name], kind)
        return max(FINGERPRINT_FLOOR, FINGERPRINT_MARGIN * healthy_local_drift(DTYPES[dtype_name], kind))

    over = []
    for name, dtype_name, kind, count, worst, _ in layer_rows:
        dtype = DTYPES[dtype_name]
        bound, tolerance = healthy_local_drift(dtype, kind), tolerance_for(dtype_name, kind)
        in_u = worst / unit_roundoff(dtype)
        print(
            f"{name:14s} {dtype_name:5s} {kind:11s} {count:>7d} {worst:>11.2e} {in_u:>6.1f} {bound:>10.2e} "
            f"{tolerance:>10.2e}"
        )
        if worst > tolerance:
            over.append(f"{name} {dtype_name} {kind}: worst {worst:.2e} > {tolerance:.2e}")
    over += [f"{r[0]} {r[1]} probabilities: worst {r[3]:.2e} > {r[5]:.2e}" for r in rows if r[3] > r[5]]
    for line in over:
        print(f"OVER THE TOLERANCE: {line}")
    return 1 if args.gate and over else 0


if __name__ == "__main__":
    sys.exit(main())
