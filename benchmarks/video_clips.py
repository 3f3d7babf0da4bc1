"""The clips video_worst_case.py decodes: every codec the server takes, at the limits (a minute, the decode budget of
pixels, up to 16 MiB), in the content and encoder settings that cost a decoder the most. Encoded once with PyAV's own
encoders (libx264, libx265, libvpx-vp9, libsvtav1: the FFmpeg the server decodes with) and kept under
.cache/video_worst_case/ by a digest of their settings (a minute of 1080p noise takes x265 several minutes on 2 cores).

    python benchmarks/video_clips.py [NAME ...]   # encode (or find) them, print each one's size and settings
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "video_worst_case"
SECONDS = 60
# A bitrate that fills the byte limit (16 MiB over 60 s: 2.24 Mbit/s) with a little room for the container.
FULL_RATE = "2100k"


@dataclass(frozen=True)
class Clip:
    name: str
    codec: str  # PyAV's encoder
    container: str  # mp4 | webm
    width: int
    height: int
    fps: int
    content: str  # noise: a moving gradient under block noise (the encoder spends every bit); gradient: smooth
    options: dict = field(default_factory=dict)  # the encoder's
    what: str = ""  # the settings in words, for the table

    @property
    def path(self) -> Path:
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]
        return CACHE / f"{self.name}-{digest}.{self.container}"


def _x264(preset: str, **extra: str) -> dict:
    return {"preset": preset, "b": FULL_RATE} | extra  # average bitrate (a VBV cap made x264 spend a third of it)


CLIPS = (
    Clip(
        "h264-ultrafast-gradient",
        "libx264",
        "mp4",
        1920,
        1080,
        30,
        "gradient",
        {"preset": "ultrafast", "crf": "30"},
        "x264 ultrafast (no CABAC, deblocking or B-frames), a moving gradient: the old worst case",
    ),
    Clip(
        "h264-high-noise",
        "libx264",
        "mp4",
        1920,
        1080,
        30,
        "noise",
        _x264("medium", profile="high"),
        "x264 medium, high profile (CABAC, deblocking, 3 B-frames, 8x8 transforms), noise",
    ),
    Clip(
        "hevc-noise",
        "libx265",
        "mp4",
        1920,
        1080,
        30,
        "noise",
        {"preset": "medium", "b": FULL_RATE, "x265-params": "log-level=error"},
        "x265 medium (B-frames, SAO, deblocking), noise",
    ),
    Clip(
        "vp9-noise",
        "libvpx-vp9",
        "webm",
        1920,
        1080,
        30,
        "noise",
        {"b": FULL_RATE, "minrate": FULL_RATE, "maxrate": FULL_RATE}  # constant bitrate
        | {"deadline": "good", "cpu-used": "5", "row-mt": "1"},
        "libvpx-vp9 good, cpu-used 5, constant bitrate, noise",
    ),
    Clip(
        "av1-noise",
        "libsvtav1",
        "mp4",
        1920,
        1080,
        30,
        "noise",
        {"b": "3200k", "preset": "10"},  # SVT-AV1 undershoots noise: 2100k gave 9.9 MiB
        "SVT-AV1 preset 10, noise",
    ),
    Clip(
        "hevc-4k-noise",
        "libx265",
        "mp4",
        3840,
        2160,
        7,
        "noise",
        {"preset": "fast", "b": FULL_RATE, "x265-params": "log-level=error"},
        "x265 fast, 3840x2160 (the largest frame) at 7 fps, noise: 120 sampled frames converted at 4K",
    ),
    Clip(
        "h264-240fps-noise",
        "libx264",
        "mp4",
        640,
        360,
        240,
        "noise",
        _x264("medium", profile="high"),
        "x264 medium, high profile, 640x360 at 240 fps (14,400 frames: the frame limit), noise",
    ),
)
BY_NAME = {clip.name: clip for clip in CLIPS}


def _frames(clip: Clip):
    """RGB frames. gradient: each channel's gradient moving its own way (the first worst-case clip's); noise: a
    gradient moving 4 pixels a frame under fresh 2x2-block noise of +-40 levels."""
    import av

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0 : clip.height, 0 : clip.width]
    base = np.stack([xx % 256, yy % 256, ((xx + yy) // 4) % 256], -1).astype(np.int16)
    half = (-(-clip.height // 2), -(-clip.width // 2), 3)
    for i in range(SECONDS * clip.fps):
        if clip.content == "gradient":
            rgb = np.stack([(xx + 4 * i) % 256, (yy + 2 * i) % 256, ((xx + yy) // 4 + i) % 256], -1)
        else:
            rgb = np.roll(base, 4 * i, axis=1)
        if clip.content == "noise":
            noise = rng.integers(-40, 40, half, dtype=np.int16).repeat(2, 0).repeat(2, 1)
            rgb = rgb + noise[: clip.height, : clip.width]
        yield av.VideoFrame.from_ndarray(np.clip(rgb, 0, 255).astype(np.uint8), format="rgb24")


def encode(clip: Clip) -> bytes:
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format=clip.container) as out:
        stream = out.add_stream(clip.codec, rate=clip.fps)
        stream.width, stream.height, stream.pix_fmt = clip.width, clip.height, "yuv420p"
        stream.options = dict(clip.options)
        if "b" in clip.options:
            stream.bit_rate = int(clip.options["b"].removesuffix("k")) * 1000
        for frame in _frames(clip):
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buffer.getvalue()


def clip_bytes(clip: Clip) -> bytes:
    """The clip, from the cache or encoded now (and cached)."""
    if clip.path.exists():
        return clip.path.read_bytes()
    started = time.perf_counter()
    data = encode(clip)
    CACHE.mkdir(parents=True, exist_ok=True)
    clip.path.with_suffix(".part").write_bytes(data)
    clip.path.with_suffix(".part").rename(clip.path)
    print(f"encoded {clip.name}: {len(data) / 2**20:.1f} MiB in {time.perf_counter() - started:.0f} s", flush=True)
    return data


def main(names: list[str]) -> None:
    for name in names or list(BY_NAME):
        data = clip_bytes(BY_NAME[name])
        print(f"{name}: {len(data) / 2**20:.2f} MiB, {BY_NAME[name].what}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
