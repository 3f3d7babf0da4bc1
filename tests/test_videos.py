"""Videos in the state against Cloudflare's reference, which decodes them with torchcodec in a venv of its own
(tests/video_oracle.py; make test's set-up builds .venv-video-oracle): the processor's arithmetic, every frame of
clips in 15 pixel formats converted to torchcodec's RGB, then 52 random clips (every codec we take, under 4 frames'
worth to past 768 frames' worth at 2 fps, odd sizes, rotation metadata, variable frame rates, 10-bit hevc and av1,
full range, a video beside images) answered as the reference answers them, their ids, pixels, M-RoPE
positions and the tower's features equal to the reference's; faults parity catches; the wire forms, the Workers AI
route's codes, batch files, metrics and the caches; hostile files refused with a 4xx, fast and small, on a live
server."""

from __future__ import annotations

import base64
import io
import os
import random
from functools import cache

import clips
import numpy as np
import pytest
import torch
import video_oracle
from images import data_url, png
from parity import PARITY_BOUND, assert_response_matches
from random_requests import random_request
from releases import reference_model, tiny_release, vision_release

from clef_cuda import Decider
from clef_cuda.request import videos
from clef_cuda.request.videos import VideoLimits

LONG = VideoLimits(max_seconds=1000.0)  # the parity cases run past 768 frames' worth at 2 fps: 384 s and more
PARITY_CASES = 52


def ours_request(request: dict) -> dict:
    """The same request for us: each video's bytes as a data URL of its container."""
    return request | {"videos": [video_oracle.data_url(blob) for blob in request.get("videos", [])]}


# ---- the processor's arithmetic against transformers' -----------------------------------------------
@cache
def tiny_video_config():
    return videos.load_video_processor_config(tiny_release())


def test_sampling_timestamps_and_size_equal_the_reference_processor():
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize
    from transformers.video_utils import VideoMetadata

    config = tiny_video_config()
    processor = Qwen3VLVideoProcessor.from_pretrained(tiny_release())
    rng = random.Random(0)
    for _ in range(2000):
        frames = rng.choice([rng.randint(2, 12), rng.randint(2, 400), rng.randint(700, 4000)])
        fps = rng.choice([rng.uniform(0.5, 120.0), 2.0, 25.0, 29.97, 1000.0 / 33])
        want = processor.sample_frames(VideoMetadata(total_num_frames=frames, fps=fps), fps=config.fps).tolist()
        assert videos.sample_indices(frames, fps, config) == want, (frames, fps)
        stamps = Qwen3VLProcessor._calculate_timestamps(None, list(want), fps, config.temporal_patch_size)
        assert videos.timestamps(want, fps, config.temporal_patch_size) == pytest.approx(stamps, abs=1e-12)
        height, width = rng.randint(1, 3000), rng.randint(1, 3000)
        if max(height, width) / min(height, width) > 150 or len(want) < 2:
            continue
        expected = smart_resize(
            len(want), height, width, config.temporal_patch_size, config.factor, config.min_pixels, config.max_pixels
        )
        assert videos.target_size(len(want), height, width, config) == expected, (len(want), height, width)


# ---- 52 random clips against the reference ------------------------------------------------------------
def random_clip(rng: random.Random, index: int) -> tuple[str, bytes]:
    """(what it is, the clip): every codec, lengths from under 4 frames' worth to past 768 frames' worth at 2 fps
    (two long cases), odd sizes where the codec allows them, a display rotation (mp4), a variable frame rate, 10-bit
    hevc and av1, full range."""
    codec = clips.CODECS_IN_ORDER[index % len(clips.CODECS_IN_ORDER)]
    odd = codec in ("vp8", "vp9", "av1") and rng.random() < 0.6
    width, height = rng.randint(20, 220), rng.randint(20, 180)
    if codec in ("hevc", "av1"):  # x265 can corrupt its heap, SVT-AV1 hang, on a side under 64 pixels
        width, height = max(width, 64), max(height, 64)
    if not odd:
        width, height = width + width % 2, height + height % 2
    if index in (0, 1):  # past 768 frames' worth at 2 fps: 400 s at 2 fps, 425 s at 4 fps
        count, fps, width, height = (800, 2, 48, 32) if index == 0 else (1700, 4, 64, 80)
    elif rng.random() < 0.25:  # under 4 frames' worth (2 s): 2 to 7 frames at 25 fps
        count, fps = rng.randint(2, 7), 25
    else:
        count, fps = rng.randint(8, 150), rng.choice([5, 10, 24, 25, 30])
    times = None
    if count < 400 and rng.random() < 0.25:  # a variable frame rate: gaps of 20 ms to 400 ms
        times = list(np.cumsum([0.0] + [rng.uniform(0.02, 0.4) for _ in range(count - 1)]))
    rotation = rng.choice([None, None, 90, -90, 180]) if codec in ("h264", "hevc") else None
    # Pixel formats whose conversion to RGB differs by method (a 10-bit 4:2:0 one by up to 42 levels), chosen by
    # index so that the draws above stay what they were: five 10-bit hevc (one of them full range), five 10-bit av1,
    # five full-range h264.
    pix_fmt = "yuv420p10le" if index % 10 in (6, 9) else "yuv420p"
    full_range = index % 10 == 5 or index == 36
    what = f"{codec} {width}x{height} {count} frames at {'vfr' if times else fps} rotation {rotation} {pix_fmt}"
    what += " full range" if full_range else ""
    clip = clips.clip(
        codec,
        width,
        height,
        count,
        fps,
        seed=index,
        times=times,
        rotation=rotation,
        pix_fmt=pix_fmt,
        full_range=full_range,
    )
    return what, clip


# ---- every pixel format to RGB as torchcodec converts it ----------------------------------------------------
# (codec, pix_fmt, full range, BT.709): 8, 10 and 12 bits, 4:2:0 to 4:4:4, planar RGB, the range and the matrix.
PIXEL_FORMATS = [
    ("h264", "yuv420p", False, False),
    ("h264", "yuv420p", True, False),
    ("h264", "yuv420p", True, True),
    ("h264", "yuv420p10le", False, False),
    ("h264", "yuv422p", False, False),
    ("h264", "yuv444p", False, False),
    ("hevc", "yuv420p10le", False, False),
    ("hevc", "yuv420p10le", True, False),
    ("hevc", "yuv420p10le", False, True),
    ("hevc", "yuv420p12le", False, False),
    ("hevc", "yuv444p10le", False, False),
    ("hevc", "gbrp", False, False),
    ("vp9", "yuv444p", False, False),
    ("vp9", "yuv440p", False, False),
    ("av1", "yuv420p10le", False, False),
]
TORCHCODEC_FRAMES = """
import sys, numpy as np
from torchcodec.decoders import VideoDecoder
for path in sys.argv[1:]:
    decoder = VideoDecoder(path, seek_mode="exact", num_ffmpeg_threads=0, device="cpu", dimension_order="NHWC")
    np.save(path + ".npy", decoder.get_frames_at(indices=list(range(len(decoder)))).data.numpy())
"""


def test_every_pixel_format_converts_to_the_rgb_torchcodec_gives_the_reference(tmp_path):
    """Every frame of clips in 15 pixel formats, at two widths (torchcodec converts with swscale where the width is a
    multiple of 32, 128 here, and with a filter graph where it is not, 134), equal byte for byte to torchcodec's
    (run as the reference runs it, on PyAV's FFmpeg). VideoFrame.reformat(rgb24, bicubic) fails this on the 10- and
    12-bit 4:2:0 clips."""
    import subprocess

    import av

    paths = []
    for n, (codec, pix_fmt, full_range, bt709) in enumerate(PIXEL_FORMATS):
        for width in (128, 134):
            clip = clips.clip(codec, width, 72, 3, 10, seed=n, pix_fmt=pix_fmt, full_range=full_range, bt709=bt709)
            path = tmp_path / f"{codec}-{pix_fmt}-{int(full_range)}{int(bt709)}-{width}.{clips.CONTAINER[codec]}"
            path.write_bytes(clip)
            paths.append(path)
    done = subprocess.run(
        [str(video_oracle.ORACLE_VENV / "bin" / "python"), "-c", TORCHCODEC_FRAMES, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"LD_LIBRARY_PATH": video_oracle.ffmpeg_library_path()},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for path in paths:
        to_rgb = videos._RGBConverter()
        with av.open(str(path)) as container:
            ours = np.stack([to_rgb(frame) for frame in container.decode(video=0)])
        theirs = np.load(str(path) + ".npy")
        assert ours.shape == theirs.shape, (path.name, ours.shape, theirs.shape)
        worst = int(np.abs(ours.astype(int) - theirs.astype(int)).max())
        assert worst == 0, f"{path.name}: up to {worst} levels from torchcodec's RGB"


@pytest.fixture(scope="module")
def parity_run(tmp_path_factory):
    """The 52 requests, the reference's answers (and its processor's tensors, its positions) and our Decider."""
    rng = random.Random(62)
    cases = []
    for index in range(PARITY_CASES):
        what, clip = random_clip(rng, index)
        request = random_request(random.Random(1000 + index), state_words=(3, 25), max_choice=5)
        request["model"] = "clef-flash"
        request["videos"] = [clip]
        if index % 9 == 4:  # a video beside images
            request["images"] = [data_url(png(rng.randint(30, 160), rng.randint(30, 160), index))]
            what += " with an image"
        if index % 13 == 7:  # two videos
            request["videos"].append(clips.clip("vp9", 64, 48, 20, 10, seed=index + 500))
            what += " and a second video"
        cases.append((what, request))
    release = vision_release()
    workdir = tmp_path_factory.mktemp("oracle")
    answers = video_oracle.run(release, [request for _, request in cases], workdir, dump=True)
    decider = Decider.from_release(release, device="cpu", progress=False, chunk_size=512, video_limits=LONG)
    return cases, answers, decider, workdir


def _dump(parity_run, index: int) -> dict:
    _, _, _, workdir = parity_run
    return torch.load(workdir / "dump" / f"{index}.pt")


def rounding_apart(ours: float, unrounded: float) -> bool:
    """Whether `ours` (rounded to 4 decimals) may differ from the reference's rounding of `unrounded` only because
    the unrounded value sits within the parity bound of a rounding boundary."""
    boundary = (np.floor(unrounded * 1e4) + 0.5) / 1e4
    return abs(unrounded - boundary) <= PARITY_BOUND or abs(unrounded - (boundary - 1e-4)) <= PARITY_BOUND


def test_random_clips_answer_as_the_reference(parity_run):
    """Each of the 52: ids equal, unrounded within the fp32 bound, and after rounding identical (a rounded value may
    differ only where the reference's unrounded one lies within the bound of a rounding boundary)."""
    cases, answers, decider, _ = parity_run
    assert len(cases) >= 50
    identical = 0
    for (what, request), answer in zip(cases, answers, strict=True):
        assert "error" not in answer, (what, answer)
        ours = ours_request(request)
        response = decider.decide(ours)
        try:
            assert_response_matches(response, answer["response"], answer["unrounded"])
        except AssertionError as error:
            raise AssertionError(f"{what}: {error}") from None
        found = decider.prepare_videos(videos.request_videos(ours, LONG))
        images = decider.prepare_images([base64.b64decode(u.split(",", 1)[1]) for u in request.get("images", [])])
        assert list(decider.encode(ours, images, found).input_ids) == answer["input_ids"], what
        same = response["answers"] == answer["response"]["answers"]
        if not same:
            for qid, theirs in answer["response"]["answers"].items():
                for option, value in theirs.get("probabilities", {"true": theirs.get("noul")}).items():
                    have = response["answers"][qid].get("probabilities", {"true": response["answers"][qid].get("noul")})
                    if have[option] != value:
                        assert rounding_apart(have[option], answer["unrounded"][qid][option]), (what, qid, option)
        identical += same
    print(f"\n{identical} of {len(cases)} clip requests rounded identical to the reference")


def test_long_and_short_clips_are_sampled_as_the_reference_samples_them(parity_run):
    """The two long cases sample 768 frames (384 groups), a clip under 4 frames' worth all of its frames."""
    cases, _, _, _ = parity_run
    grids = {index: _dump(parity_run, index)["video_grid_thw"] for index in range(len(cases))}
    assert int(grids[0][0, 0]) * 2 == 768 and int(grids[1][0, 0]) * 2 == 768
    short = [i for i, (what, _) in enumerate(cases) if " at 25 " in what and int(what.split()[2]) < 8]
    assert short, "no clip under 4 frames' worth"
    for index in short:
        frames = int(cases[index][0].split()[2])
        assert int(grids[index][0, 0]) == -(-min(4, frames) // 2)  # all of them, or 4 spread over them


def test_pixels_positions_and_the_towers_features_equal_the_reference(parity_run):
    """pixel_values_videos bit for bit, the M-RoPE positions of get_rope_index with video grids, and the tower's
    features against transformers' get_video_features, on every case."""
    cases, _, decider, _ = parity_run
    _, model, _ = reference_model(vision_release())
    for index, (what, request) in enumerate(cases):
        dumped = _dump(parity_run, index)
        ours = ours_request(request)
        found = decider.prepare_videos(videos.request_videos(ours, LONG))
        groups = [group for clip in found for group in clip.groups]
        rows = torch.cat([group.pixel_values for group in groups])
        assert torch.equal(rows, dumped["pixel_values_videos"]), what
        grids = torch.tensor([[len(clip.groups), *clip.groups[0].grid] for clip in found])
        assert torch.equal(grids, dumped["video_grid_thw"]), what
        images = decider.prepare_images([base64.b64decode(u.split(",", 1)[1]) for u in request.get("images", [])])
        record = decider.encode(ours, images, found)
        assert torch.equal(record.rope_positions(), dumped["positions"]), what
        if index % 4:
            continue  # the tower on every fourth case: 13 of them, the two long ones included
        with torch.inference_mode():
            expected = torch.cat(
                model.language_model.model.get_video_features(dumped["pixel_values_videos"], grids).pooler_output
            )
        got = torch.cat(decider.image_features(groups))
        assert got.shape == expected.shape and (got - expected).abs().max() < 1e-6, what


@pytest.mark.parametrize("fault", ["rotation the other way", "timestamps half a second late", "groups out of order"])
def test_parity_catches_a_fault_on_every_case_it_touches(parity_run, monkeypatch, fault):
    """Each fault fails the parity checks above (the answers, the ids, the pixels bit for bit) on every case it
    touches, not on one of them: the rotated clips for the rotation, clips 2 to 7 (each of several frame groups) for
    the others. (A frame late, 1/30 s, was the fault once: the prompt writes times to 0.1 s, so on some clips it
    changed nothing a check could see, and parity was required on one case only.)"""
    cases, answers, decider, _ = parity_run
    if fault == "rotation the other way":
        monkeypatch.setattr(videos, "_ROTATIONS", {0: 0, 90: 3, 180: 2, 270: 1, -90: 1, -180: 2, -270: 3})
        touched = [i for i, (what, _) in enumerate(cases) if "rotation 90" in what or "rotation -90" in what]
    elif fault == "timestamps half a second late":
        real = videos.timestamps
        monkeypatch.setattr(videos, "timestamps", lambda indices, fps, t: [s + 0.5 for s in real(indices, fps, t)])
        touched = list(range(2, 8))
    else:
        real_groups = videos._groups
        monkeypatch.setattr(videos, "_groups", lambda clip, config: real_groups(clip, config)[::-1])
        touched = list(range(2, 8))
    assert touched
    missed = [cases[index][0] for index in touched if not _parity_fails(parity_run, index)]
    assert not missed, f"{fault}: parity missed it on {len(missed)} of the {len(touched)} cases it touches: {missed}"


def _parity_fails(parity_run, index: int) -> bool:
    """Whether any parity check of the tests above fails on case `index`: the answers, the ids, the pixels."""
    cases, answers, decider, _ = parity_run
    _, request = cases[index]
    try:
        assert_response_matches(decider.decide(ours_request(request)), *_answer(answers[index]))
        assert_ids(decider, request, answers[index])
        found = decider.prepare_videos(videos.request_videos(ours_request(request), LONG))
        rows = torch.cat([group.pixel_values for clip in found for group in clip.groups])
        assert torch.equal(rows, _dump(parity_run, index)["pixel_values_videos"])
    except AssertionError:
        return True
    return False


def _answer(answer: dict) -> tuple[dict, dict]:
    return answer["response"], answer["unrounded"]


def assert_ids(decider: Decider, request: dict, answer: dict) -> None:
    ours = ours_request(request)
    found = decider.prepare_videos(videos.request_videos(ours, LONG))
    images = decider.prepare_images([base64.b64decode(u.split(",", 1)[1]) for u in request.get("images", [])])
    assert list(decider.encode(ours, images, found).input_ids) == answer["input_ids"]


def test_rotations_turn_the_frames_as_the_reference_does(parity_run):
    """Every rotation among the cases appeared (90, -90, 180): a wrong turn shows in the pixels (the test above)."""
    cases, _, _, _ = parity_run
    seen = {what.split("rotation ")[1].split()[0] for what, _ in cases}
    assert {"90", "-90", "180", "None"} <= seen, seen
    assert any("vfr" in what for what, _ in cases) and any("with an image" in what for what, _ in cases)
    assert {what.split()[0] for what, _ in cases} == set(clips.CODECS_IN_ORDER)


def test_the_cases_hold_10_bit_and_full_range_clips(parity_run):
    """The clips said to be 10-bit hevc, 10-bit av1 and full range decode as such (an encoder that quietly made
    8-bit limited-range clips would leave the parity above unproven on them)."""
    import av

    cases, _, _, _ = parity_run
    seen = set()
    for what, request in cases:
        with av.open(io.BytesIO(request["videos"][0])) as container:
            frame = next(container.decode(video=0))
        bits = "10-bit" if frame.format.name.endswith("p10le") else "8-bit"
        assert (bits == "10-bit") == ("yuv420p10le" in what), (what, frame.format.name)
        assert (frame.color_range == 2) == ("full range" in what), (what, frame.color_range)
        seen.add((what.split()[0], bits, "full" if frame.color_range == 2 else "limited"))
    assert {("hevc", "10-bit", "limited"), ("hevc", "10-bit", "full"), ("av1", "10-bit", "limited")} <= seen, seen
    assert ("h264", "8-bit", "full") in seen, seen
