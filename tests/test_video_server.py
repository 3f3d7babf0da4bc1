"""Videos over HTTP: every wire form (a data URL, a {content_type, base64} object, plain base64, an asset with a
placeholder, a multipart upload) answers as the reference does for the same clip; the Workers AI route, batch files,
metrics, the prefix and vision caches and the shadow's verification take video records; every hostile file is a
4xx with the contract's body, and on a live server within 5 s and 512 MiB, nothing decoded before the cheap limits
pass, the server answering normally afterwards."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import time

import clips
import httpx
import pytest
import video_oracle
from fastapi.testclient import TestClient
from images import png
from parity import assert_answers_match
from prometheus_client.parser import text_string_to_metric_families
from releases import tiny_release
from test_vision_server import assert_422, multipart

from app import batch
from app.server import ServerSettings, create_app
from clef_cuda import Decider
from clef_cuda.request import videos
from clef_cuda.request.videos import VideoError, VideoLimits
from clef_cuda.serving.engine import Engine, EngineConfig, QueueFullError
from clef_cuda.verification.shadow import ShadowConfig

QUESTIONS = {
    "fell": {"type": "noul", "instructions": "Does someone fall in the clip?"},
    "where": {"type": "choice", "criteria": {"aisle": "A shop aisle", "stairs": None, "yard": "Outdoors"}},
}
CLIP = clips.clip("h264", 96, 64, 30, 10, seed=3)
FASTSTART_WITH_AUDIO = clips.faststart_with_audio()  # 50 frames, 2 s, AAC beside it, its index first
OTHER = clips.clip("vp9", 80, 48, 24, 12, seed=4)


def body(**extra) -> dict:
    return {
        "model": "clef-flash",
        "state": "Camera 4, 14:02. Review the attached clip.",
        "questions": QUESTIONS,
    } | extra


def b64(blob: bytes) -> str:
    return base64.b64encode(blob).decode()


@pytest.fixture(scope="module")
def decider():
    return Decider.from_release(tiny_release(), device="cpu", progress=False)


def engine_of(decider, **config) -> Engine:
    return Engine(decider, EngineConfig(**({"max_model_len": 4096, "kv_fraction": 0.02} | config)))


@pytest.fixture(scope="module")
def client(decider):
    with TestClient(create_app(ServerSettings(), engine=engine_of(decider))) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The reference's answers to the requests these tests send, by name (one oracle run)."""
    requests = {
        "clip": body(videos=[CLIP]),
        "clip placed": body(state={"note": "Camera 4", "clip": "[video 1]"}, videos=[CLIP]),
        "clip and image": body(videos=[CLIP], images=[video_oracle_image()]),
        "two clips": body(videos=[CLIP, OTHER]),
    }
    answers = video_oracle.run(tiny_release(), list(requests.values()), tmp_path_factory.mktemp("oracle"))
    return dict(zip(requests, answers, strict=True))


def video_oracle_image() -> str:
    return "data:image/png;base64," + b64(png(120, 90, 5))


def assert_as_the_reference(response, answer) -> None:
    assert response.status_code == 200, response.text
    assert "error" not in answer, answer
    assert_answers_match(response.json()["answers"], answer["response"]["answers"], answer["unrounded"])
    assert response.json()["usage"] == answer["response"]["usage"]


# ---- the wire forms ---------------------------------------------------------------------------------
def test_every_wire_form_answers_as_the_reference(client, reference):
    forms = {
        "data url": body(videos=[video_oracle.data_url(CLIP)]),
        "upper-case data url": body(videos=[video_oracle.data_url(CLIP).replace("data:video/mp4", "DATA:video/MP4")]),
        "object": body(videos=[{"content_type": "video/mp4", "base64": b64(CLIP)}]),
        "plain base64": body(videos=[b64(CLIP)]),
    }
    answers = {}
    for name, request in forms.items():
        response = client.post("/v1/systemone", json=request)
        assert_as_the_reference(response, reference["clip"])
        answers[name] = response.json()["answers"]
    assert len({json.dumps(a, sort_keys=True) for a in answers.values()}) == 1


def test_an_asset_and_a_multipart_upload_are_placed_where_the_state_says(client, reference):
    asset = {"type": "video", "format": "mp4", "data_base64": b64(CLIP)}
    request = body(state={"note": "Camera 4", "clip": "cam-4"}, assets={"cam-4": asset})
    assert_as_the_reference(client.post("/v1/systemone", json=request), reference["clip placed"])
    uploaded = body(state={"note": "Camera 4", "clip": "cam-4"}, assets={"cam-4": {"type": "video", "part": "a0"}})
    content, content_type = multipart(json.dumps(uploaded).encode(), {"a0": CLIP})
    response = client.post("/v1/systemone", content=content, headers={"Content-Type": content_type})
    assert_as_the_reference(response, reference["clip placed"])


def test_a_video_beside_an_image_and_two_videos(client, reference):
    with_image = body(videos=[video_oracle.data_url(CLIP)], images=[video_oracle_image()])
    assert_as_the_reference(client.post("/v1/systemone", json=with_image), reference["clip and image"])
    two = body(videos=[video_oracle.data_url(CLIP), video_oracle.data_url(OTHER)])
    assert_as_the_reference(client.post("/v1/systemone", json=two), reference["two clips"])


def test_the_workers_ai_route_takes_videos_and_gives_its_codes(client, reference):
    route = "/client/v4/accounts/acct/ai/run/@cf/cloudflare/clef-flash"
    hosted = {k: v for k, v in body(videos=[video_oracle.data_url(CLIP)]).items() if k != "model"}
    response = client.post(route, json=hosted)
    assert response.status_code == 200, response.text
    result = response.json()["result"]
    assert_answers_match(
        {q: a for q, a in result["answers"].items() if a["type"] == "noul"},
        {q: a for q, a in reference["clip"]["response"]["answers"].items() if a["type"] == "noul"},
        reference["clip"]["unrounded"],
    )
    too_big = client.post(route, json=hosted | {"videos": [b64(CLIP + bytes(17 * 2**20))]})
    assert too_big.status_code == 413 and too_big.json()["errors"][0]["code"] == 5021, too_big.text
    bad = client.post(route, json=hosted | {"videos": [b64(clips.audio_only())]})
    assert bad.status_code == 422 and bad.json()["errors"][0]["code"] == 5012, bad.text
    assert "video stream" in bad.json()["errors"][0]["message"]


def test_batch_rows_with_videos(decider, reference, tmp_path):
    rows = [body(videos=[video_oracle.data_url(CLIP)]), body(videos=[b64(png(30, 30))])]
    source, sink = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    app = create_app(ServerSettings(), engine=engine_of(decider))
    summary = asyncio.run(batch.run(app, source, sink, 4, 16, progress=False))
    out = [json.loads(line) for line in sink.read_text().splitlines()]
    assert (summary.ok, summary.refused) == (1, 1), out
    answer = reference["clip"]
    assert_answers_match(out[0]["response"]["body"]["answers"], answer["response"]["answers"], answer["unrounded"])
    assert out[1]["response"]["status_code"] == 422 and "image sent as a video" in out[1]["error"]["message"]


# ---- metrics, caches, the shadow ------------------------------------------------------------------------
def metric(client, name: str) -> float:
    text = client.get("/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_metrics_caches_and_the_shadow_cover_video_records(decider):
    """A repeated clip: its prefix restored past the clip (no vision-cache lookup, the tower not run); the same clip
    under another state: every frame pair from the vision cache; every record checked by the shadow (rate 1, which
    re-runs the tower itself) and matching."""
    from live import wait_until

    engine = engine_of(decider, min_snapshot_tokens=32, shadow=ShadowConfig(rate=1.0))
    state = " ".join(f"camera line {i}: aisle 4 quiet" for i in range(60))
    groups = len(decider.prepare_videos([(CLIP, None)])[0].groups)
    with TestClient(create_app(ServerSettings(), engine=engine)) as c:
        wait_until(lambda: c.get("/ready").status_code == 200, "the warm-up")
        cache = engine.vision_cache
        misses, hits = cache.misses, cache.hits
        first = c.post("/v1/systemone", json=body(state=state, videos=[b64(CLIP)])).json()
        assert (cache.misses - misses, cache.hits - hits) == (groups, 0)  # the tower ran once a pair
        again = c.post("/v1/systemone", json=body(state=state, videos=[b64(CLIP)])).json()
        assert again["x_cached_tokens"] > 0 and again["answers"] == first["answers"]
        assert (cache.misses - misses, cache.hits - hits) == (groups, 0)  # restored past the clip
        other = c.post("/v1/systemone", json=body(state="another camera", videos=[b64(CLIP)])).json()
        assert other["x_cached_tokens"] == 0
        assert (cache.misses - misses, cache.hits - hits) == (groups, groups)  # each pair from the cache
        assert metric(c, "clef_videos_total") == 3
        assert metric(c, "clef_video_seconds_total") == pytest.approx(3 * 3.0, rel=1e-6)  # 30 frames at 10 fps
        assert metric(c, "clef_video_decode_seconds_total") > 0
        wait_until(lambda: engine.shadow.stats.match >= 4, "the shadow's verdicts on the warm-up and the three")
        stats = engine.shadow.stats
        assert stats.mismatch == 0 and stats.marginal == 0, stats


# ---- refusals ------------------------------------------------------------------------------------------
def hostile_files() -> dict[str, tuple[object, int, list, str]]:
    """name -> (the `videos` entry, status, loc prefix (422), words in the message)."""
    truncated_webm = clips.clip("vp9", 96, 64, 60, 25)
    corrupt = bytearray(CLIP)
    rng = random.Random(1)
    for i in range(len(corrupt) // 4, len(corrupt) * 3 // 4, 50):
        corrupt[i] = rng.randrange(256)
    return {
        "a huge frame size": (b64(clips.clip("h264", 7680, 4320, 2, 1, flat=True)), 413, [], "megapixels"),
        "a huge frame count in a tiny file": (
            b64(clips.clip("h264", 16, 16, 15000, 250, flat=True)),
            413,
            [],
            "frames",
        ),
        "a huge duration in a tiny file": (
            b64(clips.clip("h264", 32, 32, 3, 10, times=[0.0, 0.1, 5000.0], flat=True)),
            413,
            [],
            "5000.1 s long",
        ),
        "a 600 s webm whose header gives no length": (
            b64(clips.clip("vp9", 16, 16, 1200, 2, flat=True, live=True)),
            413,
            [],
            "longer than 60 s",
        ),
        "a corrupt stream": (b64(bytes(corrupt)), 422, ["body", "videos", 0], "corrupt"),
        "a truncated webm": (b64(truncated_webm[: len(truncated_webm) * 6 // 10]), 422, ["body", "videos", 0], "trunc"),
        "a truncated mp4": (b64(CLIP[: len(CLIP) // 2]), 422, ["body", "videos", 0], "could not be opened"),
        "a faststart mp4 with audio, cut at 60%": (
            b64(FASTSTART_WITH_AUDIO[: len(FASTSTART_WITH_AUDIO) * 6 // 10]),
            422,
            ["body", "videos", 0],
            "holds 29 of the 50 frames its index lists",
        ),
        "a container that lies about its codec": (
            b64(CLIP.replace(b"avc1", b"hvc1")),
            422,
            ["body", "videos", 0],
            "corrupt",
        ),
        "an audio-only file": (b64(clips.audio_only()), 422, ["body", "videos", 0], "no video stream"),
        "a still image as a video": (b64(png(40, 30)), 422, ["body", "videos", 0], "image sent as a video"),
        "a one-frame video": (b64(clips.clip("h264", 32, 32, 1, 10)), 422, ["body", "videos", 0], "at least 2"),
        "webm declared, mp4 sent": (
            "data:video/webm;base64," + b64(CLIP),
            422,
            ["body", "videos", 0],
            "declared video/webm",
        ),
        "an image content type": (
            {"content_type": "image/png", "base64": b64(CLIP)},
            422,
            ["body", "videos", 0],
            "not video/mp4",
        ),
        "a url": ("https://example.com/clip.mp4", 422, ["body", "videos", 0], "never fetched"),
        "a path": ("/etc/passwd", 422, ["body", "videos", 0], "never fetched"),
        "not base64": ("@@@@", 422, ["body", "videos", 0], "base64"),
        "random bytes": (b64(random.Random(2).randbytes(5000)), 422, ["body", "videos", 0], "not an MP4 or WebM"),
        "17 MiB": (b64(CLIP + bytes(17 * 2**20)), 413, [], "16 MiB"),
    }


@pytest.mark.parametrize("case", sorted(hostile_files()))
def test_each_hostile_file_is_a_4xx_naming_the_video(client, case):
    entry, status, loc, words = hostile_files()[case]
    response = client.post("/v1/systemone", json=body(videos=[entry]))
    if status == 422:
        assert_422(response, loc, words)
    else:
        assert response.status_code == 413, response.text
        assert words in response.json()["detail"]["message"] and "video" in response.json()["detail"]["message"]


def test_counts_and_the_models_without_a_tower(client):
    assert_422(client.post("/v1/systemone", json=body(videos=[b64(CLIP)] * 3)), ["body", "videos"], "at most 2")
    assert_422(client.post("/v1/systemone", json=body(videos="x")), ["body", "videos"], "")
    from clef_cuda.model.default_model import default_release

    text_only = Engine(Decider.from_release(default_release(), device="cpu", progress=False), EngineConfig())
    with TestClient(create_app(ServerSettings(), engine=text_only)) as c:
        response = c.post("/v1/systemone", json=body(videos=[b64(CLIP)]))
        assert_422(response, ["body", "videos"], "does not accept videos")


def test_a_cut_faststart_mp4_with_audio_is_refused_by_the_index_check_alone(monkeypatch):
    """The index check is what refuses it: with the check switched off the same bytes scan and decode (as a clip of
    1.16 s of the 2 s the client sent), so no other check stands behind it; the whole file decodes either way."""
    config = videos.load_video_processor_config(tiny_release())
    cut = FASTSTART_WITH_AUDIO[: len(FASTSTART_WITH_AUDIO) * 6 // 10]
    with pytest.raises(VideoError, match="holds 29 of the 50 frames its index lists"):
        videos.load_videos([(cut, "mp4")], config, VideoLimits())
    monkeypatch.setattr(videos, "check_index", lambda indexed, packets: None)
    (short,) = videos.load_videos([(cut, "mp4")], config, VideoLimits())
    (whole,) = videos.load_videos([(FASTSTART_WITH_AUDIO, "mp4")], config, VideoLimits())
    assert short.seconds < 0.7 * whole.seconds


def test_limits_are_checked_before_decoding(monkeypatch):
    """The count, the bytes, the header's size and duration and the scan's frame count all refuse before a frame is
    decoded; the decoding budget (frames to decode x their pixels) too."""

    def never(*args, **kwargs):
        raise AssertionError("decoded")

    config = videos.load_video_processor_config(tiny_release())
    monkeypatch.setattr(videos, "decode_video", never)
    for name in ("a huge frame size", "a huge frame count in a tiny file", "a huge duration in a tiny file"):
        entry = hostile_files()[name][0]
        with pytest.raises(VideoError) as refused:
            videos.load_videos([(base64.b64decode(entry), None)], config, VideoLimits())
        assert refused.value.status == 413, name
    monkeypatch.undo()
    tight = VideoLimits(max_decoded_pixels=96 * 64 * 20)  # 20 frames of CLIP's 30
    header = videos.scan_video(CLIP, tight)
    with pytest.raises(VideoError, match="decoding budget") as refused:
        videos.decode_video(CLIP, header, config, tight)
    assert refused.value.status == 413


@pytest.mark.parametrize("seconds, live", [(70, False), (470, False), (600, True)])
def test_the_scan_refuses_a_clip_over_the_length_limit_that_its_header_lets_by(seconds, live):
    """The header check refuses a clip whose header gives over 8 x --max-video-seconds; one it lets by (70 s and
    470 s with their true length in the header, 600 s in a WebM whose header gives none) is refused by the packet
    scan, a 413 saying the clip is over the limit (not the length where the scan stopped)."""
    import av

    blob = clips.clip("vp9" if live else "h264", 16, 16, seconds * 2, 2, flat=True, live=live)
    with av.open(io.BytesIO(blob)) as container:
        header = container.duration / 1e6 if container.duration is not None else None
    assert header is None if live else header == pytest.approx(seconds, abs=1)
    with pytest.raises(VideoError) as refused:
        videos.scan_video(blob, VideoLimits())
    assert refused.value.status == 413
    assert str(refused.value).startswith("the video is longer than 60 s: at most 60 s per video"), refused.value
    half = seconds / 2  # a limit the header check lets by too (it refuses past 8 times the limit)
    with pytest.raises(VideoError, match=f"longer than {half:g} s: at most {half:g} s"):
        videos.scan_video(blob, VideoLimits(max_seconds=half))
    assert videos.scan_video(blob, VideoLimits(max_seconds=seconds + 1)).seconds == pytest.approx(seconds)


def test_the_video_limit_flags_reach_the_deciders_limits():
    """--max-videos, --max-video-mib and --max-video-seconds, parsed by clef-serve's parser (and clef-serve
    batch's), are the limits of the decider make_decider builds; their defaults are VideoLimits' (clef-omni's)."""
    from app.cli.batch import build_batch_parser
    from app.cli.engine import make_decider
    from app.cli.flags import build_parser

    defaults = build_parser().parse_args([])
    limits = VideoLimits()
    assert (limits.max_videos, limits.max_bytes, limits.max_seconds) == (
        defaults.max_videos,
        defaults.max_video_mib * 2**20,
        defaults.max_video_seconds,
    )
    flags = ["--max-videos", "3", "--max-video-mib", "5", "--max-video-seconds", "12.5"]
    batch_args = build_batch_parser().parse_args(["in.jsonl", "out.jsonl", *flags])
    assert (batch_args.max_videos, batch_args.max_video_mib, batch_args.max_video_seconds) == (3, 5, 12.5)
    args = build_parser().parse_args(["--w", str(tiny_release()), "--d", "cpu", *flags])
    limits = make_decider(args).options.video_limits
    assert (limits.max_videos, limits.max_bytes, limits.max_seconds) == (3, 5 * 2**20, 12.5)
    with pytest.raises(VideoError, match="at most 3 videos per request"):
        limits.check_count(4)
    with pytest.raises(VideoError, match="at most 5 MiB per video") as refused:
        limits.check_size(5 * 2**20 + 1)
    assert refused.value.status == 413
    with pytest.raises(VideoError, match="longer than 12.5 s"):
        videos.scan_video(clips.clip("h264", 16, 16, 30, 2, flat=True), limits)  # 15 s


def test_hostile_files_on_a_live_server_are_fast_small_and_harmless():
    """clef-serve on a release with a tower: each hostile file a 4xx within 5 s, the server's resident memory never
    more than 512 MiB above its level before (sampled every 10 ms), and a real clip answered afterwards. A 4K clip
    (inside the limits) is decoded frame by frame: answered, within the same memory."""
    import psutil
    from live import clef_serve_process, resident_growth

    cases = hostile_files() | {
        "a 4K clip, 40 frames": (b64(clips.clip("h264", 3840, 2160, 40, 8, flat=True)), 200, [], "")
    }
    with clef_serve_process("--w", str(tiny_release()), "--d", "cpu", "--kv-fraction", "0.05") as (url, process, _):
        assert httpx.post(url + "/v1/systemone", json=body(videos=[b64(CLIP)]), timeout=60).status_code == 200
        server = psutil.Process(process.pid)
        for name, (entry, status, _, _) in cases.items():
            with resident_growth(server) as grown:
                started = time.monotonic()
                response = httpx.post(url + "/v1/systemone", json=body(videos=[entry]), timeout=60)
                took = time.monotonic() - started
            growth = grown[0]
            print(f"{name}: {response.status_code} in {took:.2f} s, +{growth:.0f} MiB")
            assert response.status_code == status, (name, response.text)
            assert took < 5.0, (name, took)
            assert growth < 512, (name, growth)
        after = httpx.post(url + "/v1/systemone", json=body(videos=[b64(CLIP)]), timeout=60)
        assert after.status_code == 200 and httpx.get(url + "/ready").status_code == 200


def test_frame_pairs_share_tower_calls_within_the_plans_budget(decider):
    """The engine sends a clip's pairs to the tower together, in runs no larger than the largest input the plan
    sizes the tower's step for (the memory plan holds); an input larger than a run goes alone."""
    from clef_cuda.serving.engine import _tower_batches

    (video,) = decider.prepare_videos([(CLIP, None)])
    pairs = [(group.digest, group) for group in video.groups]
    size = pairs[0][1].grid[0] * pairs[0][1].grid[1]
    assert decider.tower_patches >= len(pairs) * size
    assert _tower_batches(pairs, decider.tower_patches) == [pairs]
    assert [len(b) for b in _tower_batches(pairs, 2 * size)] == [2] * (len(pairs) // 2) + [1] * (len(pairs) % 2)
    assert [len(b) for b in _tower_batches(pairs, size - 1)] == [1] * len(pairs)


def test_an_error_ffmpeg_raises_while_decoding_is_a_422_naming_the_video(client, monkeypatch):
    """FFmpeg's errors met while decoding (here an InvalidDataError from the RGB conversion of a frame, inside the
    decode loop) are the client's file's fault: a 422 naming the video."""
    import av

    def unreadable(self, frame):
        raise av.error.InvalidDataError(1094995529, "Invalid data found when processing input")

    monkeypatch.setattr(videos._RGBConverter, "__call__", unreadable)
    assert_422(client.post("/v1/systemone", json=body(videos=[b64(CLIP)])), ["body", "videos", 0], "corrupt")


@pytest.mark.parametrize("fault", [ValueError("our resize's fault"), OSError("our own I/O's fault")])
def test_a_fault_of_ours_while_decoding_is_a_500_with_a_log_line_not_a_422(client, monkeypatch, caplog, fault):
    """A ValueError or OSError raised by our own code inside the decode loop (here the clip's target size) is not the
    client's 'corrupt' file (every ValueError and OSError was, once): a 500 internal_error, its traceback logged."""

    def ours(*args, **kwargs):
        raise fault

    monkeypatch.setattr(videos, "target_size", ours)
    with caplog.at_level("ERROR"):
        response = client.post("/v1/systemone", json=body(videos=[b64(CLIP)]))
    assert response.status_code == 500, response.text
    assert response.json()["detail"]["error_type"] == "internal_error"
    logged = [r for r in caplog.records if r.levelname == "ERROR" and r.exc_info and r.exc_info[1] is fault]
    assert logged and "POST /v1/systemone failed" in logged[0].getMessage(), [r.getMessage() for r in caplog.records]


# ---- the decode's cost bounded: the request's budget, admission before decoding, slots server-wide ---------------
def test_a_request_the_queue_would_refuse_gets_its_503_before_any_decoding(decider, monkeypatch):
    """The queue full (its one place taken): a request with a clip is refused 503 overloaded without a frame scanned
    or decoded (it was decoded first, then refused at submission); once the queue moves the same request answers."""
    from live import GatedEngine

    engine = GatedEngine(decider, EngineConfig(max_model_len=4096, kv_fraction=0.02, max_queue=1))
    decoded = []
    real_scan = videos.scan_video
    monkeypatch.setattr(videos, "scan_video", lambda *a, **k: decoded.append(1) or real_scan(*a, **k))
    with TestClient(create_app(ServerSettings(), engine=engine, warm_up=False)) as c:
        first = engine.submit({"model": "clef-flash", "state": "x", "questions": QUESTIONS})
        refused = c.post("/v1/systemone", json=body(videos=[b64(CLIP)]))
        assert refused.status_code == 503 and refused.json()["detail"]["error_type"] == "overloaded_error"
        assert decoded == [], "decoded before the queue refused it"
        engine.gate.set()
        first.future.result(60)
        assert c.post("/v1/systemone", json=body(videos=[b64(CLIP)])).status_code == 200 and decoded == [1]


def test_admissions_hold_their_queue_places_until_submitted_or_given_back(decider):
    engine = engine_of(decider, max_queue=2)
    with engine.admit() as one, engine.admit():
        with pytest.raises(QueueFullError):
            engine.admit()  # both places held while their requests decode
        with pytest.raises(QueueFullError):
            engine.submit({"model": "clef-flash", "state": "x", "questions": QUESTIONS})
        ticket = engine.submit({"model": "clef-flash", "state": "x", "questions": QUESTIONS}, admission=one)
        assert engine.queue_depth == 1 and not one.held
    with engine.admit():  # the second's place came back when its block was left
        pass
    engine.cancel(ticket)


def test_at_most_max_video_decodes_requests_decode_at_once_and_text_passes_them_by(decider, monkeypatch):
    """--max-video-decodes 1: three requests with a slow clip (each decode held 0.5 s) decode one at a time, and a
    request without videos sent after them is answered before the last of them; all answered."""
    real, active, most = videos.decode_video, [0], [0]

    def slow(*args, **kwargs):
        active[0] += 1
        most[0] = max(most[0], active[0])
        try:
            time.sleep(0.5)
            return real(*args, **kwargs)
        finally:
            active[0] -= 1

    monkeypatch.setattr(videos, "decode_video", slow)
    app = create_app(ServerSettings(max_video_decodes=1), engine=engine_of(decider))
    finished: list[str] = []

    async def send(client, name, payload):
        response = await client.post("/v1/systemone", json=payload)
        finished.append(name)
        return response.status_code

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            clipped = [asyncio.create_task(send(client, f"video {i}", body(videos=[b64(CLIP)]))) for i in range(3)]
            await asyncio.sleep(0.1)
            text = asyncio.create_task(send(client, "text", body()))
            return await asyncio.gather(*clipped, text)

    with TestClient(app):
        statuses = asyncio.run(run())
    assert statuses == [200] * 4 and most[0] == 1, (statuses, most)
    assert finished.index("text") < finished.index("video 2"), finished


def test_a_requests_videos_share_its_decode_budget(monkeypatch):
    """The budget is the request's, from its first scan: on a clock that ticks once a read, a budget one clip fits in
    refuses the same clip sent twice (a 413 naming --video-decode-budget); none: both decoded."""
    config = videos.load_video_processor_config(tiny_release())
    ticks = [0.0]

    def clock():
        ticks[0] += 1.0
        return ticks[0]

    monkeypatch.setattr(videos.time, "perf_counter", clock)
    videos.load_videos([(CLIP, None)], config, VideoLimits(max_decode_seconds=1e9))
    one_clip = ticks[0]  # the reads one clip's scan and decode make, its budget checks included
    ticks[0] = 0.0
    videos.load_videos([(CLIP, None)], config, VideoLimits(max_decode_seconds=one_clip))
    with pytest.raises(VideoError, match=r"video 2: decoding took over the .* \(--video-decode-budget\)") as refused:
        videos.load_videos([(CLIP, None), (CLIP, None)], config, VideoLimits(max_decode_seconds=one_clip))
    assert refused.value.status == 413
    assert len(videos.load_videos([(CLIP, None)] * 2, config, VideoLimits(max_decode_seconds=None))) == 2


def test_the_decode_budget_and_slots_flags_reach_the_server():
    """--video-decode-budget (default 4 s, 'off' for none) is the decider's VideoLimits.max_decode_seconds,
    --max-video-decodes the server's slots, and each decode's FFmpeg threads a slot's share of the cores."""
    from app.cli.engine import make_decider, server_settings
    from app.cli.flags import build_parser
    from app.context import usable_cores

    defaults = build_parser().parse_args([])
    assert defaults.video_decode_budget == VideoLimits().max_decode_seconds == 3.5
    release = ["--w", str(tiny_release()), "--d", "cpu"]
    args = build_parser().parse_args([*release, "--video-decode-budget", "2.5s", "--max-video-decodes", "3"])
    limits = make_decider(args).options.video_limits
    assert (limits.max_decode_seconds, limits.decode_threads) == (2.5, max(1, usable_cores() // 3))
    assert server_settings(args, "").max_video_decodes == 3
    off = build_parser().parse_args([*release, "--video-decode-budget", "off"])
    assert make_decider(off).options.video_limits.max_decode_seconds is None
