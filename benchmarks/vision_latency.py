#!/usr/bin/env python3
"""The vision path against the reference (transformers' Qwen3.5 vision tower and clef_finetune's
systemone) in the same run and dtype: the tower per image at 256 and 1024 image tokens, a whole decision
with one image, and a decision whose image is in the vision cache (the tower skipped). A random release
with a mid-size tower (6 blocks of 384, 48x48 learned positions, like clef-flash's layout), CPU fp32 by
default. Table last.

    python benchmarks/vision_latency.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

TOWER = dict(depth=6, hidden_size=384, intermediate_size=1536, num_heads=6, num_position_embeddings=2304, patch_size=16)
SIDES = {256: (512, 512), 1024: (1024, 1024)}  # image tokens -> width, height (16-px patches, 2x2 merged)


def median_ms(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from images import data_url, png
    from releases import build_release, reference_model

    from clef_cuda import Decider
    from clef_cuda.request.images import request_images
    from clef_cuda.serving.engine import Engine, EngineConfig

    release = build_release(Path(tempfile.mkdtemp(prefix="clef-vision-bench-")) / "release", vision=TOWER)
    # 1024 tokens are 1024x1024 pixels: above the test processor's default budget (1,003,520), so raise it.
    decider = Decider.from_release(release, device="cpu", progress=False, image_max_pixels=1024 * 1024)
    jsm, model, processor = reference_model(release)
    rows = []
    for tokens, (width, height) in SIDES.items():
        (prepared,) = decider.prepare_images([png(width, height, tokens)])
        assert prepared.num_tokens == tokens, prepared.num_tokens
        grid = torch.tensor([[1, *prepared.grid]])
        ours = median_ms(lambda p=prepared: decider.image_features([p]), args.repeats)
        with torch.inference_mode():
            theirs = median_ms(
                lambda p=prepared, g=grid: model.language_model.model.get_image_features(p.pixel_values, g),
                args.repeats,
            )
        rows.append((f"vision tower, {tokens} image tokens", ours, theirs))

    image = data_url(png(*SIDES[256], 7))
    request = {
        "model": "clef-flash",
        "state": "Claim 1182: " + "the rear bumper is dented and scratched. " * 20,
        "questions": {
            "dented": {"type": "noul"},
            "where": {"type": "choice", "criteria": {"front": None, "rear": None}},
        },
        "images": [image],
    }
    ours = median_ms(lambda: decider.decide(request), args.repeats)
    theirs = median_ms(lambda: jsm.systemone(model, processor, request), args.repeats)
    rows.append(("decision with one 256-token image", ours, theirs))

    engine = Engine(decider, EngineConfig(max_model_len=4096, kv_fraction=0.05, prefix_cache=False))
    engine.start()
    try:
        engine.decide(request, timeout=300)  # the image's features are now cached
        calls = []
        real = decider.image_features
        decider.image_features = lambda images: calls.append(images) or real(images)
        cached = median_ms(lambda: engine.decide(request, timeout=300), args.repeats)
        decider.image_features = real
        assert not calls, "the vision cache did not skip the tower"
    finally:
        engine.stop(10)
    rows.append(("same decision, image in the vision cache", cached, theirs))
    assert request_images(request, decider.options.image_limits)

    print(f"\nvision path, CPU ({args.threads} threads), fp32; tower: {TOWER}")
    print(f"{'case':<42} {'ours ms':>9} {'reference ms':>13} {'speed-up':>9}")
    for name, ours_ms, theirs_ms in rows:
        print(f"{name:<42} {ours_ms:>9.1f} {theirs_ms:>13.1f} {theirs_ms / ours_ms:>8.2f}x")


if __name__ == "__main__":
    main()
