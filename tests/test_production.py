"""Behaviour under stress, against clef-serve running as its own process on 127.0.0.1 (every loop bounded
in count and time): graceful shutdown, 2,000 requests at concurrency 32, faulty clients, fuzzing from the
OpenAPI spec, and the security rules."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import random
import signal
import socket
import threading
import time

import httpx
import pytest
from live import clef_serve_process
from prometheus_client.parser import text_string_to_metric_families
from random_requests import random_request
from releases import tiny_release

OK = {"model": "clef-flash", "state": "Checkout fails for everyone.", "questions": {"outage": {"type": "noul"}}}
SLOW = {"model": "clef-flash", "state": "slow " * 1500, "questions": {"q": {"type": "noul"}}}


@contextlib.contextmanager
def server(*flags: str, ready_timeout: float = 120):
    """clef-serve on the upstream tiny release, as a child process; yields (url, process, output)."""
    release = ["--w", str(tiny_release()), "--d", "cpu", "--max-model-len", "8192", "--kv-fraction", "0.05"]
    with clef_serve_process(*release, *flags, ready_timeout=ready_timeout) as running:
        yield running


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def assert_idle(url: str) -> None:
    """No leak: nothing queued or running, and only the prefix cache holds blocks and slots."""
    for _ in range(100):
        m = metrics(url)
        if m["clef_queue_depth"] == 0 and m["clef_running_sequences"] == 0:
            break
        time.sleep(0.05)
    assert m["clef_queue_depth"] == 0 and m["clef_running_sequences"] == 0
    assert m["clef_kv_blocks_used"] == m["clef_prefix_cache_blocks"]
    assert m["clef_state_slots_used"] == m["clef_prefix_cache_entries"]


def valid_answer(request: dict, body: dict) -> bool:
    answers = body["answers"]
    if list(answers) != list(request["questions"]) or body["usage"]["output_tokens"] != 0:
        return False
    for qid, answer in answers.items():
        kind = request["questions"][qid]["type"]
        if answer["type"] != kind:
            return False
        if kind == "noul":
            ok = 0 <= answer["noul"] <= 1
        else:
            ok = abs(sum(answer["probabilities"].values()) - 1) < 1e-3 and 0 <= answer["confidence"] <= 1
        if not ok:
            return False
    return True


# ---- graceful shutdown ----------------------------------------------------------------------------
def test_sigterm_drains_then_exits_0():
    with server("--prefill-chunk-size", "16", "--drain-timeout", "60") as (url, process, _):
        in_flight: dict = {}

        def long_request():
            response = httpx.post(url + "/v1/systemone", json=SLOW, timeout=120)
            in_flight["status"], in_flight["body"] = response.status_code, response.json()

        thread = threading.Thread(target=long_request)
        thread.start()
        for _ in range(400):
            if metrics(url)["clef_running_sequences"] >= 1:
                break
            time.sleep(0.02)
        process.send_signal(signal.SIGTERM)
        for _ in range(100):
            if httpx.get(url + "/ready", timeout=5).status_code == 503:
                break
            time.sleep(0.02)
        assert httpx.get(url + "/ready", timeout=5).status_code == 503
        refused = httpx.post(url + "/v1/systemone", json=OK, timeout=30)
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["detail"]["error_type"] == "service_unavailable"
        thread.join(120)
        assert in_flight["status"] == 200 and in_flight["body"]["answers"]["q"]["type"] == "noul"
        assert process.wait(60) == 0


# ---- load ---------------------------------------------------------------------------------------
def test_2000_requests_at_concurrency_32():
    rng = random.Random(2026)
    requests = [random_request(rng, max_choice=6, state_words=(3, 40)) for _ in range(2000)]
    with server() as (url, _, _output):
        statuses: list[int] = []
        invalid: list[int] = []

        async def run():
            queue = list(enumerate(requests))

            async def worker(client):
                while queue:
                    index, request = queue.pop()
                    response = await client.post("/v1/systemone", json=request)
                    statuses.append(response.status_code)
                    if response.status_code != 200 or not valid_answer(request, response.json()):
                        invalid.append(index)

            limits = httpx.Limits(max_connections=32)
            async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
                await asyncio.wait_for(asyncio.gather(*(worker(client) for _ in range(32))), timeout=600)

        asyncio.run(run())
        assert len(statuses) == 2000
        assert not [s for s in statuses if s >= 500]
        assert not invalid, f"{len(invalid)} invalid answers, e.g. request {invalid[:3]}"
        assert_idle(url)


# ---- faulty clients -----------------------------------------------------------------------------
def post_head(length: int) -> str:
    return (
        f"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    )


def raw_exchange(port: int, head: bytes, body_parts: list[bytes] = (), pause: float = 0.0, read: bool = True) -> bytes:
    """Send a request by hand (to misbehave on purpose); return the raw response (head + body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head)
        for part in body_parts:
            s.sendall(part)
            time.sleep(pause)
        if not read:
            return b""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                return data
            data += chunk
        headers, _, body = data.partition(b"\r\n\r\n")
        length = next(
            (
                int(line.split(b":", 1)[1])
                for line in headers.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ),
            0,
        )
        while len(body) < length:
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
        return headers + b"\r\n\r\n" + body


def test_faulty_clients_do_not_disturb_the_others():
    with server("--body-timeout", "2", "--max-body-bytes", "100000", "--prefill-chunk-size", "16") as (url, _, _o):
        port = int(url.rsplit(":", 1)[1])
        stop = threading.Event()
        normal: list[int] = []

        def steady_traffic():
            with httpx.Client(base_url=url, timeout=60) as client:
                while not stop.is_set() and len(normal) < 200:
                    normal.append(client.post("/v1/systemone", json=OK).status_code)

        background = threading.Thread(target=steady_traffic)
        background.start()
        body = json.dumps(OK).encode()
        head = post_head(len(body))
        # A body that trickles in slower than --body-timeout, and one that never comes: 408.
        slow = raw_exchange(port, head.encode(), [body[:10], body[10:20]], pause=1.5)
        assert b" 408 " in slow.split(b"\r\n")[0] and b"request_timeout" in slow
        silent = raw_exchange(port, head.encode())
        assert b" 408 " in silent.split(b"\r\n")[0]
        # A huge declared body is refused before it is sent.
        huge = raw_exchange(port, b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n")
        assert b" 413 " in huge.split(b"\r\n")[0]
        # Corrupt compression and non-UTF-8 bodies.
        corrupt = httpx.post(
            url + "/v1/systemone",
            content=gzip.compress(body)[:-8] + b"xxxxxxxx",
            headers={"Content-Encoding": "gzip"},
            timeout=30,
        )
        assert corrupt.status_code == 400 and corrupt.json()["detail"]["error_type"] == "invalid_request_error"
        latin = httpx.post(url + "/v1/systemone", content='{"model": "caf\xe9"}'.encode("latin-1"), timeout=30)
        assert latin.status_code == 422
        # Clients that disconnect mid-prefill.
        long_body = json.dumps(SLOW).encode()
        long_head = post_head(len(long_body))
        for _ in range(3):
            raw_exchange(port, long_head.encode(), [long_body], read=False)
        stop.set()
        background.join(120)
        assert normal and all(status == 200 for status in normal), normal
        assert httpx.post(url + "/v1/systemone", json=OK, timeout=60).status_code == 200
        assert_idle(url)


# ---- fuzzing from the OpenAPI spec --------------------------------------------------------------
@pytest.fixture(scope="module")
def fuzz_app():
    from fastapi.testclient import TestClient

    from app.server import ServerSettings, create_app
    from clef_cuda import Decider
    from clef_cuda.engine import Engine, EngineConfig

    decider = Decider.from_release(tiny_release(), device="cpu", progress=False)
    engine = Engine(decider, EngineConfig(max_model_len=4096, kv_fraction=0.05))
    app = create_app(ServerSettings(max_body_bytes=1_000_000), engine=engine)
    with TestClient(app):  # runs start-up: engine thread, warm-up
        yield app


def _contract_shape(response) -> bool:
    body = response.json()
    if response.status_code == 422:
        return isinstance(body["detail"], list) and all({"loc", "msg", "type"} <= set(e) for e in body["detail"])
    return set(body["detail"]) == {"error_type", "message"}


def test_fuzz_1000_requests_never_5xx(fuzz_app):
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)
    operation = schema["/v1/systemone"]["POST"]
    seen: list[int] = []
    for mode, examples in ((GenerationMode.POSITIVE, 500), (GenerationMode.NEGATIVE, 600)):

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case):
            response = case.call()
            seen.append(response.status_code)
            assert response.status_code < 500, (case.body, response.text)
            if response.status_code >= 400:
                assert _contract_shape(response), response.text

        run()
    from fastapi.testclient import TestClient

    client = TestClient(fuzz_app)  # no `with`: the app is already started
    for path in ("/v1/models", "/health", "/ready", "/metrics"):
        seen.append(client.get(path).status_code)
    assert len(seen) >= 1000 and max(seen) < 500
    assert 200 in seen and 422 in seen


# ---- security -----------------------------------------------------------------------------------
def test_keys_and_bodies_are_never_logged():
    secret, marker = "sk-very-secret-7f3a", "BODY-MARKER-91c2"
    with server("--api-key", secret, "--log-level", "debug") as (url, process, output):
        body = OK | {"state": f"the state contains {marker}"}
        assert (
            httpx.post(
                url + "/v1/systemone", json=body, headers={"Authorization": f"Bearer {secret}"}, timeout=60
            ).status_code
            == 200
        )
        assert (
            httpx.post(
                url + "/v1/systemone", json=body, headers={"Authorization": "Bearer wrong-key"}, timeout=60
            ).status_code
            == 401
        )
        assert (
            httpx.post(
                url + "/v1/systemone",
                content=b"{broken " + marker.encode(),
                timeout=60,
                headers={"Authorization": f"Bearer {secret}"},
            ).status_code
            == 422
        )
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    logs = "".join(output)
    assert "ready" in logs  # the log was captured
    assert secret not in logs and "wrong-key" not in logs and marker not in logs


def test_no_cors_unless_configured():
    from fastapi.testclient import TestClient

    from app.server import ServerSettings, create_app

    origin = {"Origin": "https://evil.example"}
    with TestClient(create_app(ServerSettings())) as c:
        assert "access-control-allow-origin" not in c.get("/health", headers=origin).headers
    with TestClient(create_app(ServerSettings(cors_origins=("https://app.example",)))) as c:
        allowed = c.get("/health", headers={"Origin": "https://app.example"})
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
        assert "access-control-allow-origin" not in c.get("/health", headers=origin).headers
