#!/usr/bin/env python3
"""The healthy differences shadow verification must tolerate: records served by the engine (the fast ops,
batched, chunked, from the prefix cache) against the same records re-decided on the reference ops
(clef_cuda.verification.shadow), per release and serving dtype. The tolerances (derived from the dtype's unit
roundoff, each layer's roundings and, for the head's inputs and fp32's probabilities, the drift each record was
measured to carry: clef_cuda.verification.shadow) must hold over them with their margin. Tables last: the
probabilities, the head's inputs, the layers.

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


def measure(release_path: Path, requests: list[dict], device: str, dtype: torch.dtype):
    """The shadow's stats once every record was served and shadowed, one at a time: per record max |dp| and its
    tolerance, the worst of each head-input test, each kind of layer's worst local drift."""
    from clef_cuda import Decider
    from clef_cuda.serving.engine import Engine, EngineConfig
    from clef_cuda.verification.shadow import ShadowConfig

    decider = Decider.from_release(release_path, device=device, dtype=dtype, progress=False)
    config = EngineConfig(
        max_model_len=8192, allow_long_context=True, kv_fraction=0.05, shadow=ShadowConfig(rate=1.0, mode="warn")
    )
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
        return stats
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
    from clef_cuda.verification.shadow import (
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
    rows, head_rows, layer_rows = [], [], []
    for name, build in releases.items():
        requests = requests_for(name, args.records)
        depth = load_release_config(build()).trunk.num_layers
        for dtype_name in args.dtypes.split(","):
            started = time.perf_counter()
            stats = measure(build(), requests, args.device, DTYPES[dtype_name])
            seconds = time.perf_counter() - started
            verdicts = (stats.match, stats.marginal, stats.mismatch)
            errors = [e for e, _ in stats.probabilities]
            ratio = max(e / t for e, t in stats.probabilities)
            floor = probability_tolerance(DTYPES[dtype_name], depth)
            rows.append((name, dtype_name, len(errors), max(errors), statistics.median(errors), floor, ratio))
            rows[-1] += (verdicts, seconds)
            if entries := stats.head_inputs:
                worst = max(entries, key=lambda e: e[0] / e[1])
                head_rows.append((name, dtype_name, len(entries), max(e[0] for e in entries), worst))
            for kind, values in stats.layer_errors.items():
                layer_rows.append((name, dtype_name, kind, len(values), max(values), statistics.median(values)))
    print(f"\nshadow verification: served (fast ops) vs reference ops, {args.device}, every record shadowed")
    print("probabilities: max |p_served - p_reference| per record, against the record's own tolerance (at least the")
    print(
        "depth's: clef_cuda.verification.shadow.probability_tolerance; in fp32 from the drift its head inputs carried)"
    )
    header = f"{'release':14s} {'dtype':5s} {'records':>7s} {'worst |dp|':>11s} {'median':>9s} {'depth tol':>10s}"
    print(f"{header} {'worst dp/tol':>12s} {'margin':>7s}  match/marginal/mismatch  seconds")
    for name, dtype_name, count, worst, median, floor, ratio, verdicts, seconds in rows:
        margin = 1 / ratio if ratio else float("inf")
        print(
            f"{name:14s} {dtype_name:5s} {count:>7d} {worst:>11.2e} {median:>9.2e} {floor:>10.2e} {ratio:>12.3f} "
            f"{margin:>6.1f}x  {'/'.join(map(str, verdicts)):>23s}  {seconds:>7.0f}"
        )
    print("\nthe head's inputs: per record its worst question, option or last row: the mean the served head read")
    print("against the mean of its tokens' rows (fingerprint.head_read_error); tolerance from the roundings between")
    print("them (shadow.head_read_tolerance)")
    header = f"{'release':14s} {'dtype':5s} {'records':>7s} {'worst':>9s} {'at the worst ratio:':>20s} {'error':>9s}"
    print(f"{header} {'tokens':>6s} {'tolerance':>9s} {'margin':>7s}")
    over = []
    for name, dtype_name, count, worst, (error, tolerance, tokens) in head_rows:
        margin = tolerance / error if error else float("inf")
        print(
            f"{name:14s} {dtype_name:5s} {count:>7d} {worst:>9.2e} {'':>20s} {error:>9.2e} {tokens:>6d} "
            f"{tolerance:>9.2e} {margin:>6.1f}x"
        )
        if error > tolerance:
            over.append(f"{name} {dtype_name} head input: {error:.2e} > {tolerance:.2e}")
    print("\nlayer fingerprints: each record's worst local drift of a kind (|served - ref| / |ref| of the output, less")
    print(f"{FINGERPRINT_GAIN:g} x its input's), and its worst norm and MLP replay channel gains; 'bound': the healthy")
    print(f"local drift derived, sqrt(roundings) x u (the tolerance: {FINGERPRINT_MARGIN:g} x it, at least the floor)")
    header = f"{'release':14s} {'dtype':5s} {'kind':11s} {'records':>7s} {'worst':>11s} {'in u':>6s} {'bound':>10s}"
    print(f"{header} {'tolerance':>10s}")

    def tolerance_for(dtype_name: str, kind: str) -> float:
        if kind.endswith("replay"):
            return replay_tolerance(DTYPES[dtype_name], kind)
        return max(FINGERPRINT_FLOOR, FINGERPRINT_MARGIN * healthy_local_drift(DTYPES[dtype_name], kind))

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
    over += [f"{r[0]} {r[1]} probabilities: worst dp/tolerance {r[6]:.2f}" for r in rows if r[6] > 1]
    over += [f"{r[0]} {r[1]}: {r[7][1]} marginal, {r[7][2]} mismatched" for r in rows if r[7][1] or r[7][2]]
    for line in over:
        print(f"OVER THE TOLERANCE: {line}")
    return 1 if args.gate and over else 0


if __name__ == "__main__":
    sys.exit(main())
