"""Test-only: what a step of the model really holds in memory, measured in a fresh process (so nothing else
allocates meanwhile): RssAnon (the process's anonymous memory: tensors, not mapped files) sampled every
millisecond around one call, its peak above the level just before. Run as

    python tests/memory_probe.py vision HIDDEN INTERMEDIATE HEADS DEPTH GRID_H GRID_W
    python tests/memory_probe.py load RELEASE QUANTIZE
    python tests/memory_probe.py shadow_attention HQ HKV HEAD_DIM CONTEXT [expanded]

and it prints one JSON line {"peak": bytes, ...}. tests/test_plan.py compares it with the memory plan."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

# Every allocation of 64 KiB or more its own mapping, returned to the system when freed, so the resident set
# follows the live tensors: glibc otherwise raises this threshold to the largest block freed so far (up to
# 32 MiB), after which a warm-up's freed blocks are reused from the heap unseen and a peak reads far low (80 MB
# of a 190 MB one, under a loaded suite). Set before the process starts: __main__ re-executes itself with it.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}


def status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def rss_anon() -> int:
    return status("RssAnon")


def peak_during(fn) -> int:
    """The anonymous memory's peak above its level just before fn() runs: the larger of a sample every
    millisecond and the kernel's own high-water mark of the resident set (reset just before; a sampler starved
    by a loaded machine misses a short peak, the mark does not; it counts file pages too, few after a warm-up)."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    resident_before = status("VmRSS")
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
    return max(max(peak[0], rss_anon()) - before, status("VmHWM") - resident_before)


def vision(hidden: int, intermediate: int, heads: int, depth: int, grid_h: int, grid_w: int) -> dict:
    import torch

    from clef_cuda.model.config import VisionConfig
    from clef_cuda.model.vision import ROW_CHUNK, VisionTower
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
    patches_row = 3 * 2 * 16 * 16
    image = PreparedImage(torch.randn(patches, patches_row), (grid_h, grid_w), b"x" * 32, 2)
    # First use (thread pools, the GEMM libraries' buffers) on one row chunk's worth of patches: every row-wise
    # step at its full shape, for a small part of the image's attention. The image measured is a size the tower
    # has not seen, as a server's first image of each size is (a warm-up on the image itself took twice the time
    # and read the same peak at 16k patches, within 0.1%).
    warm_up = PreparedImage(torch.randn(ROW_CHUNK, patches_row), (64, ROW_CHUNK // 64), b"w" * 32, 2)
    tower([warm_up])
    return {"peak": peak_during(lambda: tower([image])), "patches": patches}


def load(release: str, quantize: str) -> dict:
    import clef_cuda.kernels.ops  # noqa: F401  (the extension and torch's libraries: part of the baseline)
    from clef_cuda import Decider

    holder = {}
    peak = peak_during(
        lambda: holder.update(d=Decider.from_release(release, device="cpu", progress=False, quantize=quantize))
    )
    return {"peak": peak, "weights": sum(holder["d"].weight_bytes().values())}


def _expanded_attention(query, key_cache, value_cache, cu_seqlens_q, context_lens, block_tables):
    """The fault the shadow's memory test must catch: the reference attention as it was, every KV head expanded to
    its query heads in fp32 and a masked copy of all heads' scores beside their probabilities."""
    import torch

    from clef_cuda.kernels.reference import gather_context

    group = query.shape[1] // key_cache.shape[2]
    (ctx,) = context_lens.tolist()
    keys = gather_context(key_cache, block_tables[0], ctx).float().repeat_interleave(group, dim=1)
    values = gather_context(value_cache, block_tables[0], ctx).float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float() * query.shape[2] ** -0.5, keys)
    q_len = query.shape[0]
    allowed = torch.arange(ctx)[None, :] <= (ctx - q_len + torch.arange(q_len))[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)


def shadow_attention(num_q_heads: int, num_kv_heads: int, head_dim: int, context: int, variant: str = "") -> dict:
    """The reference attention of one shadow chunk (as many tokens as shadow_chunk_tokens allows at `context`) over a
    `context`-token paged cache in fp32: its peak beyond its inputs and output, and what the plan reserves."""
    from types import SimpleNamespace

    import torch

    from clef_cuda.kernels import reference
    from clef_cuda.verification.shadow import shadow_chunk_tokens, shadow_scores_bytes

    torch.set_num_threads(1)
    config = SimpleNamespace(num_attention_heads=num_q_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim)
    chunk = shadow_chunk_tokens(config, context, dtype=torch.float32)
    block_size = 16
    blocks = -(-context // block_size)
    generator = torch.Generator().manual_seed(0)
    key_cache = torch.randn(blocks, block_size, num_kv_heads, head_dim, generator=generator)
    value_cache = torch.randn(blocks, block_size, num_kv_heads, head_dim, generator=generator)
    query = torch.randn(chunk, num_q_heads, head_dim, generator=generator)
    args = (query, key_cache, value_cache, torch.tensor([0, chunk]), torch.tensor([context]))
    tables = torch.arange(blocks)[None, :]
    run = _expanded_attention if variant == "expanded" else reference.paged_attention
    out = run(*args, tables)  # first use: thread pools, einsum's plans
    del out
    peak = peak_during(lambda: run(*args, tables))
    return {"peak": peak, "planned": shadow_scores_bytes(config, context, torch.float32), "chunk": chunk}


if __name__ == "__main__":
    if any(os.environ.get(name) != value for name, value in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], os.environ | MALLOC_ENV)
    kind, args = sys.argv[1], sys.argv[2:]
    if kind == "vision":
        result = vision(*map(int, args))
    elif kind == "shadow_attention":
        result = shadow_attention(*map(int, args[:4]), *args[4:])
    else:
        result = load(*args)
    print(json.dumps(result))
