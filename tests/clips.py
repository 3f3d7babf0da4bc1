"""Video clips for the tests, encoded in memory with PyAV (FFmpeg in its wheel): any codec the server takes, odd sizes,
a display rotation, a variable frame rate, and hostile files made from them (tests/test_videos.py)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from fractions import Fraction

import numpy as np

ENCODERS = {"h264": "libx264", "hevc": "libx265", "vp8": "libvpx", "vp9": "libvpx-vp9", "av1": "libsvtav1"}
CODECS_IN_ORDER = tuple(ENCODERS)
CONTAINER = {"h264": "mp4", "hevc": "mp4", "vp8": "webm", "vp9": "webm", "av1": "webm"}


def frames(count: int, width: int, height: int, seed: int = 0, flat: bool = False) -> Iterator[np.ndarray]:
    """Moving gradients and noise: every frame different, rows and columns distinguishable (a wrong rotation, flip or
    frame shows); `flat`: one grey frame, repeated."""
    if flat:
        grey = np.full((height, width, 3), 128, np.uint8)
        yield from (grey for _ in range(count))
        return
    rng = np.random.default_rng(seed)
    xs, ys = np.arange(width)[None, :], np.arange(height)[:, None]
    for i in range(count):
        image = np.empty((height, width, 3), np.uint8)
        image[..., 0] = (xs * 255 // max(width - 1, 1) + 7 * i) % 256
        image[..., 1] = (ys * 255 // max(height - 1, 1) + 3 * i) % 256
        image[..., 2] = rng.integers(40, 216, (height, width), dtype=np.uint8)
        yield image


def clip(
    codec: str = "h264",
    width: int = 96,
    height: int = 64,
    count: int = 30,
    fps: int = 25,
    seed: int = 0,
    times: list[float] | None = None,
    rotation: int | None = None,
    container: str | None = None,
    flat: bool = False,
    pix_fmt: str = "yuv420p",
    full_range: bool = False,
    bt709: bool = False,
    live: bool = False,
) -> bytes:
    """An encoded clip of `count` frames: constant `fps`, or each frame at `times` (seconds: a variable frame rate),
    optionally with a display rotation (degrees) in its container. `flat`: one grey frame repeated (a huge frame size
    or frame count in a few kilobytes). `pix_fmt`: the encoder's (yuv420p10le: 10 bits, with libx265, libx264 and
    libsvtav1); `full_range`: tagged full range (h264 decodes it as yuvj420p); `bt709`: tagged BT.709. `live`: a WebM
    written as a live stream, with no duration in its header."""
    buffer = io.BytesIO()
    fmt = container or CONTAINER[codec]
    out = av_open(buffer, fmt, {"live": "1"} if live else None)
    stream = out.add_stream(ENCODERS[codec], rate=fps)
    stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
    if full_range:
        stream.codec_context.color_range = 2  # AVCOL_RANGE_JPEG
    if bt709:
        context = stream.codec_context
        context.colorspace = context.color_primaries = context.color_trc = 1  # AVCOL_SPC_BT709 and its kin
    if codec in ("h264", "hevc"):
        stream.options = {"preset": "ultrafast"} | ({"x265-params": "log-level=none"} if codec == "hevc" else {})
    if times is not None:
        stream.codec_context.time_base = Fraction(1, 1000)
    if rotation is not None:
        stream.set_display_rotation(rotation)
    import av

    def timed(i: int, image: np.ndarray):
        frame = av.VideoFrame.from_ndarray(image, format="rgb24")
        if times is not None:
            frame.pts, frame.time_base = round(times[i] * 1000), Fraction(1, 1000)
        return frame

    return _encoded(
        buffer, out, stream, (timed(i, image) for i, image in enumerate(frames(count, width, height, seed, flat)))
    )


def _encoded(buffer: io.BytesIO, out, stream, frames_in) -> bytes:
    """Every frame encoded and muxed, the encoder flushed, the container closed: its bytes."""
    for frame in frames_in:
        for packet in stream.encode(frame):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)
    out.close()
    return buffer.getvalue()


def av_open(buffer: io.BytesIO, fmt: str, options: dict[str, str] | None = None):
    import av

    return av.open(buffer, "w", format=fmt, options=options or {})


def audio_only(seconds: float = 1.0) -> bytes:
    """An MP4 holding an AAC track and nothing else."""
    import av

    buffer = io.BytesIO()
    out = av.open(buffer, "w", format="mp4")
    stream = out.add_stream("aac", rate=16000)
    samples = int(16000 * seconds)
    tone = (np.sin(np.arange(samples) / 8.0) * 3000).astype(np.int16)[None, :]

    def chunk(start: int):
        frame = av.AudioFrame.from_ndarray(tone[:, start : start + 1024], format="s16", layout="mono")
        frame.sample_rate = 16000
        return frame

    return _encoded(buffer, out, stream, (chunk(start) for start in range(0, samples, 1024)))


def faststart_with_audio(count: int = 50, fps: int = 25, width: int = 96, height: int = 64) -> bytes:
    """An h264 MP4 with an AAC track beside the video, its index (moov) first (movflags +faststart): a cut keeps the
    whole index, and with two streams the header's duration is no check on the video's (an audio track may rightly
    run longer), so only the index's frame count can tell the file is short."""
    import tempfile

    import av

    with tempfile.TemporaryDirectory() as folder:  # faststart rewrites the file: a path, not a BytesIO
        path = f"{folder}/clip.mp4"
        _write_faststart_with_audio(
            av.open(path, "w", format="mp4", options={"movflags": "+faststart"}), count, fps, width, height
        )
        with open(path, "rb") as written:
            return written.read()


def _write_faststart_with_audio(out, count: int, fps: int, width: int, height: int) -> None:
    import av

    video = out.add_stream("libx264", rate=fps)
    video.width, video.height, video.pix_fmt = width, height, "yuv420p"
    video.options = {"preset": "ultrafast"}
    audio = out.add_stream("aac", rate=16000)
    samples_a_frame = 16000 // fps
    tone = (np.sin(np.arange(samples_a_frame * count) / 8.0) * 3000).astype(np.int16)[None, :]
    pending_audio = 0
    for i, image in enumerate(frames(count, width, height)):
        for packet in video.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
            out.mux(packet)
        while pending_audio + 1024 <= (i + 1) * samples_a_frame:  # the audio kept level with the video: interleaved
            chunk = av.AudioFrame.from_ndarray(
                tone[:, pending_audio : pending_audio + 1024], format="s16", layout="mono"
            )
            chunk.sample_rate, chunk.pts = 16000, pending_audio
            for packet in audio.encode(chunk):
                out.mux(packet)
            pending_audio += 1024
    for stream in (video, audio):
        for packet in stream.encode():
            out.mux(packet)
    out.close()
