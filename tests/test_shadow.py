"""Shadow verification (clef_cuda.verification.shadow): answered records re-decided on the reference ops while the
engine is idle. A fault that fires only past 3,000 context tokens passes the start-up self-check and is
caught by the first long record: /ready turns 503 naming the shadow check, /health stays 200, decisions
are refused, the metrics count it. Healthy kernels give no mismatch over 200 records (text, images,
variants); under a saturating load no shadow chunk runs beside real work and samples are dropped and
counted; a sample costs one record's memory; the self-check also runs on a timer."""

from __future__ import annotations

import logging
import math
import random
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from adapter_fixtures import checkpoint
from fastapi.testclient import TestClient
from faults import HeadReadFault, LayerFaultOps, LongContextFaultOps, OpFault
from images import data_url, png
from live import wait_until
from prometheus_client.parser import text_string_to_metric_families
from random_requests import random_request
from releases import TINY_PAST_TRAINING, tiny_release

from app.server import ServerSettings, create_app
from clef_cuda import Decider
from clef_cuda.model.adapters import AdapterRegistry
from clef_cuda.model.trunk_cache import TrunkCache
from clef_cuda.serving.engine import Engine, EngineConfig
from clef_cuda.verification import shadow as shadow_module
from clef_cuda.verification.selfcheck import run_selfcheck
from clef_cuda.verification.shadow import ShadowConfig

LONG_STATE = " ".join(f"line {i}: order {i * 7} shipped" for i in range(260))  # ~4.5k tokens
SHORT = {"model": "clef-flash", "state": "Checkout fails for everyone.", "questions": {"outage": {"type": "noul"}}}
LONG = {"model": "clef-flash", "state": LONG_STATE, "questions": {"late": {"type": "noul", "instructions": "Late?"}}}


def decider(ops=None) -> Decider:
    return Decider.from_release(tiny_release(), device="cpu", progress=False, ops=ops, **TINY_PAST_TRAINING)


def engine_with(d: Decider, registry=None, **shadow) -> Engine:
    config = EngineConfig(
        max_model_len=8192, allow_long_context=True, kv_fraction=0.05, shadow=ShadowConfig(**({"rate": 1.0} | shadow))
    )
    return Engine(d, config, registry)


def verdicts(engine: Engine) -> int:
    s = engine.shadow.stats
    return s.match + s.marginal + s.mismatch + s.dropped


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
        with caplog.at_level(logging.ERROR, logger="clef_cuda.verification.shadow"):
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
        assert metrics["clef_shadow_max_abs_error"] > engine.shadow.tolerance
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


def judged(engine: Engine) -> list:
    """Every ShadowResult the engine's shadow judges, in order."""
    results, judge = [], engine.shadow._judge

    def keep(result):
        results.append(result)
        return judge(result)

    engine.shadow._judge = keep
    return results


def test_healthy_kernels_give_no_mismatch_over_200_records_with_images_and_variants():
    d = decider()
    registry = AdapterRegistry(d.config, d.trunk.lm_head, d.trunk.dtype)
    registry.load("tuned", checkpoint("all"))
    engine = engine_with(d, registry)
    results = judged(engine)
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
    assert (stats.match, stats.mismatch, stats.marginal, stats.dropped) == (200, 0, 0, 0), stats
    assert registry.get("tuned").users == 0  # every sample let go of its hold on the variant
    # The bounds, derived here from fp32's unit roundoff and the roundings clef_cuda.verification.shadow states, not
    # taken from its functions; each record's measured drift is data. The head's means against its tokens' rows:
    # the head's sum and the sketches' mean (a rounding a token each), its division, the sketches' buckets (64 / 32
    # coordinates each, in the mean's sketch and the tokens').
    u, hidden, depth = 2.0**-24, d.config.trunk.hidden_size, d.config.trunk.num_layers
    head_layers = d.config.head.routing_layers + d.config.head.layers + 2
    for result in results:
        assert result.head_inputs and result.first_bad_layer is None
        for check in result.head_inputs:
            assert check.error <= 4 * math.sqrt(1 + 2 * check.tokens + 2 * hidden / 32) * u, check
        # The probabilities: what the head was handed (at least depth's roundings, sqrt(5 depth) u; the drift its
        # rows were measured to carry, no more than the last layer's tolerance) and its own layers' roundings.
        handed = max(math.sqrt(5 * depth) * u, min(result.head_drift, result.last_layer_allowed))
        bound = 4 * (handed + math.sqrt(5 * head_layers) * u)
        assert result.tolerance == pytest.approx(bound, rel=1e-9)
        assert 0 <= result.max_abs_error <= bound, (result.max_abs_error, bound)
    assert stats.max_abs_error > 0  # the two sides did differ: the bounds above were exercised


def test_under_load_no_shadow_chunk_runs_beside_real_work_and_the_samples_wait(monkeypatch):
    """40 records at once, every one sampled, no floor: a shadow chunk only ever runs with nothing queued or
    running; the samples wait (SHADOW_QUEUE of them; the rest are dropped and counted) and are verified once the
    load is gone; the answers are the shadow-less ones."""
    d = decider()
    engine = engine_with(d, min_interval=None)
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
    stats = engine.shadow.stats
    assert busy_steps and set(busy_steps) == {0}
    assert stats.mismatch == 0 and stats.match >= shadow_module.SHADOW_QUEUE and stats.dropped == 40 - stats.match
    plain = engine_with(d, mode="off")
    plain.start()
    try:
        for request, body in zip(requests, shadowed, strict=True):
            assert plain.decide(request, timeout=300)["answers"] == body["answers"]  # never changed
    finally:
        plain.stop(30)


def test_a_sequential_client_gets_every_record_verified():
    """12 requests one after the other at --shadow-rate 1, every fourth ~4,500 tokens, the client reading each
    answer for 50 ms: a sample paused by the next request resumes at the next idle turn instead of being
    dropped, so every record is verified."""
    engine = engine_with(decider())
    engine.start()
    try:
        for i in range(12):
            request = LONG if i % 4 == 3 else random_request(random.Random(300 + i), null_score_levels=False)
            engine.decide(request, timeout=300)
            time.sleep(0.05)
        wait_until(lambda: verdicts(engine) == 12, "every record's verdict")
    finally:
        engine.stop(30)
    stats = engine.shadow.stats
    assert (stats.match, stats.mismatch, stats.dropped) == (12, 0, 0), stats
    assert stats.resumed > 0  # long samples were paused by the next request and resumed


def test_the_floor_verifies_under_a_saturating_load_within_its_share_of_step_time(monkeypatch):
    """No idle turn at all (40 records submitted at once, then more as each answers): with a short
    --shadow-min-interval the steps give the shadow run chunks, records are verified during the load, and the
    shadow's time stays within SHADOW_FLOOR_SHARE of the steps' (plus the one chunk that crossed it). The floor's
    chunks are the idle lane's 256 tokens here (a ~500-token sample in two), so that a few seconds of load see
    records through; the server's 32-token ones take ~16 floor chunks a sample."""
    from clef_cuda.serving import engine as engine_module

    monkeypatch.setattr(engine_module, "SHADOW_FLOOR_CHUNK_TOKENS", shadow_module.SHADOW_CHUNK_TOKENS)
    engine = engine_with(decider(), min_interval=0.05)
    chunk_times, real_spent = [], engine.shadow.floor_spent

    def spent(seconds):
        chunk_times.append(seconds)
        real_spent(seconds)

    engine.shadow.floor_spent = spent
    engine.shadow._last_finished -= 1.0  # as if the interval had passed at start-up
    engine.start()
    try:

        def short(i: int) -> dict:  # ~500 tokens with the release's template
            return {
                "model": "clef-flash",
                "state": f"order {i} shipped on day {i % 7}",
                "questions": {"late": {"type": "noul", "instructions": "Is it late?"}},
            }

        pending = [engine.submit(short(i)) for i in range(40)]
        verified_under_load = 0
        for i in range(40, 600):
            if engine.shadow.stats.match:
                verified_under_load = engine.shadow.stats.match
                break
            pending.pop(0).future.result(300)
            pending.append(engine.submit(short(i)))
        for ticket in pending:
            ticket.future.result(300)
    finally:
        engine.stop(30)
    stats = engine.shadow.stats
    assert verified_under_load >= 1 and stats.floor_chunks == len(chunk_times) > 0, (verified_under_load, stats)
    # Each engagement of the floor overshoots by at most the chunk that crossed its budget.
    assert stats.floor_shadow_seconds <= shadow_module.SHADOW_FLOOR_SHARE * stats.floor_step_seconds + (
        (stats.match + 1) * max(chunk_times)
    )


def test_a_sample_borrows_free_blocks_and_its_own_slot_and_gives_them_back(monkeypatch):
    """A shadow run allocates nothing: the engine lends it its shadow state slot and free KV blocks, and has
    every one back once the verdict is in."""
    allocations = []
    real = TrunkCache.allocate

    def recorded(config, slots, blocks, *args, **kwargs):
        allocations.append((slots, blocks))
        return real(config, slots, blocks, *args, **kwargs)

    engine = engine_with(decider())  # its own pools first, then only the shadow's allocations are recorded
    assert engine.cache.num_slots == engine.plan.running_slots + engine.plan.snapshot_slots + 1
    monkeypatch.setattr(TrunkCache, "allocate", staticmethod(recorded))
    lent = []
    real_lend = engine.lend_to_shadow

    def lend(blocks_needed):
        got = real_lend(blocks_needed)
        lent.append(None if got is None else (got[1], len(got[2])))
        return got

    engine.lend_to_shadow = lend
    engine.start()
    try:
        record = engine.decider.encode(LONG)
        engine.decide(LONG, timeout=300)
        wait_until(lambda: verdicts(engine) >= 1, "the shadow verdict")
        assert engine.shadow.stats.match == 1
        assert engine.blocks.used == engine.prefix_cache.blocks_held
        assert engine.running_slots.available == engine.plan.running_slots
    finally:
        engine.stop(30)
    assert allocations == [] and lent == [(engine.shadow_slot, -(-record.num_tokens // 16))]


def test_real_work_takes_the_shadow_runs_blocks_back_and_the_run_starts_over(monkeypatch):
    """A pool with room for one long record and a little more: a second long request arriving while the first
    one's shadow run holds the blocks gets them (the run gives them back and starts over later), and both
    records are still verified."""
    from dataclasses import replace

    from clef_cuda.serving import engine as engine_module

    d = decider()
    need = -(-d.encode(LONG).num_tokens // 16)
    real_plan = engine_module.plan_memory
    monkeypatch.setattr(
        engine_module, "plan_memory", lambda *a, **k: replace(real_plan(*a, **k), num_blocks=need + 8, snapshot_slots=0)
    )
    engine = engine_with(d, min_interval=None)
    started = threading.Event()
    real_step = engine.shadow.step

    def step(*args, **kwargs):
        result = real_step(*args, **kwargs)
        if engine.shadow._run is not None:
            started.set()
            time.sleep(0.05)  # a slow reference: the second request arrives mid-run
        return result

    engine.shadow.step = step
    engine.start()
    try:
        engine.decide(LONG, timeout=300)
        assert started.wait(60)
        other = dict(LONG, state=LONG_STATE.replace("shipped", "delayed"))
        engine.decide(other, timeout=300)
        wait_until(lambda: verdicts(engine) >= 2, "both verdicts")
    finally:
        engine.stop(30)
    stats = engine.shadow.stats
    assert stats.restarted >= 1 and (stats.match, stats.mismatch, stats.dropped) == (2, 0, 0), stats


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
    from app.cli.flags import _duration

    assert _duration("1h") == 3600 and _duration("30m") == 1800 and _duration("90s") == 90 and _duration("45") == 45
    assert _duration("off") is None


def test_threads_never_share_a_sample(monkeypatch):
    """offer() from the head thread while the scheduler takes: SHADOW_QUEUE samples wait, the rest dropped."""
    v = engine_with(decider()).shadow
    released = []
    monkeypatch.setattr(v, "release", lambda adapter: released.append(adapter))
    count = shadow_module.SHADOW_QUEUE + 8
    samples = [SimpleNamespace(adapter=None, fingerprint=None) for _ in range(count)]
    threads = [threading.Thread(target=v.offer, args=(sample,)) for sample in samples]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert v.has_work and v.stats.dropped == 8 and len(released) == 8


def test_waiting_samples_are_bounded_by_their_fingerprints_memory(monkeypatch):
    """A sample whose fingerprint would take the waiting ones past SHADOW_QUEUE_BYTES is dropped (counted, its
    variant let go), however short the queue."""
    monkeypatch.setattr(shadow_module, "SHADOW_QUEUE_BYTES", 10_000)
    v = engine_with(decider()).shadow
    released = []
    monkeypatch.setattr(v, "release", lambda adapter: released.append(adapter))
    for _ in range(5):
        v.offer(SimpleNamespace(adapter="tuned", fingerprint=SimpleNamespace(nbytes=lambda: 4_000)))
    assert len(v._waiting) == 2 and v.stats.dropped == 3 and released == ["tuned"] * 3


def load_shadow_power():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "shadow_power", Path(__file__).parents[1] / "benchmarks" / "shadow_power.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("kind", LayerFaultOps.KINDS)
def test_each_fault_kind_is_caught_in_f16_and_bf16_and_named_by_layer(kind, dtype):
    """Each kind of kernel fault, in one layer, at 5% where it has a size (tests/faults.py LayerFaultOps): the
    served records' layer fingerprints differ from the reference's at that layer first, so the mismatch names it
    and its kind; the same records without the fault match (benchmarks/shadow_power.py has the smallest sizes)."""
    power = load_shadow_power()
    release = tiny_release()
    config = Decider.from_release(release, device="cpu", progress=False).config.trunk
    records = power.requests(3)
    layer = power.middle(config, kind)
    fault = LayerFaultOps(kind, 0.05, layer=layer, past=power.PAST, key_dim=config.key_dim)
    quantize = "int8" if kind == "int8_scale_off" else "none"
    outcome = power.run(release, power.DTYPES[dtype], records, fault, quantize)
    expected = f"layer {power.faulted_layer(config, kind, layer)} ({power.LAYER_KIND[kind]})"
    assert outcome.mismatches > 0 and outcome.named, (outcome, expected)
    assert power.run(release, power.DTYPES[dtype], records, None, quantize).mismatches == 0


def test_a_shadow_run_that_cannot_start_gives_back_its_blocks_and_its_hold(monkeypatch):
    """A sample whose run fails to start after the engine lent it KV blocks (its head's buffers, the vision tower:
    an out-of-memory) is dropped and counted, and gives back every lent block and its hold on the variant; the
    next sample runs. (The run once kept both for the life of the process, unseen by clef_shadow_kv_blocks.)"""
    import torch

    d = decider()
    registry = AdapterRegistry(d.config, d.trunk.lm_head, d.trunk.dtype)
    registry.load("tuned", checkpoint("all"))
    engine = engine_with(d, registry)
    real_start = shadow_module.ShadowRun._start
    failures = []

    def start_once_out_of_memory(self, *args):
        if not failures:
            failures.append(self.blocks)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.40 GiB (test-only)")
        return real_start(self, *args)

    monkeypatch.setattr(shadow_module.ShadowRun, "_start", start_once_out_of_memory)
    engine.start()
    try:
        engine.decide(SHORT | {"model": "tuned"}, timeout=300)
        wait_until(lambda: verdicts(engine) == 1, "the failed sample's verdict")
        assert engine.shadow.stats.dropped == 1 and failures and failures[0]  # it had been lent blocks
        assert engine.blocks.used == engine.prefix_cache.blocks_held and engine.shadow.lent_blocks == 0
        assert registry.get("tuned").users == 0
        engine.decide(SHORT | {"model": "tuned"}, timeout=300)
        wait_until(lambda: verdicts(engine) == 2, "the next sample's verdict")
        assert engine.shadow.stats.match == 1
    finally:
        engine.stop(30)
    assert registry.get("tuned").users == 0


def test_a_refused_request_lets_go_of_its_variant_whatever_refused_it():
    """Submitting to an engine whose GPU faulted (on the idle lane, say) is refused, and the request's hold on its
    variant is let go, as a full queue's or a draining engine's refusal does."""
    from clef_cuda.serving.engine import EngineStoppedError, QueueFullError
    from clef_cuda.verification.guarded_ops import KernelFault

    d = decider()
    registry = AdapterRegistry(d.config, d.trunk.lm_head, d.trunk.dtype)
    registry.load("tuned", checkpoint("all"))
    engine = Engine(d, EngineConfig(max_model_len=4096, kv_fraction=0.05, max_queue=0), registry)
    with pytest.raises(QueueFullError):
        engine.submit(SHORT | {"model": "tuned"})
    engine.kernel_fault = KernelFault("silu_mul:cuda", "CUDA error: an illegal memory access was encountered")
    with pytest.raises(EngineStoppedError):
        engine.submit(SHORT | {"model": "tuned"})
    assert registry.get("tuned").users == 0


def test_enforcement_is_in_proportion_a_probability_just_past_its_tolerance_is_marginal(caplog):
    """Probabilities past their tolerance with every layer's fingerprint matched: up to 10x it, marginal (a warning
    and a count; /ready stays 200); three marginals in twenty verdicts, or probabilities 10x past, or any layer past
    its own tolerance: a mismatch, which enforce mode turns into /ready 503 at --shadow-max-mismatches."""
    from clef_cuda.verification.shadow import MARGINAL_FACTOR, LayerCheck, ShadowResult, ShadowVerifier

    record = SimpleNamespace(questions=[], num_tokens=10)
    sample = SimpleNamespace(request_id="r", record=record, adapter=None, request={"questions": {}}, served=[])

    handed_on: dict[int, list[str]] = {}  # by verifier: the reasons of the mismatches it handed on

    def verdict(verifier, dp, layers=()):
        """The stats after one verdict, and the reason of the latest mismatch handed on (None: none yet)."""
        reasons = handed_on.setdefault(id(verifier), [])
        verifier.on_mismatch = lambda count, reason: reasons.append(reason)
        verifier._judge(ShadowResult(sample, [], dp, "q", list(layers)))
        return verifier.stats, reasons[-1] if reasons else None

    verifier = ShadowVerifier(ShadowConfig(rate=1.0), torch.float32, lambda adapter: None, depth=4)
    tolerance = verifier.tolerance
    with caplog.at_level(logging.WARNING, logger="clef_cuda.verification.shadow"):
        stats, failure = verdict(verifier, 2 * tolerance)
    assert (stats.marginal, stats.mismatch, failure) == (1, 0, None) and "marginal" in caplog.text
    for _ in range(5):
        verdict(verifier, tolerance / 2)
    stats, failure = verdict(verifier, 3 * tolerance)
    assert (stats.marginal, stats.mismatch, failure) == (2, 0, None)
    stats, failure = verdict(verifier, 3 * tolerance)  # the third in twenty: a pattern, one mismatch
    assert (stats.marginal, stats.mismatch) == (3, 1) and "marginal difference" in failure

    far = ShadowVerifier(ShadowConfig(rate=1.0), torch.float32, lambda adapter: None, depth=4)
    stats, failure = verdict(far, 1.01 * MARGINAL_FACTOR * far.tolerance)
    assert (stats.marginal, stats.mismatch) == (0, 1) and "the head" in failure
    layer = ShadowVerifier(ShadowConfig(rate=1.0), torch.float32, lambda adapter: None, depth=4)
    drifted = LayerCheck(2, "MLP", error=2e-4, tolerance=1e-4)  # twice its tolerance, probabilities all but equal
    stats, failure = verdict(layer, 0.0, [drifted])
    assert (stats.marginal, stats.mismatch) == (0, 1) and "layer 2 (MLP)" in failure


def test_the_tolerances_are_the_numbers_derived_by_hand():
    """Each tolerance at clef-tiny's (5) and clef-flash's (32) depth, computed here from u and the stated
    roundings: the probabilities' 4 sqrt(5 depth) u with no floor in any dtype; fp32's record tolerance from the
    drift measured, capped by the last layer's tolerance; the head's reads from the head's and the sketches'
    roundings."""
    from clef_cuda.verification.shadow import head_read_tolerance, probability_tolerance, record_probability_tolerance

    f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
    assert probability_tolerance(f16, 5) == pytest.approx(9.77e-3, rel=1e-3)  # 4 x 5 x 2^-11
    assert probability_tolerance(f16, 32) == pytest.approx(2.470e-2, rel=1e-3)  # 4 x sqrt(160) x 2^-11
    assert probability_tolerance(bf16, 5) == pytest.approx(7.81e-2, rel=1e-3)
    assert probability_tolerance(bf16, 32) == pytest.approx(0.1976, rel=1e-3)
    assert probability_tolerance(f32, 5) == pytest.approx(1.19e-6, rel=1e-2)  # 4 x 5 x 2^-24: no floor
    # fp32: a record whose rows drifted 3e-7 (clef-tiny's head: 2 routing + 2 decoder layers + 2 stages)
    assert record_probability_tolerance(f32, 5, 3e-7, 1e-4, f32, 6) == pytest.approx(4 * (3e-7 + 30**0.5 * 2**-24))
    # ... one whose drifted 1.8e-3 (the test mix's variant), held to what the last layer may carry (1e-4)
    assert record_probability_tolerance(f32, 5, 1.8e-3, 1e-4, f32, 6) == pytest.approx(4 * (1e-4 + 30**0.5 * 2**-24))
    # f16: the depth's roundings bound any healthy drift measured
    flash_f16 = record_probability_tolerance(f16, 32, 1e-3, None, f32, 6)
    assert flash_f16 == pytest.approx(2.470e-2 + 4 * 30**0.5 * 2**-24, rel=1e-3)
    # The head's reads, fp32 head: an option of 70 tokens at clef-tiny's hidden 64; the last row at clef-flash's 4096
    assert head_read_tolerance(f32, 70, 64) == pytest.approx(4 * 145**0.5 * 2**-24)  # 2.9e-6
    assert head_read_tolerance(f32, 1, 4096) == pytest.approx(4 * 259**0.5 * 2**-24)  # 3.8e-6
    assert head_read_tolerance(f16, 1, 4096) == pytest.approx(4 * 259**0.5 * 2**-11)  # a head served in f16


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("kind", HeadReadFault.KINDS)
def test_a_fault_in_what_the_head_read_is_caught_in_f16_and_bf16(kind, dtype):
    """The first option's row read x 1.02 by the head, or the first question's span read a token early, on the
    served pass only: every layer's fingerprint matches (the trunk computed right), and the scaled option's
    probabilities stay within their tolerance (the check that alone judged the head could not flag it); the
    head-input check does, by 1,000x or more, naming the span. (tests/test_shadow.py's healthy records hold it
    to its tolerance with a margin of 30x or more.)"""
    power = load_shadow_power()  # puts benchmarks/ on the path
    from shadow_tolerance import decide_each_and_wait

    d = Decider.from_release(tiny_release(), device="cpu", dtype=power.DTYPES[dtype], progress=False)
    engine = Engine(
        d,
        EngineConfig(
            max_model_len=8192, allow_long_context=True, kv_fraction=0.05, shadow=ShadowConfig(rate=1.0, mode="warn")
        ),
    )
    results = judged(engine)
    fault = HeadReadFault(kind, 0.02).attach(engine)
    engine.start()
    try:
        stats = decide_each_and_wait(engine, power.requests(3))
    finally:
        engine.stop(30)
    assert fault.hits and (stats.mismatch, stats.dropped) == (3, 0), stats
    for result in results:
        bad = result.first_bad_head_input
        assert result.first_bad_layer is None and bad is not None, result.layers
        assert bad.what.startswith("option" if kind == "option_scaled" else "question") and bad.tokens > 0
        assert bad.error > 1000 * bad.tolerance, bad  # measured: 1,400x (an option's mean) to 10^6x
        if kind == "option_scaled":
            assert result.max_abs_error <= result.tolerance
    assert stats.last_mismatch["kind"] == "head" and stats.last_mismatch["check"] == "head input"
