"""Videos: bytes from a client -> the tower's inputs, frame group by frame group, exactly as the reference makes them
(transformers' Qwen3VLVideoProcessor, its videos decoded by torchcodec in exact mode).

Decoding is PyAV's (FFmpeg in its wheel, nothing else to install), converted to RGB by an FFmpeg filter graph as
torchcodec converts (_RGBConverter): its RGB frames are the ones torchcodec gives the reference, byte for byte, when
both run on the same FFmpeg, on every codec we take and every pixel format tests/test_videos.py checks (8, 10 and
12 bits; 4:2:0, 4:2:2, 4:4:0, 4:4:4; planar RGB; full range; BT.709); formats beyond those go the same way,
unchecked. The tests run the reference in a side venv on PyAV's FFmpeg: FFmpeg versions themselves can disagree on
a file's length.
What the reference does, step by step, and where it lives here:
1. scan: every packet of the best video stream, demuxed, not decoded (torchcodec's exact mode): the frame count, the
   first pts, the end (max pts + duration), so the average fps = frames / (end - begin) (scan_video);
2. sample: fps 2 a second, at least `min_frames`, at most `max_frames` and the frame count, spaced evenly over the
   frame indices (sample_indices); each pair's timestamp is the mean of its frames' index / fps (timestamps);
3. decode those frames (display order; the rotation the container declares applied), resize the clip to one size
   for all its frames (target_size: `size` bounds the pixels of every frame together), rescale and normalise,
   pad to an even count with the last frame, and cut into groups of 2 frames: each group is one "image" of the tower
   (the tower attends within a group; tests/test_videos.py checks the tower's video path against transformers').
The release's processor does not cap pixels per frame (`cap_pixels_per_frame` unset: transformers' default, which
it warns about); neither do we, so both spend the same tokens.

Hostile files cost little and end in a 4xx: the container is told by its first bytes (MP4's ftyp box, WebM's EBML
header) and opened as that format only, from memory (no path, no URL, no external reference); the header's size,
codec and duration are checked before anything is decoded; the scan stops at the frame-count and duration limits;
the decode is bounded by the frames it must run through times their pixels, and in time by the request's decode
budget (VideoLimits.max_decode_seconds: a decoder's cost a pixel varies 4x between codecs, and a file corrupt at its
end shows it only there); only the sampled frames are converted and resized, one at a time; a file cut short is
refused (frames missing from its index, or ending before its header's duration). Only FFmpeg's errors about a file
are the client's (a 422); any other exception is ours and propagates. Nothing here opens a file or a URL.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from clef_cuda.errors import ReleaseError
from clef_cuda.request.images import (
    ImageError,
    PreparedImage,
    base64_size,
    processor_config,
    processor_section,
    strict_base64,
)

Tensor = torch.Tensor
FORMATS = ("mp4", "webm")
CODECS = ("h264", "hevc", "vp8", "vp9", "av1")  # FFmpeg's decoder names
_DEMUXER = {"mp4": "mp4", "webm": "matroska"}  # forced: no probing of other formats
_DATA_URL = re.compile(r"data:video/(mp4|webm);base64,", re.IGNORECASE)
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")


class VideoError(ImageError):
    """A video a client sent cannot be used: 413 over a byte, length or size limit, else 422; `loc` into the body."""

    def __init__(self, message: str, status: int = 422, loc: tuple = ("videos",), error_type: str = "value_error"):
        super().__init__(message, status, loc, error_type)


@dataclass(frozen=True)
class VideoLimits:
    """What one request's videos may be. The defaults are Cloudflare's hosted clef-omni's (2 videos, 16 MiB and 60 s
    each); the rest bound the work a file can ask for whatever its header claims."""

    max_videos: int = 2  # --max-videos
    max_bytes: int = 16 * 2**20  # each, decoded from base64 (--max-video-mib)
    max_seconds: float = 60.0  # each, from the scan (--max-video-seconds)
    max_frame_pixels: int = 3840 * 2160  # one frame, from the header
    max_side: int = 8192
    max_frames: int = 14_400  # frames a scan counts (60 s at 240 fps)
    max_decoded_pixels: int = 1920 * 1080 * 30 * 60  # frames decoded x their pixels: a minute of 1080p30
    # Wall seconds a request's videos may take to scan and decode, all of them together (--video-decode-budget;
    # None: no budget). The pixel budget above does not bound the time: a decoder's cost a pixel varies 4x between
    # codecs and encoder settings (x264 ultrafast to x265 with B-frames and SAO, benchmarks/video_worst_case.py),
    # and a file corrupt at its end is only found there. 413 past it: with the ~1 s two 16 MiB clips take to arrive
    # and be parsed, within the hostile-file target (a 4xx in 5 s).
    max_decode_seconds: float | None = 3.5
    decode_threads: int = 0  # FFmpeg's decoding threads for one video (0: FFmpeg's choice, the cores + 1)

    def check_count(self, count: int, loc: tuple = ("videos",)) -> None:
        if count > self.max_videos:
            raise VideoError(
                f"{count} videos sent: at most {self.max_videos} videos per request (--max-videos)", loc=loc
            )

    def check_size(self, size: int) -> None:
        if size > self.max_bytes:
            raise VideoError(
                f"the video is {size / 2**20:.1f} MiB: at most {self.max_bytes / 2**20:g} MiB per video "
                "(--max-video-mib)",
                status=413,
            )


# ---- wire forms ---------------------------------------------------------------------------------
def wire_video_bytes(item: Any, limits: VideoLimits) -> tuple[bytes, str | None]:
    """One entry of a request's `videos`: a data URL (data:video/mp4 or webm;base64,...), a {content_type, base64}
    object or plain base64 -> (its bytes, the format it was declared as, if any). URLs and paths are refused: never
    fetched or opened."""
    declared = None
    if isinstance(item, dict):
        content_type, data = item.get("content_type"), item.get("base64")
        if not isinstance(content_type, str) or not isinstance(data, str):
            raise VideoError("a video object needs string 'content_type' and 'base64' fields")
        if content_type.lower() not in ("video/mp4", "video/webm"):
            raise VideoError(f"content_type {content_type[:40]!r} is not video/mp4 or video/webm")
        declared, encoded = content_type.lower().removeprefix("video/"), data
    elif isinstance(item, str):
        match = _DATA_URL.match(item)
        if match:
            declared, encoded = match[1].lower(), item[match.end() :]
        elif item[:5].lower() == "data:":
            raise VideoError("a data URL must be data:video/(mp4|webm);base64,<data>")
        elif re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", item) or item.startswith(("/", ".", "~", "\\")):
            raise VideoError("videos must be data URLs or base64: URLs and paths are never fetched or opened")
        elif not _BASE64.fullmatch(item) or len(item) % 4:
            raise VideoError("the video is neither a data URL nor strict standard base64")
        else:
            encoded = item
    else:
        raise VideoError("a video must be a data URL, a base64 string or a {content_type, base64} object")
    limits.check_size(base64_size(encoded))  # known from the base64 before decoding anything
    try:
        return strict_base64(encoded, "the video data"), declared
    except ImageError as error:
        raise VideoError(str(error)) from error


def request_videos(request: dict[str, Any], limits: VideoLimits) -> list[tuple[bytes, str | None]]:
    """The (bytes, declared format) of a request's `videos`, within the limits: what the in-process Decider and
    clef-serve batch take (the HTTP server's forms: clef_cuda.request.media). VideoError naming the entry."""
    entries = request.get("videos") or []
    if not isinstance(entries, list):
        raise VideoError("videos must be an array")
    limits.check_count(len(entries))
    found = []
    for index, entry in enumerate(entries):
        try:
            found.append(wire_video_bytes(entry, limits))
        except VideoError as error:
            raise VideoError(f"video {index + 1}: {error}", error.status, ("videos", index)) from error
    return found


def sniff(data: bytes) -> str:
    """mp4 or webm, from the first bytes (an ISO BMFF ftyp box; an EBML header): VideoError otherwise."""
    if len(data) >= 12 and data[4:8] == b"ftyp":
        return "mp4"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "webm"
    if data[:8] == b"\x89PNG\r\n\x1a\n" or data[:3] == b"\xff\xd8\xff" or data[8:12] == b"WEBP":
        raise VideoError("an image sent as a video: videos are MP4 or WebM files (images go in `images`)")
    raise VideoError("not an MP4 or WebM file (by its first bytes)")


# ---- the release's video processor --------------------------------------------------------------------
@dataclass(frozen=True)
class VideoProcessorConfig:
    """processor_config.json["video_processor"] (or video_preprocessor_config.json) of the release."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int  # size["shortest_edge"]: the clip's pixels, all frames together
    max_pixels: int  # size["longest_edge"]
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale_factor: float
    resample: str
    fps: float
    min_frames: int
    max_frames: int
    cap_pixels_per_frame: bool  # unset in the release: False, transformers' default
    max_video_tokens: int

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def max_input_patches(self) -> int:
        """The most patches one input of the tower (a group of temporal_patch_size frames, each patch spanning
        them) can have: the clip's pixel budget over the fewest frames a clip resizes for (a 2-frame clip: target_size
        rounds the count to whole groups), capped per frame where the release asks (cap_pixels_per_frame). What the
        memory plan sizes the tower's step for."""
        per_frame = self.max_pixels // self.temporal_patch_size
        if self.cap_pixels_per_frame:
            per_frame = max(min(self.max_video_tokens * self.factor**2, per_frame), int(self.min_pixels * 1.05))
        return per_frame // self.patch_size**2


def load_video_processor_config(model_dir: str | Path) -> VideoProcessorConfig | None:
    """The release's video processor settings, or None when it has none (then videos are refused)."""
    found = processor_section(model_dir, "video_processor", "video_preprocessor_config.json")
    return _video_config(*found) if found is not None else None


def _video_config(d: dict, where: str) -> VideoProcessorConfig:
    image_like = processor_config(d, where)  # the settings images and videos share, checked alike

    def positive(name: str, default, kind=(int, float)):
        value = d.get(name, default)
        if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
            raise ReleaseError(f"{where}: field '{name}' must be a positive number, got {value!r}")
        return value

    if d.get("do_sample_frames", True) is not True:
        raise ReleaseError(
            f"{where}: field 'do_sample_frames' is {d.get('do_sample_frames')!r}; clef's processor sets it"
        )
    return VideoProcessorConfig(
        patch_size=image_like.patch_size,
        merge_size=image_like.merge_size,
        temporal_patch_size=image_like.temporal_patch_size,
        min_pixels=image_like.min_pixels,
        max_pixels=image_like.max_pixels,
        mean=image_like.mean,
        std=image_like.std,
        rescale_factor=image_like.rescale_factor,
        resample=image_like.resample,
        fps=float(positive("fps", 2)),
        min_frames=int(positive("min_frames", 4, int)),
        max_frames=int(positive("max_frames", 768, int)),
        cap_pixels_per_frame=bool(d.get("cap_pixels_per_frame") or False),
        max_video_tokens=int(positive("max_video_tokens", 768, int)),
    )


# ---- the reference's arithmetic ----------------------------------------------------------------------
def sample_indices(frames: int, fps: float, config: VideoProcessorConfig) -> list[int]:
    """The frame indices the reference samples (Qwen3VLVideoProcessor.sample_frames): numpy's linspace, rounded
    half to even."""
    import numpy as np

    count = int(frames / fps * config.fps)
    count = min(max(count, config.min_frames), config.max_frames, frames)
    return [int(i) for i in np.linspace(0, frames - 1, count).round().astype(int)]


def timestamps(indices: list[int], fps: float, temporal: int) -> list[float]:
    """Each group's time in seconds: the mean of its first and last frame's index / fps (the last frame repeated to
    fill the last group), as the reference's processor writes before each group."""
    padded = list(indices) + [indices[-1]] * (-len(indices) % temporal)
    seconds = [index / fps for index in padded]
    return [(seconds[i] + seconds[i + temporal - 1]) / 2 for i in range(0, len(seconds), temporal)]


def target_size(frames: int, height: int, width: int, config: VideoProcessorConfig) -> tuple[int, int]:
    """The clip's resized (height, width): every frame the same, the pixels of all of them together within the
    processor's bounds (its smart_resize for videos)."""
    factor, temporal = config.factor, config.temporal_patch_size
    max_pixels = config.max_pixels
    if config.cap_pixels_per_frame:
        per_frame = max(
            min(config.max_video_tokens * factor * factor, config.max_pixels // frames), int(config.min_pixels * 1.05)
        )
        max_pixels = per_frame * frames
    if frames < temporal:
        raise VideoError(f"a video of {frames} frame(s): at least {temporal} are needed")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise VideoError(f"a {width}x{height} video is more than 200:1")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < config.min_pixels:
        beta = math.sqrt(config.min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# ---- scan, then decode ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VideoHeader:
    format: str  # mp4 | webm
    codec: str
    width: int  # as stored (before the rotation is applied)
    height: int
    frames: int  # from the scan
    seconds: float  # end - begin, from the scan
    pts: tuple[int, ...]  # every frame's pts, sorted (the scan's frame index)

    @property
    def fps(self) -> float:
        return self.frames / self.seconds


def _open(data: bytes, fmt: str):
    import av

    try:
        # Opened from memory as the sniffed format only: no probing, no other demuxer, no path or URL (external
        # references in MP4 are off by default: enable_drefs).
        return av.open(io.BytesIO(data), mode="r", format=_DEMUXER[fmt], options={"enable_drefs": "0"})
    except _unreadable() as error:
        raise VideoError(f"the {fmt} file could not be opened ({_first_line(error)})") from error


def _unreadable() -> tuple[type[BaseException], ...]:
    """What PyAV raises about a file it cannot read: FFmpeg's errors (av.error.FFmpegError and its subclasses, which
    are also ValueError or OSError), the client's 422. Nothing else: a ValueError or OSError of ours (the resize, the
    grouping, torch) is our fault, a 500 with the traceback logged (app.decisions.frame), never the client's
    'corrupt'. A function: av is imported only when videos come."""
    import av

    return (av.error.FFmpegError,)


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0][:200]


def scan_video(data: bytes, limits: VideoLimits, declared: str | None = None) -> VideoHeader:
    """The container, stream and frame index, without decoding: every limit a header or a scan decides. A declared
    format (the data URL's or content_type's) must be what the bytes are."""
    fmt = sniff(data)
    if declared is not None and declared != fmt:
        raise VideoError(f"declared video/{declared}, but the bytes are {fmt.upper()}")
    with _open(data, fmt) as container:
        stream = container.streams.best("video")
        if stream is None:
            kinds = sorted({s.type for s in container.streams}) or ["nothing"]
            raise VideoError(f"the {fmt} file has no video stream (it holds {', '.join(kinds)})")
        codec = stream.codec_context.codec.canonical_name  # the format (av1), not the decoder (libdav1d)
        if codec not in CODECS:
            raise VideoError(f"a {codec} video: supported codecs are {', '.join(CODECS)}")
        width, height = stream.codec_context.width, stream.codec_context.height
        if width <= 0 or height <= 0:
            raise VideoError(f"a {fmt} video of {width}x{height} pixels")
        if width * height > limits.max_frame_pixels or max(width, height) > limits.max_side:
            raise VideoError(
                f"a {width}x{height} video: at most {limits.max_frame_pixels / 1e6:.1f} megapixels and "
                f"{limits.max_side} pixels a side per frame",
                status=413,
            )
        if container.duration is not None and container.duration / 1e6 > 8 * limits.max_seconds:
            raise VideoError(_too_long(container.duration / 1e6, limits), status=413)  # the header, before the scan
        time_base = stream.time_base
        if time_base is None or time_base.denominator == 0:
            raise VideoError(f"the {fmt} file's video stream has no time base")
        indexed = stream.frames  # the frames an MP4's sample table lists (0 in WebM: no such index)
        # The header's length, comparable with the scan's only where the video is the file's one stream (an audio
        # track may rightly run longer).
        header_seconds = container.duration / 1e6 if container.duration and len(container.streams) == 1 else None
        pts: list[int] = []
        begin = end = None
        packets = 0
        try:
            for packet in container.demux(stream):
                if packet.size == 0 and packet.pts is None and packet.dts is None:
                    continue  # the demuxer's flush packet, not a frame
                packets += 1
                if packet.is_discard:
                    continue
                stamp = packet.pts if packet.pts is not None else packet.dts
                if stamp is None:
                    raise VideoError(f"the {fmt} file has a video packet with no timestamp")
                pts.append(stamp)
                begin = stamp if begin is None else min(begin, stamp)
                end = stamp + packet.duration if end is None else max(end, stamp + packet.duration)
                if len(pts) > limits.max_frames:
                    raise VideoError(f"the video has over {limits.max_frames} frames", status=413)
                if float(end - begin) * time_base > limits.max_seconds:  # the scan stops here: how far is unknown
                    raise VideoError(_too_long(None, limits), status=413)
        except VideoError:
            raise
        except _unreadable() as error:
            raise VideoError(f"the {fmt} file is corrupt or truncated ({_first_line(error)})") from error
    if len(pts) < 2:
        raise VideoError(f"a video of {len(pts)} frame(s): at least 2 are needed (a still image goes in `images`)")
    seconds = float((end - begin) * time_base.numerator / time_base.denominator)
    if seconds <= 0:
        raise VideoError("the video's frames have no duration")
    # A file cut short (or a damaged stretch the demuxer skipped) still scans as a shorter video: refused rather
    # than decided on part of what the client sent.
    check_index(indexed, packets)
    if header_seconds is not None and header_seconds - seconds > max(0.05, 1.5 * seconds / len(pts)):
        raise VideoError(
            f"the file's frames end at {seconds:.2f} s of the {header_seconds:.2f} s its header gives "
            "(truncated or corrupt)"
        )
    return VideoHeader(fmt, codec, width, height, len(pts), seconds, tuple(sorted(pts)))


def _over_budget(decoded: int, through: int, limits: VideoLimits) -> str:
    return (
        f"decoding took over the {limits.max_decode_seconds:g} s this server gives a request's videos "
        f"(--video-decode-budget), at frame {decoded} of the {through} it must decode: a shorter, smaller or "
        "cheaper-to-decode clip fits"
    )


def check_index(indexed: int, packets: int) -> None:
    """An MP4 whose sample table lists more frames than its file holds was cut short (or lost a stretch): refused.
    The one check that sees a faststart MP4 (index first) with an audio track cut anywhere: its index is whole, and
    the header's length is no check with two streams (tests/test_video_server.py)."""
    if indexed and packets < indexed:
        raise VideoError(f"the file holds {packets} of the {indexed} frames its index lists (truncated or corrupt)")


def _too_long(seconds: float | None, limits: VideoLimits) -> str:
    """`seconds`: the length the header gives; None: the scan passed the limit (and stopped there)."""
    length = f"is {seconds:.1f} s long" if seconds is not None else f"is longer than {limits.max_seconds:g} s"
    return f"the video {length}: at most {limits.max_seconds:g} s per video (--max-video-seconds)"


@dataclass(frozen=True)
class PreparedVideo:
    """One video ready for the tower: its frame groups (each the tower's input as an image is), each group's time,
    and what decoding it cost."""

    groups: tuple[PreparedImage, ...]
    timestamps: tuple[float, ...]  # seconds, one a group
    seconds: float  # the clip's length
    decode_seconds: float  # scanning, decoding and preprocessing it

    @property
    def num_tokens(self) -> int:
        return sum(group.num_tokens for group in self.groups)


_ROTATIONS = {0: 0, 90: 1, 180: 2, 270: 3, -90: 3, -180: 2, -270: 1}  # degrees -> numpy rot90's k


def decode_video(
    data: bytes,
    header: VideoHeader,
    config: VideoProcessorConfig,
    limits: VideoLimits,
    deadline: float | None = None,
) -> PreparedVideo:
    """The sampled frames decoded, resized, normalised and grouped, as the reference processes the same file.
    `deadline` (time.perf_counter()'s clock): past it the decode stops, a 413 (the request's decode budget)."""
    import numpy as np
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as tvF

    started = time.perf_counter()
    indices = sample_indices(header.frames, header.fps, config)
    wanted = {header.pts[i]: position for position, i in enumerate(indices)}
    through = indices[-1] + 1  # frames decoded to reach the last sampled one
    if through * header.width * header.height > limits.max_decoded_pixels:
        raise VideoError(
            f"decoding the video means {through} frames of {header.width}x{header.height}: over this server's "
            f"decoding budget of {limits.max_decoded_pixels / 1e9:.1f} gigapixels per video",
            status=413,
        )
    mode = InterpolationMode.BICUBIC if config.resample == "bicubic" else InterpolationMode.BILINEAR
    frames: list[Tensor | None] = [None] * len(indices)
    to_rgb = _RGBConverter()
    target = first_shape = None
    decoded = 0
    with _open(data, header.format) as container:
        stream = container.streams.best("video")
        stream.thread_type = "AUTO"
        stream.codec_context.thread_count = limits.decode_threads
        try:
            for frame in container.decode(stream):
                decoded += 1
                if decoded > header.frames + 16:
                    raise VideoError("the video decodes to more frames than its packets (corrupt)")
                if deadline is not None and time.perf_counter() > deadline:
                    raise VideoError(_over_budget(decoded, through, limits), status=413)
                stamp = frame.pts if frame.pts is not None else frame.dts
                position = wanted.get(stamp)
                if position is None or frames[position] is not None:
                    continue
                k = _ROTATIONS.get(int(round(frame.rotation or 0)) % 360 if frame.rotation else 0)
                if k is None:
                    raise VideoError(f"a video rotated by {frame.rotation} degrees (only multiples of 90)")
                pixels = to_rgb(frame)
                if k:
                    pixels = np.rot90(pixels, k=k, axes=(0, 1))
                tensor = torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1)
                shape = tuple(tensor.shape[1:])
                if target is None:  # one size for the whole clip, from its first sampled frame (as the reference)
                    first_shape, target = shape, target_size(len(indices), shape[0], shape[1], config)
                elif shape != first_shape:
                    raise VideoError(f"the video's frames change size ({first_shape} to {shape}): unsupported")
                frames[position] = tvF.resize(tensor.unsqueeze(0), list(target), interpolation=mode, antialias=True)[0]
                if all(f is not None for f in frames):
                    break
        except VideoError:
            raise
        except _unreadable() as error:
            raise VideoError(f"the {header.format} file is corrupt ({_first_line(error)})") from error
    missing = [indices[p] for p, f in enumerate(frames) if f is None]
    if missing:
        raise VideoError(f"the video ended before frame {missing[0]} of {header.frames} (corrupt or truncated)")
    clip = torch.stack(frames)  # [T, 3, h, w] uint8
    groups = _groups(clip, config)
    stamps = timestamps(indices, header.fps, config.temporal_patch_size)
    return PreparedVideo(tuple(groups), tuple(stamps), header.seconds, time.perf_counter() - started)


class _RGBConverter:
    """Decoded frames -> [H, W, 3] uint8 RGB through an FFmpeg filter graph, buffer -> format=rgb24 -> buffersink,
    as torchcodec converts them for the reference (a filter graph where a width is not a multiple of 32, swscale
    with the frame's colour space where it is: both give this graph's pixels). Equal to torchcodec's on every pixel
    format we met (8, 10 and 12 bits; 4:2:0, 4:2:2, 4:4:0, 4:4:4; full range; BT.709; planar RGB), where PyAV's
    VideoFrame.reformat(rgb24, bicubic) differs by up to 42 levels on 10- and 12-bit 4:2:0 from h264 and hevc
    (tests/test_videos.py holds each format to torchcodec's frames). One graph a frame size and format, as
    torchcodec keeps its own."""

    def __init__(self) -> None:
        self._graph = None
        self._shape: tuple | None = None

    def __call__(self, frame) -> Any:
        import av

        shape = (frame.width, frame.height, frame.format.name)
        if shape != self._shape:
            graph = av.filter.Graph()
            source = graph.add_buffer(
                width=frame.width,
                height=frame.height,
                format=frame.format,
                time_base=frame.time_base or Fraction(1, 1000),  # the buffer's, unused by the conversion
            )
            convert, sink = graph.add("format", "rgb24"), graph.add("buffersink")
            source.link_to(convert)
            convert.link_to(sink)
            graph.configure()
            self._graph, self._shape = graph, shape
        self._graph.push(frame)
        return self._graph.pull().to_ndarray()


def _groups(clip: Tensor, config: VideoProcessorConfig) -> list[PreparedImage]:
    """[T, 3, h, w] uint8 -> one PreparedImage a group of `temporal_patch_size` frames (the last repeated to fill
    the last group), rows in the reference's patch order."""
    from torchvision.transforms.v2 import functional as tvF

    mean = torch.tensor(config.mean) * (1.0 / config.rescale_factor)
    std = torch.tensor(config.std) * (1.0 / config.rescale_factor)
    normalised = tvF.normalize(clip.to(torch.float32), mean.tolist(), std.tolist())  # fused rescale + normalise
    t, p, m = config.temporal_patch_size, config.patch_size, config.merge_size
    if pad := -normalised.shape[0] % t:
        normalised = torch.cat([normalised, normalised[-1:].expand(pad, -1, -1, -1)])
        clip = torch.cat([clip, clip[-1:].expand(pad, -1, -1, -1)])
    _, _, height, width = normalised.shape
    gh, gw = height // p, width // p
    settings = json.dumps([height, width, config.mean, config.std, config.rescale_factor, config.resample, p, m, t])
    groups = []
    for start in range(0, normalised.shape[0], t):
        frames = normalised[start : start + t]  # [t, 3, h, w]
        patches = frames.reshape(t, 3, gh // m, m, p, gw // m, m, p).permute(2, 5, 3, 6, 1, 0, 4, 7)
        rows = patches.reshape(gh * gw, 3 * t * p * p).contiguous()
        digest = hashlib.blake2b(("video " + settings).encode(), digest_size=16)
        digest.update(clip[start : start + t].contiguous().numpy().tobytes())
        groups.append(PreparedImage(rows, (gh, gw), digest.digest(), m))
    return groups


def load_videos(
    blobs: list[tuple[bytes, str | None]], config: VideoProcessorConfig, limits: VideoLimits
) -> list[PreparedVideo]:
    """A request's videos, collected within the byte limits (request_videos, clef_cuda.request.media): every one
    scanned first (so a bad second video costs no decoding of the first), then each decoded, all within the
    request's decode budget (limits.max_decode_seconds, from the first scan). VideoError names the video
    (1-based)."""
    budget = limits.max_decode_seconds
    deadline = time.perf_counter() + budget if budget is not None else None
    headers = []
    for number, (data, declared) in enumerate(blobs, start=1):
        try:
            headers.append(scan_video(data, limits, declared))
        except VideoError as error:
            raise VideoError(f"video {number}: {error}", error.status, ("videos", number - 1)) from error
    prepared = []
    for number, ((data, _), header) in enumerate(zip(blobs, headers, strict=True), start=1):
        try:
            prepared.append(decode_video(data, header, config, limits, deadline))
        except VideoError as error:
            raise VideoError(f"video {number}: {error}", error.status, ("videos", number - 1)) from error
    return prepared
