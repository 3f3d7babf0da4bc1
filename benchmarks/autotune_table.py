#!/usr/bin/env python3
"""The start-up autotune's table on this device (clef_cuda.tuning.autotune): every candidate of each op,
checked and timed at a model's shapes per call-shape bucket, and what it chose. What clef-serve logs and
/ready returns at start-up, without a server and without the cache.

    python benchmarks/autotune_table.py                                   # clef-tiny, CPU fp32, fast
    python benchmarks/autotune_table.py --device cuda --dtype f16 --flash --mode full   # clef-flash shapes
    python benchmarks/autotune_table.py --quantize int8 --release mid     # int8 weights (the CPU candidates)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from selfcheck_cost import DTYPES, FLASH_LAYERS, random_trunk  # noqa: E402

from clef_cuda import Decider  # noqa: E402
from clef_cuda.model.default_model import default_release  # noqa: E402
from clef_cuda.serving.engine import EngineConfig  # noqa: E402
from clef_cuda.tuning.autotune import autotune  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    parser.add_argument("--mode", choices=["fast", "full"], default="fast")
    parser.add_argument("--release", default="clef-tiny", help="clef-tiny, mid (the test release) or a directory")
    parser.add_argument("--flash", action="store_true", help="random weights at clef-flash's layer shapes")
    parser.add_argument("--quantize", choices=["none", "int8"], default="none")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--prefill-chunk-size", type=int, default=1024)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.flash:
        trunk, what = random_trunk(FLASH_LAYERS, device, dtype, args.quantize), "clef-flash layer shapes"
    else:
        if args.release == "mid":
            from releases import mid_release

            path = mid_release()
        else:
            path = default_release() if args.release == "clef-tiny" else Path(args.release)
        decider = Decider.from_release(path, device=device, dtype=dtype, progress=False, quantize=args.quantize)
        trunk, what = decider.trunk, args.release
    config = EngineConfig(max_num_seqs=args.max_num_seqs, prefill_chunk_size=args.prefill_chunk_size)
    started = time.perf_counter()
    report = autotune(trunk, config, args.mode, None)
    seconds = time.perf_counter() - started
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    print(f"### autotune ({args.mode}) on {what}, {device} {args.dtype}{threads}: {seconds:.1f} s")
    print()
    print("| op | bucket | candidate | ms | result |")
    print("|---|---|---|---|---|")
    for row in report.rows:
        ms = f"{row.ms:.3f}" if row.ms is not None else "-"
        print(f"| {row.op} | {row.bucket} | {row.candidate} | {ms} | {row.status} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
