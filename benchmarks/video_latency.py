#!/usr/bin/env python3
"""A 60 s clip decided against the reference on the same file, on the CPU (on a GPU when one is lent and --device
cuda): our decoding (PyAV: scan, decode, resize, normalise), the tower on its frame groups and the whole decision,
beside the reference's (clef_finetune's systemone decoding with torchcodec, in the video oracle's venv, on the same
FFmpeg), at 448p and 720p, h264 at 25 fps. A random release with a mid-size tower (vision_latency.py's), the
release's video processor (2 fps, 768 frames at most). Each number a median of --repeats runs after a warm one; the
two sides run one after the other, each on --threads threads. Table last.

    python benchmarks/video_latency.py [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

SIZES = {"448p": (796, 448), "720p": (1280, 720)}
SECONDS, FPS = 60, 25


def scene(width: int, height: int, seconds: int = SECONDS, fps: int = FPS) -> bytes:
    """An h264 MP4 of a moving scene (gradients, a travelling block, some texture): what a camera clip costs to
    decode, a few MB, not noise."""
    import av

    buffer = io.BytesIO()
    out = av.open(buffer, "w", format="mp4")
    stream = out.add_stream("libx264", rate=fps)
    stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
    stream.options = {"preset": "veryfast", "crf": "26"}
    xs, ys = np.meshgrid(np.arange(width), np.arange(height))
    texture = np.random.default_rng(0).integers(0, 48, (height, width), dtype=np.uint8)
    for i in range(seconds * fps):
        image = np.empty((height, width, 3), np.uint8)
        image[..., 0] = (xs * 255 // width + 2 * i) % 256
        image[..., 1] = (ys * 255 // height + i) % 256
        image[..., 2] = texture + (i % 64)
        x = (i * 7) % max(width - 96, 1)
        image[height // 3 : height // 3 + 96, x : x + 96] = 255 - image[height // 3 : height // 3 + 96, x : x + 96]
        for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)
    out.close()
    return buffer.getvalue()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, repeats: int) -> float:
    from vision_latency import median_ms

    return median_ms(fn, repeats) / 1e3


def reference_times(release: Path, requests: list[dict], workdir: Path, repeats: int, threads: int) -> list[dict]:
    """The reference's medians (tests/video_oracle.py --time), its clips written to files for its processor."""
    import video_oracle

    lines = []
    for n, request in enumerate(requests):
        path = workdir / f"{n}.mp4"
        path.write_bytes(request["videos"][0])
        lines.append(json.dumps(request | {"videos": [str(path)]}))
    python = video_oracle.ORACLE_VENV / "bin" / "python"
    if not python.exists():
        sys.exit(f"{python} is missing: `bash scripts/setup_env.sh test` builds the video oracle's venv")
    done = subprocess.run(
        [str(python), str(ROOT / "tests" / "video_oracle.py"), str(release), "--time", str(repeats)],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=os.environ
        | {
            "CLEF_FINETUNE_JSM": "vendored",
            "LD_LIBRARY_PATH": video_oracle.ffmpeg_library_path(),
            "CLEF_BENCH_THREADS": str(threads),
        },
    )
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from releases import build_release
    from vision_latency import TOWER

    from clef_cuda import Decider
    from clef_cuda.request.videos import request_videos, scan_video

    release = build_release(Path(tempfile.mkdtemp(prefix="clef-video-bench-")) / "release", vision=TOWER)
    decider = Decider.from_release(release, device=args.device, progress=False)
    workdir = Path(tempfile.mkdtemp(prefix="clef-video-bench-clips-"))
    requests, ours = [], []
    for name, (width, height) in SIZES.items():
        clip = scene(width, height)
        request = {
            "model": "clef-flash",
            "state": "Camera 4, aisle 7, 14:02. Review the clip.",
            "questions": {
                "fell": {"type": "noul", "instructions": "Does someone fall?"},
                "where": {"type": "choice", "criteria": {"aisle": None, "stairs": None, "yard": "Outdoors"}},
            },
            "videos": [clip],
        }
        requests.append(request)
        wire = request | {"videos": ["data:video/mp4;base64," + __import__("base64").b64encode(clip).decode()]}
        blobs = request_videos(wire, decider.options.video_limits)
        (video,) = decider.prepare_videos(blobs)
        groups = list(video.groups)
        frames = scan_video(clip, decider.options.video_limits).frames
        decode = median_seconds(lambda b=blobs: decider.prepare_videos(b), args.repeats)
        tower = median_seconds(lambda g=groups: (decider.image_features(g), synchronize(decider.device)), args.repeats)
        total = median_seconds(lambda w=wire: decider.decide(w), args.repeats)
        tokens = decider.encode(wire, [], [video]).num_tokens
        ours.append((name, len(clip), frames, len(groups), tokens, decode, tower, total))
    theirs = reference_times(release, requests, workdir, args.repeats, args.threads)
    engine_rows = engine_tower_calls(decider, requests[0], args.repeats)

    print(f"\n{SECONDS} s h264 clips at {FPS} fps, {args.device}, {args.threads} threads, median of {args.repeats}")
    print(
        "| clip | MB | frames | groups | tokens | ours: decode / tower / decision (s) | frames decoded/s "
        "| reference: decode / tower / decision (s) | decision speed-up |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for (name, size, frames, groups, tokens, decode, tower, total), ref in zip(ours, theirs, strict=True):
        assert ref["tokens"] == tokens, (name, ref["tokens"], tokens)
        print(
            f"| {name} | {size / 2**20:.1f} | {frames} | {groups} | {tokens} | {decode:.2f} / {tower:.3f} / "
            f"{total:.2f} | {frames / decode:.0f} | {ref['encode']:.2f} / {ref['tower']:.3f} / {ref['total']:.2f} "
            f"| {ref['total'] / total:.2f}x |"
        )
    print(f"\nthe {next(iter(SIZES))} clip through Engine.decide (caches off): the tower's calls, interleaved twice")
    print("| tower calls | decision (s) | tower a decision (s) |")
    print("|---|---|---|")
    for how, total, tower in engine_rows:
        print(f"| {how} | {total:.3f} | {tower:.3f} |")


def engine_tower_calls(decider, request: dict, repeats: int) -> list[tuple[str, float, float]]:
    """The first clip through Engine.decide (the server's path; vision and prefix caches off), its frame pairs sent
    to the tower one call a pair (as before 2026-12-06) and together (Decider.tower_patches): (how, decision s,
    tower s a decision), interleaved twice."""
    import base64

    from clef_cuda import Decider
    from clef_cuda.serving.engine import Engine, EngineConfig

    wire = request | {"videos": ["data:video/mp4;base64," + base64.b64encode(request["videos"][0]).decode()]}
    config = EngineConfig(max_model_len=8192, kv_fraction=0.05, vision_cache_bytes=0, prefix_cache=False)
    engine = Engine(decider, config)
    engine.start()
    together = Decider.tower_patches
    rows = []
    try:
        for _ in range(2):
            for how, budget in (("one a pair", property(lambda self: 0)), ("together", together)):
                Decider.tower_patches = budget
                before = engine.vision_seconds
                total = median_seconds(lambda: engine.decide(wire, timeout=600), repeats)
                rows.append((how, total, (engine.vision_seconds - before) / (repeats + 1)))
    finally:
        Decider.tower_patches = together
        engine.stop(10)
    return rows


if __name__ == "__main__":
    main()
