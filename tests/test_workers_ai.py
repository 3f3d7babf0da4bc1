"""Cloudflare Workers AI's route on our server (app/workers_ai.py, shared/specs/clients.md): each success and
error case third-party clients document, replayed, its status, code and envelope checked; the answers those of
/v1/systemone with the hosted confidence."""

from __future__ import annotations

import threading

import pytest
import torch
from fastapi.testclient import TestClient
from images import data_url, png
from live import GatedEngine
from releases import tiny_release, vision_release

from app.server import ServerSettings, create_app
from clef_cuda import Decider
from clef_cuda import lifecycle as server_module
from clef_cuda.serving.engine import Engine, EngineConfig

KEY = "cf-token"
AUTH = {"Authorization": f"Bearer {KEY}"}
ROUTE = "/client/v4/accounts/{account}/ai/run/@cf/cloudflare/{model}"
QUESTIONS = {
    "outage": {"type": "noul", "instructions": "Is this an outage?"},
    "team": {
        "type": "choice",
        "instructions": "Which team?",
        "criteria": {"infra": "servers", "web": "pages", "db": ""},
    },
    "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "medium", "high", "critical"]},
}
BODY = {"state": "Checkout fails for everyone since the deploy.", "questions": QUESTIONS}


def engine_config(**config) -> EngineConfig:
    defaults = dict(max_num_seqs=4, prefill_chunk_size=128, max_model_len=4096, kv_fraction=0.05)
    return EngineConfig(**(defaults | config))


def make_engine(decider, **config) -> Engine:
    return Engine(decider, engine_config(**config))


@pytest.fixture(scope="module")
def decider():
    return Decider.from_release(tiny_release(), device="cpu", progress=False)


@pytest.fixture(scope="module")
def client(decider):
    settings = ServerSettings(api_key=KEY, max_body_bytes=200_000)
    with TestClient(create_app(settings, engine=make_engine(decider))) as c:
        yield c


def run(client, body=BODY, model="clef-flash", headers=AUTH, account="023e105f4ecef8ad9ca31a8372d0c353", **kwargs):
    return client.post(ROUTE.format(account=account, model=model), json=body, headers=headers, **kwargs)


def assert_failure(response, status: int, code: int, *words: str):
    assert response.status_code == status, response.text
    body = response.json()
    assert body["success"] is False and body["result"] is None and body["messages"] == [], body
    (error,) = body["errors"]
    assert error["code"] == code and error["message"], body
    for word in words:
        assert word in error["message"], error["message"]
    return error


def hosted_confidence(probabilities: dict[str, float]) -> float:
    n = len(probabilities)
    return (sum(p * p for p in probabilities.values()) - 1 / n) / (1 - 1 / n)


def test_a_decision_comes_in_cloudflares_envelope_with_the_hosted_confidence(client):
    """The same answers as /v1/systemone (4 decimals), in {result, success, errors, messages}; the confidence of
    a choice and a score is the hosted (sum p^2 - 1/n) / (1 - 1/n); any account id; the request id as cf-ray."""
    response = run(client)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["success"] is True and body["errors"] == [] and body["messages"] == []
    result = body["result"]
    assert result["model"] == "clef-flash" and result["usage"]["input_tokens"] > 0
    assert response.headers["cf-ray"] == response.headers["x-request-id"]
    ours = client.post("/v1/systemone", json=BODY | {"model": "clef-flash"}, headers=AUTH).json()["answers"]
    assert list(result["answers"]) == list(QUESTIONS)
    assert result["answers"]["outage"] == ours["outage"]
    for qid in ("team", "urgency"):
        hosted, reference = result["answers"][qid], ours[qid]
        assert hosted["probabilities"] == reference["probabilities"]
        assert reference["confidence"] == round(max(reference["probabilities"].values()), 4)
        # From the unrounded probabilities: within the rounding of the four-decimal ones it is computed here from.
        assert abs(hosted["confidence"] - hosted_confidence(hosted["probabilities"])) <= 2e-4, hosted
        assert hosted["confidence"] != reference["confidence"]
    other = run(client, account="any-account", model="clef-flash")
    assert other.status_code == 200 and other.json()["result"]["answers"] == result["answers"]


def test_the_model_in_the_body_is_the_paths(client):
    response = run(client, BODY | {"model": "clef"})
    assert response.status_code == 200 and response.json()["result"]["model"] == "clef-flash"


@pytest.mark.parametrize(
    ("case", "status", "code", "words"),
    [
        ("no questions", 400, 5006, ["questions"]),
        ("an empty questions object", 400, 5006, ["questions"]),
        ("an unknown question type", 400, 5006, ["questions.q"]),
        ("a box question", 400, 5006, ["box"]),
        ("no route for the model", 400, 7000, ["@cf/cloudflare/llama-3", "@cf/cloudflare/clef-flash"]),
        ("a body that is not JSON", 400, 6003, ["JSON"]),
        ("65 questions", 422, 5012, ["64"]),
        ("a fifth image", 422, 5012, ["images"]),
        ("an unknown field", 422, 5012, ["temperature"]),
        ("a state over the context", 413, 5021, ["4096"]),
        ("an unknown token", 401, 10000, []),
        ("no token", 401, 10000, []),
    ],
)
def test_each_documented_error_has_its_status_code_and_envelope(client, case, status, code, words):
    one = {"q": {"type": "noul"}}
    image = data_url(png(8, 8, 0))
    sends = {
        "no questions": lambda: run(client, {"state": "x"}),
        "an empty questions object": lambda: run(client, {"state": "x", "questions": {}}),
        "an unknown question type": lambda: run(client, {"state": "x", "questions": {"q": {"type": "rank"}}}),
        "a box question": lambda: run(client, {"state": "x", "questions": {"q": {"type": "box"}}}),
        "no route for the model": lambda: run(client, model="llama-3"),
        "a body that is not JSON": lambda: client.post(
            ROUTE.format(account="a", model="clef-flash"), content=b"{not json", headers=AUTH
        ),
        "65 questions": lambda: run(
            client, {"state": "x", "questions": {f"q{i}": {"type": "noul"} for i in range(65)}}
        ),
        "a fifth image": lambda: run(client, {"state": "x", "questions": one, "images": [image] * 5}),
        "an unknown field": lambda: run(client, {"state": "x", "questions": one, "temperature": 0.2}),
        "a state over the context": lambda: run(client, {"state": "word " * 6000, "questions": one}),
        "an unknown token": lambda: run(client, headers={"Authorization": "Bearer wrong"}),
        "no token": lambda: run(client, headers={}),
    }
    assert_failure(sends[case](), status, code, *words)


def test_a_full_queue_is_429_3040_with_retry_after(decider):
    """Our 503 overload (the queue full) is the hosted API's capacity error there, Retry-After kept."""

    engine = GatedEngine(decider, EngineConfig(max_model_len=4096, kv_fraction=0.05, max_queue=1))
    with TestClient(create_app(ServerSettings(), engine=engine, warm_up=False)) as c:
        first = engine.submit(BODY | {"model": "clef-flash"})  # takes the one queue place
        response = run(c, headers={})
        assert_failure(response, 429, 3040, "queue")
        assert response.headers["retry-after"] == "1"
        engine.gate.set()
        assert first.future.result(60)["answers"]["outage"]["type"] == "noul"


def test_images_in_both_hosted_forms_answer_as_on_v1_systemone():
    """A release with a vision tower: an image as a data URL and as {content_type, base64}, the same answers as
    /v1/systemone's (but for the confidence)."""
    import base64

    release = vision_release()
    decider = Decider.from_release(release, device="cpu", progress=False)
    blob = png(64, 48, 3)
    url = data_url(blob)
    obj = {"content_type": "image/png", "base64": base64.b64encode(blob).decode()}
    body = {"state": "What is shown?", "questions": {"q": {"type": "noul", "instructions": "A cat?"}}}
    with TestClient(create_app(ServerSettings(), engine=make_engine(decider))) as c:
        ours = c.post("/v1/systemone", json=body | {"model": "clef-flash", "images": [url]}).json()
        for image in (url, obj):
            response = run(c, body | {"images": [image]}, headers={})
            assert response.status_code == 200, response.text
            assert response.json()["result"]["answers"] == ours["answers"]


def test_cloudflares_own_sdk_runs_the_models_here_by_its_base_url_alone(decider):
    """Cloudflare's official Python client (`cloudflare`, as code written against the hosted API calls it),
    untouched but for its base URL, against a live server: `client.ai.run` returns the unwrapped result, and a
    refusal is the SDK's typed error with our code in its body."""
    import cloudflare
    from live import live_server

    settings = ServerSettings(api_key=KEY)
    with live_server(make_engine(decider), settings) as (url, _):
        client = cloudflare.Cloudflare(api_token=KEY, base_url=f"{url}/client/v4", max_retries=0)
        result = client.ai.run(
            "@cf/cloudflare/clef-flash", account_id="023e105f4ecef8ad9ca31a8372d0c353", extra_body=BODY
        )
        assert result["model"] == "clef-flash" and list(result["answers"]) == list(QUESTIONS)
        team = result["answers"]["team"]
        assert abs(team["confidence"] - hosted_confidence(team["probabilities"])) <= 2e-4
        with pytest.raises(cloudflare.BadRequestError) as refused:
            client.ai.run("@cf/cloudflare/llama-3", account_id="a", extra_body=BODY)
        assert refused.value.body["errors"][0]["code"] == 7000  # the SDK's error carries the envelope's errors
        with pytest.raises(cloudflare.AuthenticationError):
            cloudflare.Cloudflare(api_token="wrong", base_url=f"{url}/client/v4", max_retries=0).ai.run(
                "@cf/cloudflare/clef-flash", account_id="a", extra_body=BODY
            )


class FailingEngine(Engine):
    """An engine whose every step raises `error`: a model error (500 on /v1/systemone) or a step out of memory
    (503 with Retry-After there)."""

    def __init__(self, *args, error: BaseException, **kwargs):
        super().__init__(*args, **kwargs)
        self.error = error

    def _step(self):
        raise self.error


def failing_selfcheck(*args, passed: bool = False, **kwargs):
    from clef_cuda.verification.selfcheck import Check, SelfCheckReport

    return SelfCheckReport("cpu", "float32", 0.0, (Check("injected.k", 0.0 if passed else 1.0, 1e-5),))


INFERENCE_FAILURES = {
    # case: (how the engine fails, what /v1/systemone answers (its contract, unchanged), words of the message)
    "a shadow mismatch (enforce)": ("shadow", 503, "service_unavailable", ["injected shadow mismatch"]),
    "a failed timed self-check": ("timed selfcheck", 503, "service_unavailable", ["self-check FAILED", "injected.k"]),
    "a failed start-up self-check": ("start-up selfcheck", 503, "service_unavailable", ["injected.k"]),
    "a model error": ("model error", 500, "internal_error", ["injected model error"]),
    "a step out of memory": ("out of memory", 503, "service_unavailable", ["injected out of memory"]),
}


@pytest.mark.parametrize("case", list(INFERENCE_FAILURES))
def test_an_inference_failure_is_529_5012_and_v1_systemone_keeps_its_contract(decider, monkeypatch, case):
    """Each way the engine fails to answer: 529 with code 5012 in the envelope on this route (Retry-After kept
    where our answer has one); /v1/systemone still answers its own status and `{"detail": {...}}` body."""
    how, v1_status, v1_type, words = INFERENCE_FAILURES[case]
    settings = ServerSettings(selfcheck="enforce" if how in ("start-up selfcheck", "timed selfcheck") else "off")
    if how == "model error":
        engine = FailingEngine(decider, engine_config(), error=RuntimeError("injected model error"))
    elif how == "out of memory":
        engine = FailingEngine(decider, engine_config(), error=torch.OutOfMemoryError("injected out of memory"))
    else:
        engine = make_engine(decider)
    if how == "start-up selfcheck":
        monkeypatch.setattr(server_module, "run_selfcheck", failing_selfcheck)
    if how == "timed selfcheck":  # passes at start-up, fails on the timer
        monkeypatch.setattr(server_module, "run_selfcheck", lambda *a, **k: failing_selfcheck(passed=True))
    with TestClient(create_app(settings, engine=engine, warm_up=False)) as c:
        if how == "shadow":  # the engine's hooks, as the lifecycle wired them
            engine.shadow.on_mismatch(3, "3 shadow mismatches: injected shadow mismatch")
        if how == "timed selfcheck":
            engine.on_timed_selfcheck_failed(failing_selfcheck())
        error = assert_failure(run(c, headers={}), 529, 5012, *words)
        v1 = c.post("/v1/systemone", json=BODY | {"model": "clef-flash"})
        assert v1.status_code == v1_status, v1.text
        assert v1.json()["detail"]["error_type"] == v1_type and v1.json()["detail"]["message"] == error["message"]
        if v1_status == 503:
            assert run(c, headers={}).headers["retry-after"] == v1.headers["retry-after"]


def test_a_server_still_loading_stays_503_3040_with_retry_after(decider):
    """Not an inference failure: the engine is not there yet (nor while draining), come back."""
    release = threading.Event()

    def load():
        release.wait(60)
        return make_engine(decider)

    with TestClient(create_app(ServerSettings(selfcheck="off"), load_engine=load, warm_up=False)) as c:
        try:
            response = run(c, headers={})
            assert_failure(response, 503, 3040, "loading")
            assert response.headers["retry-after"]
        finally:
            release.set()
