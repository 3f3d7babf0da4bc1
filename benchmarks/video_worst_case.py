#!/usr/bin/env python3
"""The clip inside the video limits that costs the most to read: a minute of 1080p at 30 fps in h264 (the decode
budget, VideoLimits.max_decoded_pixels, exactly), whole and with a band of its bytes at 85-90% overwritten (a file
corrupt past where a scan looks, which decoding meets near the end). The time to decide it or to refuse it
(Decider.prepare_videos: scan, decode, resize, normalise) and this process's resident memory above what it held
before, sampled every 10 ms. The hostile-file target: a 4xx within 5 s and under 512 MiB more memory. Table last.

    python benchmarks/video_worst_case.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

SECONDS, FPS, WIDTH, HEIGHT = 60, 30, 1920, 1080


def minute_of_1080p() -> bytes:
    """A moving gradient (not noise: a realistic bitrate, 13-14 MiB), h264 in MP4."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.options = {"preset": "ultrafast", "crf": "30"}
        yy, xx = np.mgrid[0:HEIGHT, 0:WIDTH]
        for i in range(SECONDS * FPS):
            rgb = np.stack([(xx + 4 * i) % 256, (yy + 2 * i) % 256, ((xx + yy) // 4 + i) % 256], -1).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buffer.getvalue()


def corrupted(blob: bytes, start: float = 0.85, end: float = 0.90) -> bytes:
    lo, hi = int(len(blob) * start), int(len(blob) * end)
    noise = np.random.default_rng(0).integers(0, 256, hi - lo, dtype=np.uint8).tobytes()
    return blob[:lo] + noise + blob[hi:]


def timed(decider, blob: bytes) -> tuple[str, float, float]:
    """(outcome, seconds, MiB of resident memory above the start) of one prepare_videos."""
    import psutil
    from live import resident_growth

    from clef_cuda.request.videos import VideoError

    with resident_growth(psutil.Process()) as grown:
        started = time.perf_counter()
        try:
            (video,) = decider.prepare_videos([(blob, "mp4")])
            outcome = f"decided: {len(video.groups)} frame groups"
        except VideoError as error:
            outcome = f"{error.status}: {str(error)[:60]}"
        seconds = time.perf_counter() - started
    return outcome, seconds, grown[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from releases import tiny_release

    from clef_cuda import Decider
    from clef_cuda.request.videos import VideoLimits

    assert SECONDS * FPS * WIDTH * HEIGHT == VideoLimits().max_decoded_pixels  # the budget, exactly
    started = time.perf_counter()
    blob = minute_of_1080p()
    print(f"encoded {len(blob) / 2**20:.1f} MiB in {time.perf_counter() - started:.0f} s", flush=True)
    decider = Decider.from_release(tiny_release(), device="cpu", progress=False)
    rows = []
    for name, data in (("whole", blob), ("bytes at 85-90% overwritten", corrupted(blob))):
        for run in range(args.repeats):
            rows.append((name, run + 1, *timed(decider, data)))
    print(f"\n{SECONDS} s of {WIDTH}x{HEIGHT} at {FPS} fps, h264, {len(blob) / 2**20:.1f} MiB")
    print("| file | run | outcome | seconds | MiB above before |")
    print("|---|---|---|---|---|")
    for name, run, outcome, seconds, grown in rows:
        print(f"| {name} | {run} | {outcome} | {seconds:.2f} | {grown:.0f} |")


if __name__ == "__main__":
    main()
