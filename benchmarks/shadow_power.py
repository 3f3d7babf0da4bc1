#!/usr/bin/env python3
"""What shadow verification can see: for each kind of fault a kernel can have (tests/faults.py LayerFaultOps,
one layer wrong), the smallest size of it the shadow catches at --shadow-rate 1 and whether it names the layer
that is wrong; and false mismatches over healthy records. fp32, f16 and bf16 on the CPU. Table last.

    python benchmarks/shadow_power.py                      # every kind, every dtype, 200 healthy records each
    python benchmarks/shadow_power.py --healthy 20 --dtypes f16

Faults (e: their size, swept over SIZES): attention output x (1 + e) past PAST tokens of context; one KV head's
values zeroed; the conv's key band zeroed; the delta rule's beta x (1 + e); one int8 row scale x (1 + e) (the
release quantized); one RMSNorm's eps x 100. Each in the middle layer of its kind. A fault is caught at e when
one of RECORDS records (one past PAST tokens) mismatches; named when the first layer the shadow reports is the
faulted layer, of the faulted kind. And faults in what the head read (tests/faults.py HeadReadFault, served pass
only): the first option's row x (1 + e), the first question's span read one token early; named when the
shadow reports the head's input check.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "tests"))
sys.path.append(str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))  # shadow_tolerance's helper (this file is also loaded by path in tests)

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
SIZES = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
HEAD_SIZES = (1e-4, 1e-3, 0.01, 0.02)  # an option's row as the head read it x (1 + e)
PAST = 1500  # the attention fault fires past this many tokens of context
SCALED = ("attention_scaled", "beta_off", "int8_scale_off")  # the kinds with a size
LAYER_KIND = {
    "attention_scaled": "attention",
    "kv_head_zeroed": "attention",
    "key_band_zeroed": "delta net",
    "beta_off": "delta net",
    "int8_scale_off": "MLP",
    "eps_x100": "MLP",
}


def requests(count: int, seed: int = 11) -> list[dict]:
    """`count` random records, the last one past PAST tokens (for the attention fault)."""
    from random_requests import random_request

    rng = random.Random(seed)
    out = [random_request(rng, null_score_levels=False, state_words=(20, 200)) for _ in range(count - 1)]
    long = random_request(rng, null_score_levels=False, state_words=(400, 420))
    return out + [long]


@dataclass
class Outcome:
    mismatches: int
    named: bool  # the first mismatch named the faulted layer and kind
    where: str  # what it named


def faulted_layer(config, kind: str, layer: int) -> int:
    """The trunk layer a LayerFaultOps(kind, layer=layer) fault sits in."""
    if LAYER_KIND[kind] == "attention":
        return config.attention_layers[layer]
    if LAYER_KIND[kind] == "delta net":
        return config.linear_layers[layer]
    return layer


def middle(config, kind: str) -> int:
    count = {"attention": len(config.attention_layers), "delta net": len(config.linear_layers)}
    return count.get(LAYER_KIND[kind], config.num_layers) // 2


def run(
    release: Path, dtype: torch.dtype, records: list[dict], fault=None, quantize: str = "none", head_fault=None
) -> Outcome:
    """Every record served (with `fault` in the fast ops, `head_fault` in what the head read) and shadowed; the
    mismatches and what the first named."""
    from shadow_tolerance import decide_each_and_wait

    from clef_cuda import Decider
    from clef_cuda.serving.engine import Engine, EngineConfig
    from clef_cuda.verification.shadow import ShadowConfig

    decider = Decider.from_release(release, device="cpu", dtype=dtype, progress=False, ops=fault, quantize=quantize)
    if fault is not None and fault.kind == "int8_scale_off":
        fault.bind(decider.trunk)
    config = EngineConfig(
        max_model_len=8192, allow_long_context=True, kv_fraction=0.05, shadow=ShadowConfig(rate=1.0, mode="warn")
    )
    engine = Engine(decider, config)
    if head_fault is not None:
        head_fault.attach(engine)
    engine.start()
    try:
        stats = decide_each_and_wait(engine, records, timeout=600)
        first = stats.first_mismatch
        where = "-"
        if first:
            where = f"layer {first['layer']} ({first['kind']}, {first['check']})"
            where = f"the head ({first['check']})" if first["kind"] == "head" else where
        named = False
        if first and head_fault is not None:
            named = first["kind"] == "head" and first["check"] == "head input"
        elif first and fault is not None:
            expected = faulted_layer(decider.config.trunk, fault.kind, fault.layer)
            named = first["layer"] == str(expected) and first["kind"] == LAYER_KIND[fault.kind]
        return Outcome(stats.mismatch, named, where)
    finally:
        engine.stop(30)


def smallest_caught(release: Path, dtype: torch.dtype, kind: str, records: list[dict]) -> tuple[float | None, Outcome]:
    """The smallest size in SIZES at which `kind` is caught (None: never), and the outcome there."""
    from faults import LayerFaultOps

    from clef_cuda.model.config import load_release_config

    config = load_release_config(release).trunk
    layer = middle(config, kind)
    quantize = "int8" if kind == "int8_scale_off" else "none"
    sizes = SIZES if kind in SCALED else (0.0,)
    last = Outcome(0, False, "-")
    for e in sizes:
        fault = LayerFaultOps(kind, e, layer=layer, past=PAST, key_dim=config.key_dim)
        last = run(release, dtype, records, fault, quantize)
        if last.mismatches:
            return e, last
    return None, last


def smallest_caught_head(release: Path, dtype: torch.dtype, kind: str, records: list[dict]):
    """The smallest size in HEAD_SIZES at which HeadReadFault `kind` is caught (None: never), the outcome there."""
    from faults import HeadReadFault

    last = Outcome(0, False, "-")
    for e in HEAD_SIZES if kind == "option_scaled" else (0.0,):
        last = run(release, dtype, records, head_fault=HeadReadFault(kind, e))
        if last.mismatches:
            return e, last
    return None, last


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="f32,f16,bf16")
    parser.add_argument("--records", type=int, default=4, help="records per faulted run (the last one long)")
    parser.add_argument("--healthy", type=int, default=200, help="healthy records per dtype (false mismatches)")
    parser.add_argument("--kinds", default=",".join(LAYER_KIND))
    parser.add_argument("--head-kinds", default="option_scaled,question_shifted", help="HeadReadFault kinds ('' none)")
    args = parser.parse_args()
    from releases import tiny_release

    release = tiny_release()
    faulted = requests(args.records)
    rows, healthy_rows = [], []
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        for kind in filter(None, args.kinds.split(",")):
            e, outcome = smallest_caught(release, dtype, kind, faulted)
            rows.append((kind, dtype_name, e, outcome))
            print(f"{kind} {dtype_name}: caught at {e} ({outcome.where})", flush=True)
        for kind in filter(None, args.head_kinds.split(",")):
            e, outcome = smallest_caught_head(release, dtype, kind, faulted)
            rows.append((kind, dtype_name, e, outcome))
            print(f"{kind} {dtype_name}: caught at {e} ({outcome.where})", flush=True)
        if args.healthy:
            healthy = run(release, dtype, requests(args.healthy, seed=23))
            healthy_rows.append((dtype_name, args.healthy, healthy.mismatches))
    print(f"\nshadow verification's power on the CPU (the upstream tiny release, {args.records} records a run)")
    print(f"{'fault':18s} {'dtype':5s} {'smallest caught':>16s}  {'named':5s}  first reported")
    for kind, dtype_name, e, outcome in rows:
        size = "-" if e is None else (f"e = {e:.2%}" if kind in SCALED + ("option_scaled",) else "yes")
        named = "yes" if outcome.named else "no"
        print(f"{kind:18s} {dtype_name:5s} {size:>16s}  {named:5s}  {outcome.where}")
    for dtype_name, count, mismatches in healthy_rows:
        print(f"healthy {dtype_name}: {mismatches} false mismatches over {count} records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
