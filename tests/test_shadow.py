"""Shadow verification (clef_cuda.serving.shadow): answered records re-decided on the reference ops while the
engine is idle. A fault that fires only past 3,000 context tokens passes the start-up self-check and is
caught by the first long record: /ready turns 503 naming the shadow check, /health stays 200, decisions
are refused, the metrics count it. Healthy kernels give no mismatch over 200 records (text, images,
variants); under a saturating load no shadow chunk runs beside real work and samples are dropped and
counted; a sample costs one record's memory; the self-check also runs on a timer."""

from __future__ import annotations

import logging
import random
import threading
from types import SimpleNamespace

import pytest
from adapter_fixtures import checkpoint
from fastapi.testclient import TestClient
from faults import LongContextFaultOps, OpFault
from images import data_url, png
from live import wait_until
from prometheus_client.parser import text_string_to_metric_families
from random_requests import random_request
from releases import tiny_release

from app.server import ServerSettings, create_app
from clef_cuda import Decider
from clef_cuda.model.adapters import AdapterRegistry
from clef_cuda.serving import shadow as shadow_module
from clef_cuda.serving.engine import Engine, EngineConfig
from clef_cuda.serving.selfcheck import run_selfcheck
from clef_cuda.serving.shadow import SHADOW_TOLERANCE, ShadowConfig

LONG_STATE = " ".join(f"line {i}: order {i * 7} shipped" for i in range(260))  # ~4.5k tokens
SHORT = {"model": "clef-flash", "state": "Checkout fails for everyone.", "questions": {"outage": {"type": "noul"}}}
LONG = {"model": "clef-flash", "state": LONG_STATE, "questions": {"late": {"type": "noul", "instructions": "Late?"}}}


def decider(ops=None) -> Decider:
    return Decider.from_release(tiny_release(), device="cpu", progress=False, ops=ops)


def engine_with(d: Decider, registry=None, **shadow) -> Engine:
    config = EngineConfig(max_model_len=8192, kv_fraction=0.05, shadow=ShadowConfig(**({"rate": 1.0} | shadow)))
    return Engine(d, config, registry)


def verdicts(engine: Engine) -> int:
    s = engine.shadow.stats
    return s.match + s.mismatch + s.dropped


def shadow_metrics(client) -> dict[str, float]:
    text = client.get("/metrics").text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    checks = {s.labels["result"]: s.value for s in samples if s.name == "clef_shadow_checks_total"}
    return checks | {
        s.name: s.value for s in samples if s.name in ("clef_shadow_max_abs_error", "clef_shadow_tolerance")
    }


def test_the_long_context_fault_passes_the_start_up_self_check():
    assert decider(LongContextFaultOps()).trunk.with_ops(LongContextFaultOps()) is not None
    assert run_selfcheck(decider(LongContextFaultOps()).trunk).passed  # its contexts are short


def test_a_fault_past_3000_tokens_turns_ready_503_at_the_first_long_record(caplog):
    engine = engine_with(decider(LongContextFaultOps()))
    with TestClient(create_app(ServerSettings(), engine=engine)) as client:
        assert client.post("/v1/systemone", json=SHORT).status_code == 200
        wait_until(lambda: verdicts(engine) >= 2, "the short records' shadow verdicts")  # the warm-up's and SHORT's
        assert client.get("/ready").status_code == 200
        with caplog.at_level(logging.ERROR, logger="clef_cuda.serving.shadow"):
            served = client.post("/v1/systemone", json=LONG, headers={"X-Request-Id": "req-long-1"})
            assert served.status_code == 200 and served.json()["usage"]["input_tokens"] > 3000  # answered, wrongly
            wait_until(lambda: client.get("/ready").status_code == 503, "/ready to turn 503 (one idle period)")
        ready = client.get("/ready").json()
        assert ready["status"] == "verification_failed" and "shadow verification failed" in ready["detail"]["message"]
        assert "req-long-1" in ready["detail"]["message"] and ready["shadow"]["mismatch"] == 1
        assert client.get("/health").status_code == 200  # alive: Kubernetes takes it out of rotation, no restart
        refused = client.post("/v1/systemone", json=SHORT)
        assert refused.status_code == 503 and "shadow verification failed" in refused.json()["detail"]["message"]
        metrics = shadow_metrics(client)
        assert metrics["mismatch"] == 1 and metrics["match"] >= 1
        assert metrics["clef_shadow_max_abs_error"] > SHADOW_TOLERANCE[engine.decider.trunk.dtype]
        assert {
            s.name: s.value for f in text_string_to_metric_families(client.get("/metrics").text) for s in f.samples
        }["clef_ready"] == 0
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "req-long-1" in logged and "served {" in logged and "reference {" in logged and "'late'" in logged


def test_warn_mode_keeps_serving_and_a_second_mismatch_is_needed_with_max_2():
    warn = engine_with(decider(LongContextFaultOps()), mode="warn")
    with TestClient(create_app(ServerSettings(), engine=warn)) as client:
        client.post("/v1/systemone", json=LONG)
        wait_until(lambda: warn.shadow.stats.mismatch == 1, "the mismatch")
        assert client.get("/ready").status_code == 200 and client.post("/v1/systemone", json=SHORT).status_code == 200
    twice = engine_with(decider(LongContextFaultOps()), max_mismatches=2)
    with TestClient(create_app(ServerSettings(), engine=twice)) as client:
        client.post("/v1/systemone", json=LONG)
        wait_until(lambda: twice.shadow.stats.mismatch == 1, "the first mismatch")
        assert client.get("/ready").status_code == 200
        client.post("/v1/systemone", json=LONG | {"questions": {"q": {"type": "noul"}}})
        wait_until(lambda: client.get("/ready").status_code == 503, "the second mismatch")


def test_off_samples_nothing_and_the_rate_picks_every_nth_record():
    engine = engine_with(decider(), mode="off")
    assert not any(engine.shadow.wants() for _ in range(50))
    tenth = engine_with(decider(), rate=0.1).shadow
    assert [k for k in range(1, 41) if tenth.wants()] == [10, 20, 30, 40]


def test_healthy_kernels_give_no_mismatch_over_200_records_with_images_and_variants():
    d = decider()
    registry = AdapterRegistry(d.config, d.trunk.lm_head, d.trunk.dtype)
    registry.load("tuned", checkpoint("all"))
    engine = engine_with(d, registry)
    engine.start()
    rng = random.Random(5)
    try:
        for i in range(200):
            request = random_request(rng, null_score_levels=False, state_words=(3, 120)) | {"model": "clef-flash"}
            if i % 10 == 3:
                request["images"] = [data_url(png(64 + i, 48, i))]
            if i % 4 == 1:
                request["model"] = "tuned"
            engine.decide(request, timeout=300)
            wait_until(lambda done=i + 1: verdicts(engine) >= done, "the record's shadow verdict")
    finally:
        engine.stop(30)
    stats = engine.shadow.stats
    assert (stats.match, stats.mismatch, stats.dropped) == (200, 0, 0), stats
    assert 0 < stats.max_abs_error <= SHADOW_TOLERANCE[d.trunk.dtype]
    assert registry.get("tuned").users == 0  # every sample let go of its hold on the variant


def test_under_load_no_shadow_chunk_runs_beside_real_work_and_samples_are_dropped(monkeypatch):
    """40 records at once, every one sampled: a shadow chunk only ever runs with nothing queued or running,
    the samples that met real work are dropped and counted, and the answers are the shadow-less ones."""
    d = decider()
    engine = engine_with(d)
    busy_steps = []
    real_step = engine.shadow.step

    def observed(dec):
        busy_steps.append(engine.queue_depth + engine.running)
        return real_step(dec)

    monkeypatch.setattr(engine.shadow, "step", observed)
    requests = [random_request(random.Random(100 + i), null_score_levels=False) for i in range(40)]
    engine.start()
    try:
        tickets = [engine.submit(r) for r in requests]
        shadowed = [t.future.result(300) for t in tickets]
        wait_until(lambda: verdicts(engine) == 40, "every sample's verdict")
    finally:
        engine.stop(30)
    assert busy_steps and set(busy_steps) == {0}
    assert engine.shadow.stats.dropped > 0 and engine.shadow.stats.mismatch == 0
    plain = engine_with(d, mode="off")
    plain.start()
    try:
        for request, body in zip(requests, shadowed, strict=True):
            assert plain.decide(request, timeout=300)["answers"] == body["answers"]  # never changed
    finally:
        plain.stop(30)


def test_a_sample_costs_one_records_memory_and_never_the_engines_pools(monkeypatch):
    allocations = []
    real = shadow_module.TrunkCache.allocate

    def recorded(config, slots, blocks, *args, **kwargs):
        allocations.append((slots, blocks))
        return real(config, slots, blocks, *args, **kwargs)

    engine = engine_with(decider())  # its own pools first, then only the shadow's allocations are recorded
    monkeypatch.setattr(shadow_module.TrunkCache, "allocate", staticmethod(recorded))
    engine.start()
    try:
        record = engine.decider.encode(LONG)
        engine.decide(LONG, timeout=300)
        wait_until(lambda: verdicts(engine) >= 1, "the shadow verdict")
        assert engine.blocks.used == engine.prefix_cache.blocks_held
        assert engine.running_slots.available == engine.plan.running_slots
    finally:
        engine.stop(30)
    assert allocations == [(1, -(-record.num_tokens // 16))]


def test_the_self_check_also_runs_on_a_timer():
    """A fault that appears after start-up (a driver update under a running pod) is caught by the next timed
    self-check, in the idle lane: /ready 503 naming it, the self-check metrics updated."""
    broken = {"on": False}

    def maybe_wrong(original, *args, **kwargs):
        out = original(*args, **kwargs)
        return out.mul_(1.01) if broken["on"] else out

    d = decider(OpFault("gated_delta_rule_recurrent", maybe_wrong))
    config = EngineConfig(max_model_len=4096, kv_fraction=0.05, selfcheck_interval=0.2, shadow=ShadowConfig(mode="off"))
    engine = Engine(d, config)
    with TestClient(create_app(ServerSettings(), engine=engine)) as client:
        wait_until(lambda: engine.selfcheck_report is not None, "the first timed self-check")
        assert engine.selfcheck_report.passed and client.get("/ready").status_code == 200
        broken["on"] = True
        wait_until(lambda: client.get("/ready").status_code == 503, "the timed self-check to fail")
        ready = client.get("/ready").json()
        assert "gated_delta_rule_recurrent" in ready["detail"]["message"] and ready["selfcheck"]["passed"] is False
        assert client.post("/v1/systemone", json=SHORT).status_code == 503
        text = client.get("/metrics").text
        passed = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert passed["clef_selfcheck_passed"] == 0


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--shadow-rate", "1.5"], "--shadow-rate"),
        (["--shadow-mode", "sometimes"], "--shadow-mode"),
        (["--shadow-max-mismatches", "0"], "--shadow-max-mismatches"),
        (["--selfcheck-interval", "soon"], "--selfcheck-interval"),
    ],
)
def test_bad_verification_flags_are_one_line_errors(flags, words):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "app", *flags], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and words in result.stderr, result.stderr


def test_durations_parse():
    from app.cli import _duration

    assert _duration("1h") == 3600 and _duration("30m") == 1800 and _duration("90s") == 90 and _duration("45") == 45
    assert _duration("off") is None


def test_threads_never_share_a_sample(monkeypatch):
    """offer() from the head thread while the scheduler takes: at most one sample waits, the rest dropped."""
    v = engine_with(decider()).shadow
    released = []
    monkeypatch.setattr(v, "release", lambda adapter: released.append(adapter))
    threads = [threading.Thread(target=v.offer, args=(SimpleNamespace(adapter=None),)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert v.has_work and v.stats.dropped == 7
