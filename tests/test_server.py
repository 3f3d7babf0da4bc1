"""The HTTP contract (shared/specs/systemone-api.md): every status code and error shape, compressed bodies,
extensions, /v1/models, /health, /ready, /metrics; concurrency; prefix-cache exactness; cleanup."""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import zstandard
from fastapi.testclient import TestClient
from live import GatedEngine, wait_until
from prometheus_client.parser import text_string_to_metric_families
from random_requests import random_request
from releases import tiny_release

from app.server import ServerSettings, create_app
from clef_cuda import Decider
from clef_cuda.request import answers
from clef_cuda.serving.engine import Engine, EngineConfig

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
OK = {"model": "clef-flash", "state": "Checkout fails for everyone.", "questions": {"outage": {"type": "noul"}}}


@pytest.fixture(scope="module")
def decider():
    return Decider.from_release(tiny_release(), device="cpu", progress=False)


def make_engine(decider, **config) -> Engine:
    defaults = dict(max_num_seqs=4, prefill_chunk_size=128, max_model_len=4096, kv_fraction=0.05)
    return Engine(decider, EngineConfig(**(defaults | config)))


@pytest.fixture(scope="module")
def client(decider):
    app = create_app(ServerSettings(api_key=KEY, max_body_bytes=200_000), engine=make_engine(decider))
    with TestClient(app) as c:
        yield c


def post(client, body, headers=AUTH, **kwargs):
    return client.post("/v1/systemone", json=body, headers=headers, **kwargs)


def assert_error(response, status: int, error_type: str):
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    assert set(detail) == {"error_type", "message"} and detail["error_type"] == error_type and detail["message"]


def assert_422(response):
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, list) and detail
    for item in detail:
        assert item["loc"][0] == "body" and isinstance(item["msg"], str) and isinstance(item["type"], str)


# ---- success ---------------------------------------------------------------------------------------
def test_answers_in_request_order_with_usage_and_extensions(client):
    body = {
        "model": "clef-flash",
        "state": {"ticket": "refund not received", "order": 42},
        "questions": {
            "z-last": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "mid", "high"]},
            "team": {"type": "choice", "criteria": {"sales": "New purchases", "billing": None}},
            "refund": {"type": "noul", "criteria": {"true": "A refund is requested."}},
        },
        "unknown_field": "ignored",
    }
    response = post(client, body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["model"] == "clef-flash" and list(data["answers"]) == ["z-last", "team", "refund"]
    assert isinstance(data["usage"]["input_tokens"], int) and data["usage"]["output_tokens"] == 0
    assert list(data["answers"]["team"]["probabilities"]) == ["sales", "billing"]
    assert abs(sum(data["answers"]["team"]["probabilities"].values()) - 1) < 2e-4
    assert set(data["answers"]["z-last"]) == {"type", "score", "confidence", "legend", "probabilities"}
    assert set(data["answers"]["refund"]) == {"type", "noul"}
    assert isinstance(data["x_cached_tokens"], int) and set(data["x_timing_ms"]) == {"queue", "prefill", "total"}


def test_alias_is_accepted_and_answered_with_the_served_name(client):
    response = post(client, OK | {"model": "jev-latest"})
    assert response.status_code == 200 and response.json()["model"] == "clef-flash"


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
def test_compressed_bodies(client, encoding):
    raw = json.dumps(OK).encode()
    data = gzip.compress(raw) if encoding == "gzip" else zstandard.ZstdCompressor().compress(raw)
    response = client.post("/v1/systemone", content=data, headers=AUTH | {"Content-Encoding": encoding})
    assert response.status_code == 200, response.text


# ---- 4xx -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_missing_or_wrong_key_is_401(client, headers):
    response = post(client, OK, headers=headers)
    assert_error(response, 401, "authentication_error")
    assert response.headers["www-authenticate"] == "Bearer"


def test_unknown_model_is_404(client):
    assert_error(post(client, OK | {"model": "gpt-5"}), 404, "not_found_error")


def test_unknown_path_and_method(client):
    assert_error(client.get("/v1/nothing", headers=AUTH), 404, "not_found_error")
    assert_error(client.get("/v1/nothing"), 401, "authentication_error")  # with a key set, /v1 is closed
    assert_error(client.get("/v1/systemone", headers=AUTH), 405, "method_not_allowed")


@pytest.mark.parametrize(
    "body",
    [
        {"model": "clef-flash", "questions": {"q": {"type": "noul"}}},  # no state
        {"model": "clef-flash", "state": "s"},  # no questions
        {"model": "clef-flash", "state": "s", "questions": {}},
        {"model": "clef-flash", "state": 7, "questions": {"q": {"type": "noul"}}},
        {"state": "s", "questions": {"q": {"type": "noul"}}},  # no model
        {"model": "clef-flash", "state": "s", "questions": {"q": {"type": "maybe"}}},
        {"model": "clef-flash", "state": "s", "questions": {"q": {"type": "choice"}}},
        {"model": "clef-flash", "state": "s", "questions": {"q": {"type": "choice", "criteria": {"only": "one"}}}},
        {
            "model": "clef-flash",
            "state": "s",
            "questions": {"q": {"type": "choice", "criteria": {str(i): None for i in range(256)}}},
        },
        {
            "model": "clef-flash",
            "state": "s",
            "questions": {"q": {"type": "score", "criteria": {"0": "low", "1": "high"}}},
        },
        {"model": "clef-flash", "state": "s", "questions": {"q": {"type": "score", "criteria": ["one"]}}},
        {"model": "clef-flash", "state": "s", "questions": {"q": {"type": "score", "criteria": list("abcdefghijk")}}},
        {"model": "clef-flash", "state": "s", "questions": {"": {"type": "noul"}}},
        {"model": "clef-flash", "state": "s", "questions": {f"q{i}": {"type": "noul"} for i in range(65)}},
        {"model": "clef-flash", "state": "s", "questions": {"q": {"type": "noul", "criteria": ["true"]}}},
        [1, 2, 3],
    ],
)
def test_invalid_bodies_are_422_in_fastapi_shape(client, body):
    assert_422(post(client, body))


@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe\x00", b"null"])
def test_non_json_bodies_are_422(client, raw):
    assert_422(client.post("/v1/systemone", content=raw, headers=AUTH))


def test_over_the_token_budget_is_413_with_counts(client):
    response = post(client, OK | {"state": "word " * 5000})
    assert_error(response, 413, "request_too_large")
    assert "tokens" in response.json()["detail"]["message"] and "4096" in response.json()["detail"]["message"]


def test_oversized_and_undecodable_bodies(client):
    assert_error(client.post("/v1/systemone", content=b"x" * 200_001, headers=AUTH), 413, "request_too_large")
    bomb = gzip.compress(json.dumps(OK | {"state": "a" * 400_000}).encode())  # small on the wire, big inside
    assert_error(
        client.post("/v1/systemone", content=bomb, headers=AUTH | {"Content-Encoding": "gzip"}),
        413,
        "request_too_large",
    )
    assert_error(
        client.post("/v1/systemone", content=b"garbage", headers=AUTH | {"Content-Encoding": "zstd"}),
        400,
        "invalid_request_error",
    )
    assert_error(
        client.post("/v1/systemone", content=b"{}", headers=AUTH | {"Content-Encoding": "br"}),
        415,
        "unsupported_media_type",
    )


# ---- other endpoints --------------------------------------------------------------------------------
def test_models_health_ready(client):
    models = client.get("/v1/models", headers=AUTH).json()
    assert models["object"] == "list" and models["models"][0]["name"] == "clef-flash"
    assert models["data"][0] == models["data"][0] | {"id": "clef-flash", "object": "model"}
    assert client.get("/health").json() == {"status": "ok"} and client.get("/ready").status_code == 200


def test_metrics_parse_and_count(client):
    post(client, OK)
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    for name in (
        "clef_requests",
        "clef_request_latency_seconds",
        "clef_prompt_tokens",
        "clef_cached_tokens",
        "clef_queue_depth",
        "clef_running_sequences",
        "clef_kv_blocks_used",
        "clef_state_slots_used",
        "clef_prefix_cache_hits",
        "clef_prefix_cache_misses",
        "clef_prefix_cache_evictions",
    ):
        assert name in families, name
    statuses = {s.labels["status"] for s in families["clef_requests"].samples if s.name == "clef_requests_total"}
    assert "200" in statuses


def test_not_ready_and_queue_full_are_503_with_retry_after(decider):
    loading = create_app(ServerSettings(), load_engine=lambda: (_ for _ in ()).throw(RuntimeError("no weights")))
    with TestClient(loading) as c:
        for _ in range(100):
            if c.get("/ready").json()["detail"]["message"] != "loading":
                break
        response = c.post("/v1/systemone", json=OK)
        assert_error(response, 503, "service_unavailable")
        assert response.headers["retry-after"]
        assert "no weights" in c.get("/ready").json()["detail"]["message"]

    engine = GatedEngine(decider, EngineConfig(max_model_len=4096, kv_fraction=0.05, max_queue=1))
    app = create_app(ServerSettings(), engine=engine, warm_up=False)
    with TestClient(app) as c:
        first = engine.submit(OK)  # takes the one queue place: the scheduler is held at the gate
        response = c.post("/v1/systemone", json=OK)
        assert_error(response, 503, "overloaded_error")
        assert response.headers["retry-after"] == "1"
        engine.gate.set()
        assert first.future.result(60)["answers"]["outage"]["type"] == "noul"


def _failure_lines(caplog) -> list[str]:
    """The error lines of the server's own logger: a request the server failed ('request ... failed')."""
    return [r.getMessage() for r in caplog.records if r.name == "clef_serve" and r.levelname == "ERROR"]


def test_a_request_timeout_is_a_503_timeout_not_a_failed_request(decider, caplog):
    """--request-timeout passed while the record waits: the contract's 503 timeout with Retry-After, logged as a
    503 decision and not as a failed request (the wait's own ClientError was caught by its step mapping and became
    a 500 internal_error 'request ... failed'); the cancelled ticket leaves the engine idle."""
    engine = GatedEngine(decider, EngineConfig(max_model_len=4096, kv_fraction=0.05))
    app = create_app(ServerSettings(request_timeout=0.3), engine=engine, warm_up=False)
    with caplog.at_level("INFO"), TestClient(app) as c:
        response = c.post("/v1/systemone", json=OK)
        assert_error(response, 503, "timeout")
        assert response.headers["retry-after"] == "1" and "--request-timeout" in response.json()["detail"]["message"]
        engine.gate.set()
        wait_until(lambda: engine.queue_depth == 0 and engine.running == 0, "the cancelled request to go")
        assert c.post("/v1/systemone", json=OK).status_code == 200  # it serves on
    assert not _failure_lines(caplog), _failure_lines(caplog)
    decisions = [r.getMessage() for r in caplog.records if r.name == "clef_serve.requests"]
    assert any("status=503" in line and "error_type=timeout" in line for line in decisions), decisions


def test_a_client_gone_mid_wait_is_a_499_not_a_failed_request(decider, caplog):
    """The disconnect path of the same wait: 499 client_closed_request, no failure line (it was a 500 too)."""
    from app import decisions
    from app.context import context_of
    from app.intake import ClientError

    engine = GatedEngine(decider, EngineConfig(max_model_len=4096, kv_fraction=0.05))
    app = create_app(ServerSettings(), engine=engine, warm_up=False)

    class Gone:
        app = None
        state = type("State", (), {"request_id": "req-gone"})()

        async def is_disconnected(self) -> bool:
            return True

    with caplog.at_level("INFO"), TestClient(app):
        gone = Gone()
        gone.app = app
        ticket = engine.submit(OK)
        with pytest.raises(ClientError) as raised:
            asyncio.run(decisions._wait(gone, context_of(gone), engine, ticket, time.monotonic() + 60))
        assert (raised.value.status, raised.value.error_type) == (499, "client_closed_request")
        engine.gate.set()
        wait_until(lambda: engine.queue_depth == 0 and engine.running == 0, "the cancelled request to go")
    assert not _failure_lines(caplog), _failure_lines(caplog)


# ---- concurrency, exactness, cleanup -------------------------------------------------------------
def test_32_concurrent_requests_equal_sequential_answers(decider):
    requests = [random_request(random.Random(100 + i), null_score_levels=False) for i in range(32)]
    app = create_app(ServerSettings(), engine=make_engine(decider, max_num_seqs=4, prefill_chunk_size=96))

    async def run_all():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/systemone", json=r) for r in requests))

    with TestClient(app):  # runs the lifespan (engine start, warm-up)
        together = asyncio.run(run_all())
    for request, response in zip(requests, together, strict=True):
        assert response.status_code == 200, response.text
        alone = decider.decide(request)
        assert response.json()["answers"] == alone["answers"]
        assert response.json()["usage"] == alone["usage"]


def test_prefix_cache_hits_give_the_cold_answers(decider, monkeypatch):
    """Same long state, new questions: the second record starts from the cached state snapshot, and its
    unrounded probabilities equal a cold run's (no prefix cache) to 1e-6."""
    seen: list[dict] = []
    real_answer = answers.answer

    def record(question, probabilities, confidence="clef"):
        seen.append(dict(probabilities))
        return real_answer(question, probabilities, confidence)

    monkeypatch.setattr(answers, "answer", record)
    state = {"log": " ".join(f"line {i}: checkout ERROR payment declined" for i in range(60))}
    first = {"model": "clef-flash", "state": state, "questions": {"a": {"type": "noul", "instructions": "down?"}}}
    second = {
        "model": "clef-flash",
        "state": state,
        "questions": {
            "b": {"type": "choice", "criteria": {"x": "one", "y": "two", "z": None}},
            "c": {"type": "score", "criteria": ["lo", "hi"]},
        },
    }
    results = {}
    for cached in (True, False):
        engine = make_engine(decider, prefix_cache=cached)
        engine.start()
        try:
            engine.decide(first, timeout=60)
            seen.clear()
            body = engine.decide(second, timeout=60)
            results[cached] = (body, list(seen))
            if cached:
                assert body["x_cached_tokens"] >= decider.encode(second).state_tokens
                assert engine.prefix_cache.hits >= 1
            else:
                assert body["x_cached_tokens"] == 0
        finally:
            engine.stop(10)
    warm, cold = results[True], results[False]
    assert warm[0]["answers"] == cold[0]["answers"]
    for w, c in zip(warm[1], cold[1], strict=True):
        assert max(abs(w[k] - c[k]) for k in w) < 1e-6


def test_identical_records_reuse_the_schema_too(decider):
    engine = make_engine(decider)
    engine.start()
    try:
        request = random_request(random.Random(3))
        first = engine.decide(request, timeout=60)
        again = engine.decide(request, timeout=60)
        record = decider.encode(request)
        assert again["x_cached_tokens"] >= (record.num_tokens - record.suffix_tokens) // 16 * 16
        assert again["answers"] == first["answers"]
    finally:
        engine.stop(10)


def test_a_stop_while_the_engine_starts_waits_for_its_thread(decider, monkeypatch):
    """A shutdown can reach the engine while the lifecycle is starting it (CI once stopped a server whose load had
    just finished): stop() must find no thread or a started one, never one created and not yet started (join
    raises on it). The thread's start is held here until stop() has been called."""
    from clef_cuda.serving import engine as engine_module

    starting, release, Thread = threading.Event(), threading.Event(), threading.Thread

    class SlowStart(Thread):
        def start(self) -> None:
            starting.set()
            release.wait(10)
            super().start()

    engine = make_engine(decider)
    # What is patched: clef_cuda.serving.engine's own name `threading`, now a stand-in for the module whose Thread is
    # SlowStart, so only the threads the engine starts are held (patching threading.Thread itself would hold every
    # thread this process starts meanwhile).
    monkeypatch.setattr(engine_module, "threading", SimpleNamespace(**{**vars(threading), "Thread": SlowStart}))
    starter = Thread(target=engine.start)
    starter.start()
    assert starting.wait(10)
    errors = []

    def stop() -> None:
        try:
            engine.stop(10)
        except Exception as error:  # what the test looks for
            errors.append(error)

    stopper = Thread(target=stop)
    stopper.start()
    stopper.join(0.3)  # stop() is under way (or already failed) while the thread is not started
    release.set()
    starter.join(10)
    stopper.join(10)
    assert not errors and not stopper.is_alive() and not engine._thread.is_alive()


def test_prefix_cache_evicts_under_pressure_and_counters_return_to_baseline(decider):
    engine = make_engine(decider, max_snapshots=3)
    engine.start()
    try:
        for i in range(12):
            engine.decide(random_request(random.Random(200 + i), max_choice=4, state_words=(5, 40)), timeout=60)
        assert len(engine.prefix_cache) <= 3 and engine.prefix_cache.evictions > 0
        assert engine.running == 0 and engine.queue_depth == 0
        assert engine.running_slots.available == engine.plan.running_slots
        held = sum(len(e.blocks) for e in engine.prefix_cache._entries.values())
        assert engine.blocks.used <= held  # only cache entries hold blocks once idle
    finally:
        engine.stop(10)


def test_cancelled_requests_free_their_slot_and_blocks(decider):
    engine = make_engine(decider, prefill_chunk_size=16, prefix_cache=False)
    engine.start()
    try:
        long = OK | {"state": "word " * 600}
        tickets = [engine.submit(long) for _ in range(6)]
        for t in tickets:
            engine.cancel(t)
        for t in tickets:
            try:
                t.future.result(60)
            except Exception as error:
                assert type(error).__name__ == "RequestCancelledError"
        engine.decide(OK, timeout=60)  # the engine still serves
        assert engine.running == 0 and engine.queue_depth == 0 and engine.blocks.used == 0
        assert engine.running_slots.available == engine.plan.running_slots
    finally:
        engine.stop(10)


# ---- contract fixes: each was a client-caused 5xx or a body the official client cannot read ----------
def test_a_null_score_level_is_422_naming_the_level(client):
    body = OK | {"questions": {"q": {"type": "score", "criteria": ["low", None, "high"]}}}
    response = post(client, body)
    assert_422(response)
    (item,) = response.json()["detail"]
    assert item["loc"][:3] == ["body", "questions", "q"] and "level 1 is null" in item["msg"]


def test_a_box_question_is_422_saying_what_clef_answers(client):
    body = OK | {"questions": {"ok": {"type": "noul"}, "where": {"type": "box", "instructions": "Find the dent"}}}
    response = post(client, body)
    assert_422(response)
    (item,) = response.json()["detail"]
    assert item["loc"] == ["body", "questions", "where", "type"]
    assert "box" in item["msg"] and "noul, choice and score" in item["msg"]


def test_deep_nesting_is_422_naming_the_limit(client):
    deep = "[" * 5000 + "]" * 5000  # Python's JSON decoder raised RecursionError here: a 500
    raw = f'{{"model": "clef-flash", "state": {deep}, "questions": {{"q": {{"type": "noul"}}}}}}'
    response = client.post("/v1/systemone", content=raw.encode(), headers=AUTH)
    assert_422(response)
    assert "--max-json-depth" in response.json()["detail"][0]["msg"]
    fine = {"model": "clef-flash", "state": json.loads("[" * 200 + "]" * 200), "questions": {"q": {"type": "noul"}}}
    assert post(client, fine).status_code == 200  # well below the default limit, through every stage


@pytest.mark.parametrize(
    "raw, loc",
    [
        ('{"model": "clef-flash", "state": "a\\ud800b", "questions": {"q": {"type": "noul"}}}', ["body", "state"]),
        ('{"model": "clef-flash", "state": "s", "questions": {"q\\udfff": {"type": "noul"}}}', ["body", "questions"]),
        (
            '{"model": "clef-flash", "state": "s", "questions": {"q": {"type": "choice", "criteria": {"a": null,'
            ' "b\\ud800": null}}}}',
            ["body", "questions", "q", "criteria"],
        ),
        ('{"model": "\\ud800", "state": "s", "questions": {"q": {"type": "noul"}}}', ["body", "model"]),
    ],
)
def test_lone_surrogates_are_422_naming_the_field(client, raw, loc):
    response = client.post("/v1/systemone", content=raw.encode(), headers=AUTH)
    assert_422(response)
    assert response.json()["detail"][0]["loc"][: len(loc)] == loc


def test_request_ids_are_echoed_or_made(client):
    given = post(client, OK, headers=AUTH | {"X-Request-Id": "trace-7f3a.1"})
    assert given.headers["x-request-id"] == "trace-7f3a.1"
    made = post(client, OK)
    assert len(made.headers["x-request-id"]) == 32 and int(made.headers["x-request-id"], 16) >= 0
    forged = post(client, OK, headers=AUTH | {"X-Request-Id": "x status=200 injected"})  # a forged log line
    assert forged.headers["x-request-id"] != "x status=200 injected"
    assert post(client, OK | {"model": "gpt-5"}).headers["x-request-id"]  # errors carry one too


def test_a_second_start_never_adds_a_second_scheduler(decider):
    """One thread owns the model. schemathesis' ASGI client runs the app's lifespan again, which starts the
    engine again: with two schedulers stepping the same sequences a record was prefilled twice and its
    head overran (a 5xx the improved fuzz found)."""
    import threading

    def schedulers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "clef-engine"}

    others = schedulers()  # engines other tests' fixtures still hold
    engine = make_engine(decider)
    engine.start()
    try:
        engine.start()
        assert len(schedulers() - others) == 1
        assert engine.decide(random_request(random.Random(1)), timeout=60)["answers"]
    finally:
        engine.stop(10)


# ---- capacity refusals: what harnesses read as "unsupported" ----------------------------------------------
# The Decision Index's http engine (shared/specs/clients.md) records a 400/413/422 whose body holds one of its
# markers as "unsupported" (final); anything else is retried as an error, and five errors stop a run. Beside
# its markers (OpenAI's and vLLM's context wording, options and levels), the limit named per kind.
HARNESS_MARKERS = (
    "maximum context length",
    "maximum model length",
    "longer than the maximum model length",
    "context window",
    "too many tokens",
    "options per choice",
    "a choice needs at least two options",
    "a score takes 2 to 10 levels",
)
UNSUPPORTED_MARKERS = (
    *HARNESS_MARKERS,
    "levels per score",
    "questions per request",
    "images per request",
    "per image",
    "of images per request",
    "per request body",
)


def refusal_message(response) -> str:
    detail = response.json()["detail"]
    return " ".join(item["msg"] for item in detail) if isinstance(detail, list) else detail["message"]


@pytest.mark.parametrize(
    ("case", "status", "words"),
    [
        ("a record over the token budget", 413, ["maximum context length", "4096", "tokens"]),
        ("300 options", 422, ["options per choice", "300", "255", "'pick'"]),
        ("one option", 422, ["a choice needs at least two options", "1 options", "'pick'"]),
        ("12 score levels", 422, ["a score takes 2 to 10 levels", "levels per score", "12", "'grade'"]),
        ("65 questions", 422, ["questions per request", "65", "64"]),
        ("5 images", 422, ["5 images", "at most 4 images per request"]),
        ("a body over the limit", 413, ["per request body", "200000"]),
    ],
)
def test_every_capacity_refusal_names_its_kind_limit_and_value(client, case, status, words):
    """Token budget, options, score levels, questions, images, body size: the refusal names the kind, the limit
    and the value sent, in words a harness reads as "unsupported" (the 422 list shape kept)."""
    image = "data:image/png;base64,iVBORw0KGgo="
    bodies = {
        "a record over the token budget": OK | {"state": "word " * 6000},
        "300 options": OK | {"questions": {"pick": {"type": "choice", "criteria": {f"o{i}": "" for i in range(300)}}}},
        "one option": OK | {"questions": {"pick": {"type": "choice", "criteria": {"only": ""}}}},
        "12 score levels": OK | {"questions": {"grade": {"type": "score", "criteria": [str(i) for i in range(12)]}}},
        "65 questions": OK | {"questions": {f"q{i}": {"type": "noul"} for i in range(65)}},
        "5 images": OK | {"images": [image] * 5},
        "a body over the limit": OK | {"state": "x" * 250_000},
    }
    response = post(client, bodies[case])
    assert response.status_code == status, response.text
    message = refusal_message(response)
    for word in words:
        assert word in message, message
    assert any(marker in message for marker in UNSUPPORTED_MARKERS), message


@pytest.mark.parametrize(
    "body",
    [
        {"questions": {"pick": {"type": "choice"}}},
        {"questions": {"pick": {"type": "choice", "criteria": ["a", "b"]}}},
        {"state": None},
        {"questions": {"grade": {"type": "score", "criteria": ["low", None]}}},
    ],
    ids=["a choice without criteria", "a choice as a list", "no state", "a null score level"],
)
def test_a_refusal_that_is_not_capacity_reads_as_an_error_not_unsupported(client, body):
    """The other side of the harness's rule: a malformed request is a 422 no marker matches (it is retried, and
    counted as an error, where the client is at fault and a fix is due)."""
    response = post(client, OK | body)
    assert response.status_code == 422, response.text
    message = refusal_message(response)
    assert not any(marker in message for marker in UNSUPPORTED_MARKERS), message
