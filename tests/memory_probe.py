"""Test-only: what a step of the model really holds in memory, measured in a fresh process (so nothing else
allocates meanwhile): RssAnon (the process's anonymous memory: tensors, not mapped files) sampled every
millisecond around one call, its peak above the level just before. Run as

    python tests/memory_probe.py vision HIDDEN INTERMEDIATE HEADS DEPTH GRID_H GRID_W
    python tests/memory_probe.py load RELEASE QUANTIZE

and it prints one JSON line {"peak": bytes, ...}. tests/test_plan.py compares it with the memory plan."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise KeyError("RssAnon")


def peak_during(fn) -> int:
    """The anonymous memory's peak above its level just before fn() runs (sampled every millisecond)."""
    before, peak, done = rss_anon(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], rss_anon()) - before


def vision(hidden: int, intermediate: int, heads: int, depth: int, grid_h: int, grid_w: int) -> dict:
    import torch

    from clef_cuda.model.config import VisionConfig
    from clef_cuda.model.vision import VisionTower
    from clef_cuda.model.weights import vision_shapes
    from clef_cuda.request.images import PreparedImage

    torch.set_num_threads(1)  # the CPU attention's per-thread buffers stay out of the figure
    config = VisionConfig(
        depth=depth,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_heads=heads,
        out_hidden_size=hidden,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=2304,
    )
    weights = {name: torch.randn(shape) * 0.02 for name, shape in vision_shapes(config).items()}
    tower = VisionTower(config, weights, torch.float32)
    patches = grid_h * grid_w
    image = PreparedImage(torch.randn(patches, 3 * 2 * 16 * 16), (grid_h, grid_w), b"x" * 32, 2)
    tower([image])  # first use: thread pools, caches
    return {"peak": peak_during(lambda: tower([image])), "patches": patches}


def load(release: str, quantize: str) -> dict:
    import clef_cuda.ops  # noqa: F401  (the extension and torch's libraries: part of the baseline)
    from clef_cuda import Decider

    holder = {}
    peak = peak_during(
        lambda: holder.update(d=Decider.from_release(release, device="cpu", progress=False, quantize=quantize))
    )
    return {"peak": peak, "weights": sum(holder["d"].weight_bytes().values())}


if __name__ == "__main__":
    kind, args = sys.argv[1], sys.argv[2:]
    result = vision(*map(int, args)) if kind == "vision" else load(*args)
    print(json.dumps(result))
