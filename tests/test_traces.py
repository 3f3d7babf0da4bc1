"""Request traces (--otlp-traces-endpoint, app/tracing.py) against a real OTLP/HTTP receiver on 127.0.0.1 (the
protobuf bodies decoded with opentelemetry-proto): a span per decision with its children (encoding, queue wait,
each prefill chunk, the head, the shadow's re-decision), the client's traceparent honoured, the request id in the
span and the trace id in the JSON log; off, neither the OpenTelemetry SDK nor its exporter is loaded (the API is
fastapi's own dependency) and the engine keeps no timeline; without the packages the flag is a one-line error."""

from __future__ import annotations

import base64
import json
import math
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import clips
import httpx
import pytest
from images import png
from live import ClefServe, wait_until
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from releases import tiny_release

ROOT = Path(__file__).resolve().parents[1]
CLIENT_TRACE, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
DECISION = {
    "model": "clef-tiny",
    "state": "12:00 api: ok\n12:01 db: timeout\n12:02 api: error\n" * 6,
    "questions": {"db": {"type": "noul", "instructions": "Did the database fail?"}},
}


class Receiver:
    """An OTLP/HTTP traces receiver: every span posted to /v1/traces, decoded."""

    def __init__(self) -> None:
        self.spans: list = []
        self.paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802  (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.paths.append(self.path)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        receiver.spans.extend(scope.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def of_trace(self, trace_id: str) -> list:
        return [span for span in list(self.spans) if span.trace_id.hex() == trace_id]

    def close(self) -> None:
        self.server.shutdown()


def attributes(span) -> dict:
    found = {}
    for item in span.attributes:
        value = item.value
        found[item.key] = next(getattr(value, f) for f in ("string_value", "int_value", "double_value", "bool_value")
                               if value.HasField(f))  # fmt: skip
    return found


@pytest.fixture(scope="module")
def traced():
    receiver = Receiver()
    server = ClefServe(
        "--d", "cpu", "--autotune", "off", "--shadow-rate", "1", "--prefill-chunk-size", "64",
        "--log-format", "json", "--otlp-traces-endpoint", receiver.url,
    )  # fmt: skip
    try:
        server.assert_ready()
        yield server, receiver
    finally:
        server.kill()
        receiver.close()


def test_a_decision_is_a_span_with_its_engine_steps_in_the_clients_trace(traced):
    server, receiver = traced
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "X-Request-Id": "trace-req-1"}
    answer = httpx.post(server.url + "/v1/systemone", json=DECISION, headers=headers, timeout=60)
    assert answer.status_code == 200 and answer.headers["x-request-id"] == "trace-req-1"
    tokens = answer.json()["usage"]["input_tokens"]
    names = lambda: [span.name for span in receiver.of_trace(CLIENT_TRACE)]  # noqa: E731
    wait_until(lambda: "shadow" in names(), "the request's spans and the shadow's re-decision", timeout=60)
    spans = receiver.of_trace(CLIENT_TRACE)
    (root,) = [span for span in spans if span.name == "POST /v1/systemone"]
    assert root.parent_span_id.hex() == CLIENT_SPAN  # a child of the client's span
    assert attributes(root) | {"clef.input_tokens": tokens} == attributes(root)
    assert {k: attributes(root)[k] for k in ("clef.request_id", "clef.model", "http.response.status_code")} == {
        "clef.request_id": "trace-req-1",
        "clef.model": "clef-tiny",
        "http.response.status_code": 200,
    }
    children = [span for span in spans if span is not root]
    assert all(span.parent_span_id == root.span_id for span in children)
    by_name = {}
    for span in children:
        by_name.setdefault(span.name, []).append(span)
    assert set(by_name) == {"encode", "queue", "prefill", "head", "shadow"}, sorted(by_name)
    assert len(by_name["prefill"]) == math.ceil(tokens / 64)  # each chunk of --prefill-chunk-size 64
    assert sum(attributes(span)["clef.tokens"] for span in by_name["prefill"]) == tokens
    # each chunk says how far along the record it is: its first position of the record's total
    progress = sorted((attributes(s)["clef.position"], attributes(s)["clef.tokens_total"]) for s in by_name["prefill"])
    assert progress == [(64 * i, tokens) for i in range(len(progress))]
    (shadow,) = by_name["shadow"]
    assert attributes(shadow)["clef.verdict"] == "match"
    for span in children:
        assert span.start_time_unix_nano <= span.end_time_unix_nano
    order = [by_name[name][0].start_time_unix_nano for name in ("encode", "queue", "prefill", "head")]
    assert (
        order == sorted(order)
        and root.start_time_unix_nano <= order[0]
        and by_name["head"][0].end_time_unix_nano <= root.end_time_unix_nano
    )
    assert set(receiver.paths) == {"/v1/traces"}
    # The JSON log's lines of the request carry its trace id.
    lines = [json.loads(line) for line in server.text().splitlines() if line.startswith("{")]
    mine = [line for line in lines if line.get("request_id") == "trace-req-1"]
    assert mine and all(line["trace_id"] == CLIENT_TRACE for line in mine)


def test_a_decision_with_an_image_and_a_clip_traces_their_decoding_and_the_tower(traced):
    """A release with a vision tower (the upstream tiny one): the clip's decoding is a `videos` child (its seconds and
    frame groups), the tower's inputs an `images` child (the image and each frame group), and the request's span says
    it asked no variant and how many of its tokens the prefix cache held (as its answer says)."""
    _, receiver = traced
    server = ClefServe(
        "--w", str(tiny_release()), "--d", "cpu", "--autotune", "off", "--selfcheck", "off", "--shadow-rate", "0",
        "--otlp-traces-endpoint", receiver.url,
    )  # fmt: skip
    try:
        server.assert_ready()
        clip = clips.clip("h264", 96, 64, count=30, fps=10, seed=3)  # 3 s
        media = {
            "images": ["data:image/png;base64," + base64.b64encode(png(40, 32)).decode()],
            "videos": ["data:video/mp4;base64," + base64.b64encode(clip).decode()],
        }
        body = DECISION | media | {"model": "clef-flash"}
        answer = httpx.post(server.url + "/v1/systemone", json=body, headers={"X-Request-Id": "media-1"}, timeout=120)
        assert answer.status_code == 200, answer.text
        roots = lambda: [  # noqa: E731
            s
            for s in list(receiver.spans)
            if s.name == "POST /v1/systemone" and attributes(s)["clef.request_id"] == "media-1"
        ]
        wait_until(lambda: roots(), "the request's span", timeout=60)
        (root,) = roots()
        children = {s.name: s for s in receiver.of_trace(root.trace_id.hex()) if s is not root}
        assert {"encode", "videos", "queue", "images", "prefill", "head"} <= set(children), sorted(children)
        videos = attributes(children["videos"])
        assert (
            videos["clef.videos"] == 1 and abs(videos["clef.seconds"] - 3.0) < 0.2 and videos["clef.frame_groups"] > 0
        )
        assert attributes(children["images"])["clef.inputs"] == 1 + videos["clef.frame_groups"]
        assert attributes(children["encode"])["clef.videos"] == 1 and attributes(children["encode"])["clef.images"] == 1
        decoding, encoding = children["videos"], children["encode"]
        assert encoding.start_time_unix_nano <= decoding.start_time_unix_nano <= decoding.end_time_unix_nano
        assert decoding.end_time_unix_nano <= children["queue"].start_time_unix_nano
        assert attributes(root)["clef.variant"] is False
        assert attributes(root)["clef.cached_tokens"] == answer.json()["x_cached_tokens"]
    finally:
        server.kill()


def test_a_request_without_traceparent_starts_its_own_trace_and_a_refusal_is_traced_too(traced):
    server, receiver = traced
    ok = httpx.post(server.url + "/v1/systemone", json=DECISION, headers={"X-Request-Id": "own-trace"}, timeout=60)
    bad = httpx.post(server.url + "/v1/systemone", json={"model": "clef-tiny"}, headers={"X-Request-Id": "bad"})
    assert ok.status_code == 200 and bad.status_code == 422
    roots = lambda: {  # noqa: E731
        attributes(s)["clef.request_id"]: s for s in list(receiver.spans) if s.name == "POST /v1/systemone"
    }
    wait_until(lambda: {"own-trace", "bad"} <= roots().keys(), "both requests' spans", timeout=60)
    own, refused = roots()["own-trace"], roots()["bad"]
    assert own.parent_span_id == b"" and own.trace_id.hex() != CLIENT_TRACE
    assert attributes(refused)["http.response.status_code"] == 422
    assert not [s for s in receiver.spans if s.trace_id == refused.trace_id and s.name != "POST /v1/systemone"]


def run_cli(*argv: str, prelude: str = "") -> subprocess.CompletedProcess:
    code = f"{prelude}import sys; from app.cli import main; sys.exit(main({list(argv)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.parametrize(
    ("endpoint", "prelude", "says"),
    [
        ("http://127.0.0.1:4318", "sys.modules['opentelemetry.sdk'] = None; ", "needs the OpenTelemetry packages: pip"),
        ("collector:4318", "", "expected an http(s) URL"),
    ],
)
def test_the_flag_without_the_packages_or_with_a_bad_url_is_one_line_exit_2(endpoint, prelude, says):
    result = run_cli("--d", "cpu", "--otlp-traces-endpoint", endpoint, prelude="import sys; " + prelude)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("clef-serve: error: --otlp-traces-endpoint") and says in line, line


def test_off_loads_no_opentelemetry_sdk_and_keeps_no_timeline():
    code = """
import sys
from fastapi.testclient import TestClient
from app.server import ServerSettings, create_app
from clef_cuda import Decider
from clef_cuda.model.default_model import default_release
from clef_cuda.serving.engine import Engine, EngineConfig
engine = Engine(Decider.from_release(default_release(), device="cpu", progress=False), EngineConfig(kv_fraction=0.05))
submitted = []
submit = engine.submit
engine.submit = lambda *a, **k: submitted.append(submit(*a, **k)) or submitted[-1]
with TestClient(create_app(ServerSettings(served_model_name="clef-tiny"), engine=engine)) as client:
    body = {"model": "clef-tiny", "state": "s", "questions": {"q": {"type": "noul", "instructions": "Yes?"}}}
    assert client.post("/v1/systemone", json=body).status_code == 200
assert submitted and all(t.timeline is None for t in submitted)
assert not [m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))], "traces off"
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr
