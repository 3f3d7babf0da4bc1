#!/usr/bin/env python3
"""Where bf16's drift on the CPU comes from, and what a bf16 mode could get back: the last token's logits of a
2,048-token prefill against transformers' fp32 (max |logit - transformers|), with our time beside each mode.

Rows:
- transformers in fp32 with only each GEMM's inputs rounded (activations and weights, products summed in fp32,
  outputs kept fp32): to f16 (llama.cpp F16's rounding: 11 significant bits) and to bf16 (8 bits). What any
  mode whose GEMMs take bf16 inputs cannot go below;
- ours in f32 (the default), in bf16 (today: bf16 activations between ops, the fp32 residual stream), and
  "f32 activations, bf16 GEMMs" (weights stored bf16, each GEMM's input rounded to bf16, its output widened to
  fp32, every other op in fp32): the mode issue 54 asks for, as a prototype over our trunk.

    python benchmarks/bf16_drift.py                  # mid shape, 2 threads
    python benchmarks/bf16_drift.py --shape hidden-2048 --repeats 5
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from releases import build_release  # noqa: E402  (tests/ is on the path only now)

_spec = importlib.util.spec_from_file_location("cpu_peers", ROOT / "benchmarks" / "cpu_peers.py")
cpu_peers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpu_peers)
BLOCK = 16


def transformers_rounded(release: Path, ids: list[int], rounding: torch.dtype | None) -> torch.Tensor:
    """transformers' last-token logits in fp32, each nn.Linear's input and weight rounded to `rounding` first."""
    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(release, dtype=torch.float32).eval()
    original = torch.nn.Linear.forward

    def rounded(self, x):
        w = self.weight.to(rounding).float()
        return F.linear(x.to(rounding).float(), w, self.bias)

    torch.nn.Linear.forward = rounded if rounding is not None else original
    try:
        with torch.inference_mode():
            return model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    finally:
        torch.nn.Linear.forward = original


class OursBf16Gemms(cpu_peers.Ours):
    """Our trunk in f32 with its linear weights stored bf16 and each GEMM's input rounded to bf16, the output
    widened to fp32 (torch's CPU GEMM has no bf16-in, fp32-out form: the output is rounded to bf16 once)."""

    def __init__(self, release: Path, tokens: int, autotune: str) -> None:
        super().__init__(release, torch.float32, "none", tokens, autotune)
        for layer in self.trunk.layers:
            for name in ("in_proj", "out_proj", "qkv_proj", "o_proj"):
                if hasattr(layer.mixer, name):
                    setattr(layer.mixer, name, getattr(layer.mixer, name).bfloat16())
            layer.gate_up, layer.down = layer.gate_up.bfloat16(), layer.down.bfloat16()
        dense = self.trunk._linear

        def linear(x, weight, lora, index, fused):
            if weight.dtype == torch.bfloat16 and x.dtype == torch.float32:
                return F.linear(x.bfloat16(), weight).float()
            return dense(x, weight, lora, index, fused)

        self.trunk._linear = linear


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(cpu_peers.SHAPES), default="mid")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--markdown", help="append the table to this file")
    args = parser.parse_args()
    if args.tokens < 16 or args.threads < 1 or args.repeats < 1:
        parser.error("--tokens must be at least 16, --threads and --repeats positive")
    torch.set_num_threads(args.threads)
    spec = cpu_peers.SHAPES[args.shape]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        release = build_release(
            Path(tmp) / args.shape,
            text=spec["text"],
            head=spec["head"],
            vocab_size=spec["vocab_size"],
            max_shard_size="2GB",
        )
        ids = torch.randint(10, spec["vocab_size"] - 10, (args.tokens,), generator=torch.Generator().manual_seed(0))
        ids = ids.tolist()
        truth = transformers_rounded(release, ids, None)
        for name, rounding in (("f16", torch.float16), ("bf16", torch.bfloat16)):
            drift = (transformers_rounded(release, ids, rounding) - truth).abs().max().item()
            rows.append([f"transformers fp32, GEMM inputs rounded to {name}", f"{drift:.2e}", "-", "-"])
        engines = {
            "ours f32": cpu_peers.Ours(release, torch.float32, "none", args.tokens, "fast"),
            "ours bf16 (today)": cpu_peers.Ours(release, torch.bfloat16, "none", args.tokens, "fast"),
            "ours f32 activations, bf16 GEMMs": OursBf16Gemms(release, args.tokens, "fast"),
        }
        drifts = {name: (e.last_logits(ids) - truth).abs().max().item() for name, e in engines.items()}
        fns = [lambda e=engine: e.last_logits(ids) for engine in engines.values()]
        seconds = dict(
            zip(
                engines,
                cpu_peers.decision_latency.interleaved_medians(fns, args.repeats, torch.device("cpu")),
                strict=True,
            )
        )
        today = seconds["ours bf16 (today)"]
        for name in engines:
            rows.append([name, f"{drifts[name]:.2e}", f"{seconds[name]:.2f}", f"{today / seconds[name]:.2f}"])
    from clef_cuda.kernels.cpu_features import cpu_model

    title = (
        f"{time.strftime('%Y-%m-%d')}, {cpu_model()}, {args.threads} threads, {args.shape}, "
        f"{args.tokens}-token prefill: bf16's drift (python benchmarks/bf16_drift.py)"
    )
    header = ["mode", "max \\|logit - transformers fp32\\|", "s", "speed vs bf16 today"]
    cpu_peers.decision_latency.publish(cpu_peers.decision_latency.markdown_table(title, header, rows), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
