#!/usr/bin/env python3
"""The clips inside the video limits that cost the most to read (benchmarks/video_clips.py: h264 high profile with
B-frames, h265, vp9, av1, noise, at the byte, second, frame-size and frame-count limits), each whole and with a band
of its bytes at 85-90% overwritten (corrupt past where a scan looks: decoding meets it near the end). Three tables:

1. each clip's raw cost: Decider.prepare_videos (scan, decode, resize, normalise) with no decode budget, and with
   the default one (VideoLimits.max_decode_seconds, --video-decode-budget): its outcome, seconds and this process's
   resident memory above what it held before (sampled every 10 ms). The hostile-file target: a 4xx within 5 s,
   under 512 MiB more;
2. the costliest clip's decode alone (no conversion) at 1, 2, 3 (FFmpeg's choice on 2 cores) and 4 threads: what
   decoder threads can buy;
3. with --load, table 1's budgeted runs again while one busy process a core competes for the CPU (a loaded machine);
4. with --flood, a live clef-serve sent 4 copies of the costliest clip corrupted at once while a client keeps asking
   text decisions: the text decisions' latency against the same server idle, and each clip's answer and time, with
   the default decoding slots (--max-video-decodes: 1 on 2 cores) and with one slot per clip.

    python benchmarks/video_worst_case.py [--repeats 2] [--load] [--flood] [--clips NAME ...]
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import video_clips  # noqa: E402


def corrupted(blob: bytes, start: float = 0.85, end: float = 0.90) -> bytes:
    lo, hi = int(len(blob) * start), int(len(blob) * end)
    noise = np.random.default_rng(0).integers(0, 256, hi - lo, dtype=np.uint8).tobytes()
    return blob[:lo] + noise + blob[hi:]


def timed(decider, blob: bytes, fmt: str) -> tuple[str, float, float]:
    """(outcome, seconds, MiB of resident memory above the start) of one prepare_videos."""
    import psutil
    from live import resident_growth

    from clef_cuda.request.videos import VideoError

    with resident_growth(psutil.Process()) as grown:
        started = time.perf_counter()
        try:
            (video,) = decider.prepare_videos([(blob, fmt)])
            outcome = f"decided: {len(video.groups)} frame groups"
        except VideoError as error:
            outcome = f"{error.status}: {_short(str(error))}"
        seconds = time.perf_counter() - started
    return outcome, seconds, grown[0]


def _short(message: str) -> str:
    message = message.removeprefix("video 1: ")
    if "decoding took over" in message:
        return "over the decode budget, " + message.split("), ")[1].split(":")[0]
    return message.split(" (")[0][:60]


def decode_only(blob: bytes, fmt: str, threads: int) -> float:
    """Seconds to decode every frame (FFmpeg only: nothing converted or resized), `threads` FFmpeg threads."""
    import av

    started = time.perf_counter()
    with av.open(io.BytesIO(blob), format={"mp4": "mp4", "webm": "matroska"}[fmt]) as container:
        stream = container.streams.video[0]
        stream.thread_type, stream.codec_context.thread_count = "AUTO", threads
        for _ in container.decode(stream):
            pass
    return time.perf_counter() - started


TEXT = {
    "model": "clef-flash",
    "state": "Camera 4, 14:02: the aisle is clear.",
    "questions": {"clear": {"type": "noul", "instructions": "Is the aisle clear?"}},
}


def flood(clip_blob: bytes, slots: int | None, clips: int = 4) -> dict:
    """A live clef-serve (the upstream tiny release, with its tower) flooded with `clips` copies of `clip_blob` at
    once (`slots`: --max-video-decodes, None: its default) while one client asks text decisions back to back:
    the text decisions' median and worst seconds idle and during the flood, each clip's status and seconds."""
    import base64
    import statistics
    import threading

    import httpx
    from live import ClefServe
    from releases import tiny_release

    flags = ["--w", str(tiny_release()), "--d", "cpu", "--kv-fraction", "0.05", "--autotune", "off"]
    server = ClefServe(*flags, *(["--max-video-decodes", str(slots)] if slots else []))
    try:
        server.assert_ready()
        with httpx.Client(base_url=server.url, timeout=120) as client:

            def text_seconds() -> float:
                started = time.perf_counter()
                assert client.post("/v1/systemone", json=TEXT).status_code == 200
                return time.perf_counter() - started

            idle = [text_seconds() for _ in range(10)]
            body = dict(TEXT, videos=["data:video/mp4;base64," + base64.b64encode(clip_blob).decode()])
            started = time.perf_counter()  # the largest body the limits let in: two such clips in one request
            both = client.post("/v1/systemone", json=dict(body, videos=body["videos"] * 2))
            two = (both.status_code, time.perf_counter() - started)
            answers: list[tuple[int, float]] = []

            def send() -> None:
                started = time.perf_counter()
                status = httpx.post(server.url + "/v1/systemone", json=body, timeout=300).status_code
                answers.append((status, time.perf_counter() - started))

            senders = [threading.Thread(target=send) for _ in range(clips)]
            for sender in senders:
                sender.start()
            time.sleep(0.5)  # the clips are in
            during = []
            while any(sender.is_alive() for sender in senders):
                during.append(text_seconds())
            for sender in senders:
                sender.join()
    finally:
        server.kill()
    return {
        "idle": (statistics.median(idle), max(idle)),
        "during": (statistics.median(during), max(during), len(during)),
        "clips": sorted(answers, key=lambda a: a[1]),
        "two": two,
    }


def _burn(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--load", action="store_true", help="also with one busy process a core competing")
    parser.add_argument("--flood", action="store_true", help="also a live server flooded with the costliest clip")
    parser.add_argument("--clips", nargs="+", default=[clip.name for clip in video_clips.CLIPS])
    args = parser.parse_args()
    from releases import tiny_release

    from clef_cuda import Decider
    from clef_cuda.request.videos import VideoLimits

    budget = VideoLimits().max_decode_seconds
    clips = [video_clips.BY_NAME[name] for name in args.clips]
    files = {clip.name: video_clips.clip_bytes(clip) for clip in clips}
    for clip in clips:  # inside every limit: bytes, frame size, frames, decode budget in pixels
        assert len(files[clip.name]) <= VideoLimits().max_bytes, clip.name
        frames = video_clips.SECONDS * clip.fps
        assert (
            frames <= VideoLimits().max_frames and frames * clip.width * clip.height <= VideoLimits().max_decoded_pixels
        )
    deciders = {
        "none": Decider.from_release(
            tiny_release(), device="cpu", progress=False, video_limits=VideoLimits(max_decode_seconds=None)
        ),
        f"{budget:g} s": Decider.from_release(tiny_release(), device="cpu", progress=False),
    }
    rows = []
    for clip in clips:
        blob = files[clip.name]
        for name, data in (("whole", blob), ("85-90% overwritten", corrupted(blob))):
            for budget_name, decider in deciders.items():
                for run in range(args.repeats):
                    rows.append((clip.name, name, budget_name, run + 1, *timed(decider, data, clip.container)))
                    print(rows[-1], flush=True)
    cores = len(os.sched_getaffinity(0))
    print(
        f"\n{cores} cores; {video_clips.SECONDS} s clips, each at most 16 MiB (--max-video-mib) and the decode budget"
    )
    print(
        "of pixels; the clips: " + "; ".join(f"{c.name}: {c.what}, {len(files[c.name]) / 2**20:.1f} MiB" for c in clips)
    )
    print("\n| clip | file | decode budget | run | outcome | seconds | MiB above before |")
    print("|---|---|---|---|---|---|---|")
    for clip_name, name, budget_name, run, outcome, seconds, grown in rows:
        print(f"| {clip_name} | {name} | {budget_name} | {run} | {outcome} | {seconds:.2f} | {grown:.0f} |")

    worst = max((r for r in rows if r[2] == "none"), key=lambda r: r[5])[0]
    clip = video_clips.BY_NAME[worst]
    print(f"\nThe costliest, {worst}, decoded alone (FFmpeg, every frame, nothing converted):")
    print("| FFmpeg threads | seconds | frames a second |")
    print("|---|---|---|")
    for threads in (1, 2, 3, 4):
        seconds = min(decode_only(files[worst], clip.container, threads) for _ in range(args.repeats))
        print(
            f"| {threads}{' (FFmpeg: cores + 1)' if threads == cores + 1 else ''} | {seconds:.2f} | "
            f"{video_clips.SECONDS * clip.fps / seconds:.0f} |",
            flush=True,
        )

    if args.flood:
        print(f"\nA live server, 4 copies of {worst} corrupted at once, a client asking text decisions meanwhile:")
        print(
            "| --max-video-decodes | two clips in one request: status, s | text decision idle: median, worst s | "
            "during the flood: median, worst s (decisions) | the clips: status, seconds |"
        )
        print("|---|---|---|---|---|")
        for slots in (None, 4):
            found = flood(corrupted(files[worst]), slots)
            idle, during, two = found["idle"], found["during"], found["two"]
            answers = ", ".join(f"{status} {seconds:.1f}" for status, seconds in found["clips"])
            label = f"{slots}" if slots else f"default ({max(1, cores // 4)})"
            print(
                f"| {label} | {two[0]} {two[1]:.1f} | {idle[0]:.3f}, {idle[1]:.3f} | {during[0]:.3f}, {during[1]:.3f} "
                f"({during[2]}) | {answers} |",
                flush=True,
            )

    if args.load:
        stop = multiprocessing.Event()
        burners = [multiprocessing.Process(target=_burn, args=(stop,)) for _ in range(cores)]
        for burner in burners:
            burner.start()
        try:
            loaded = []
            for clip in clips:
                for name, data in (("whole", files[clip.name]), ("85-90% overwritten", corrupted(files[clip.name]))):
                    loaded.append((clip.name, name, *timed(deciders[f"{budget:g} s"], data, clip.container)))
        finally:
            stop.set()
            for burner in burners:
                burner.join()
        print(f"\nLoaded: {cores} busy processes beside it, the {budget:g} s budget:")
        print("| clip | file | outcome | seconds | MiB above before |")
        print("|---|---|---|---|---|")
        for clip_name, name, outcome, seconds, grown in loaded:
            print(f"| {clip_name} | {name} | {outcome} | {seconds:.2f} | {grown:.0f} |")


if __name__ == "__main__":
    main()
