"""The server's lifecycle (clef_cuda.lifecycle) without HTTP, a model or a device: a fake engine, the autotune and
the self-check replaced by recorders. Each transition, each fail-safe and each refusal; the HTTP mapping of the
same states is tested in test_server.py, the real kernels' faults in test_kernel_trials.py."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from clef_cuda import lifecycle as lifecycle_module
from clef_cuda.lifecycle import (
    EXIT_KERNEL_FAULT,
    EXIT_TENSOR_PARALLEL_LOST,
    Lifecycle,
    LifecycleSettings,
    Phase,
)
from clef_cuda.tuning.autotune import AutotuneReport, cache_file
from clef_cuda.verification.guarded_ops import KernelFault
from clef_cuda.verification.selfcheck import Check, SelfCheckReport
from clef_cuda.verification.shadow import ShadowConfig


def report(passed: bool) -> SelfCheckReport:
    check = Check("gated_delta_rule", 0.0 if passed else 1.0, 1e-3)
    return SelfCheckReport("cpu", "float32", 0.01, (check,))


class FakeEngine:
    """What the lifecycle asks of clef_cuda.serving.engine.Engine, recording what it was told."""

    def __init__(self, on_decide=None, peers=None, adapters=None, shadow: ShadowConfig | None = None) -> None:
        self.decider = SimpleNamespace(trunk=SimpleNamespace(peers=peers))
        self.config = SimpleNamespace(block_size=16, shadow=shadow or ShadowConfig())
        self.adapters = adapters
        self.calls: list[str] = []
        self.on_decide = on_decide
        self.selfcheck_report: SelfCheckReport | None = None
        self.queue_depth = self.running = 0
        self.on_kernel_fault = self.on_timed_selfcheck_failed = None
        self.shadow = SimpleNamespace(on_mismatch=None)  # the engine's ShadowVerifier: its verdicts' hook

    def start(self) -> None:
        self.calls.append("start")

    def decide(self, request: dict, timeout: float) -> dict:
        self.calls.append("decide")
        if self.on_decide is not None:
            self.on_decide()
        return {"model": request["model"]}

    def drain(self) -> None:
        self.calls.append("drain")

    def stop(self, timeout: float) -> None:
        self.calls.append("stop")


class Recorder:
    """The observer, the exit and the phases seen by the autotune and the self-check."""

    def __init__(self) -> None:
        self.ready: list[bool] = []
        self.failed: list[str] = []
        self.exits: list[int] = []
        self.phases: list[Phase] = []
        self.selfchecks: list[SelfCheckReport] = []
        self.tunes: list[AutotuneReport] = []
        self.adapters: list[int] = []

    def observer(self):
        recorder = self

        class Observer:
            def ready(self, ready: bool) -> None:
                recorder.ready.append(ready)

            def failed(self, kind: str) -> None:
                recorder.failed.append(kind)

            def selfcheck(self, report) -> None:
                recorder.selfchecks.append(report)

            def autotune(self, report) -> None:
                recorder.tunes.append(report)

            def adapters_loaded(self, count: int) -> None:
                recorder.adapters.append(count)

        return Observer()


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def tools(monkeypatch, recorder):
    """The autotune and self-check replaced: each records the phase it ran in and does what the test sets."""
    behaviour = SimpleNamespace(tune=lambda: AutotuneReport("fast", {"device": "fake"}), check=lambda: report(True))
    installed: list[AutotuneReport] = []

    def autotune(trunk, config, mode, cache, trials):
        recorder.phases.append(current[0].phase)
        return behaviour.tune()

    def run_selfcheck(trunk, block_size):
        recorder.phases.append(current[0].phase)
        return behaviour.check()

    monkeypatch.setattr(lifecycle_module, "autotune", autotune)
    monkeypatch.setattr(lifecycle_module, "run_selfcheck", run_selfcheck)
    monkeypatch.setattr(lifecycle_module, "install", lambda trunk, report, *rest: installed.append(report))
    current: list[Lifecycle] = []

    def make(**settings) -> Lifecycle:
        made = Lifecycle(
            LifecycleSettings(**settings),
            recorder.observer(),
            exit_later=lambda code, delay: recorder.exits.append(code),
        )
        current[:] = [made]
        return made

    behaviour.make, behaviour.installed = make, installed
    return behaviour


def test_start_walks_every_phase_in_order_and_answers_once_ready(tools, recorder):
    lifecycle = tools.make()
    assert lifecycle.phase is Phase.LOADING and lifecycle.refusal().status == "loading"
    seen_while_warming: list[Phase] = []
    engine = FakeEngine(on_decide=lambda: seen_while_warming.append(lifecycle.phase))
    lifecycle.load(lambda: engine)
    assert recorder.phases == [Phase.TUNING, Phase.SELF_CHECKING] and seen_while_warming == [Phase.WARMING]
    assert lifecycle.phase is Phase.READY and lifecycle.refusal() is None and lifecycle.engine is engine
    assert engine.calls == ["start", "decide"] and recorder.ready == [True] and recorder.exits == []
    assert lifecycle.readiness() == (True, "ready", None)
    assert recorder.selfchecks == [lifecycle.selfcheck] and recorder.tunes == [lifecycle.autotune]
    lifecycle.shutdown()
    assert lifecycle.phase is Phase.DRAINING and engine.calls[-2:] == ["drain", "stop"]
    assert lifecycle.refusal().status == "draining" and recorder.ready == [True, False]


def test_a_load_that_raises_fails_unready_and_a_lost_rank_exits(tools, recorder):
    lifecycle = tools.make()

    def broken():
        raise FileNotFoundError("config.json")

    lifecycle.load(broken)
    assert lifecycle.phase is Phase.FAILED and recorder.exits == [] and recorder.phases == []
    assert recorder.failed == ["load"]  # clef_failed{kind="load"}
    assert lifecycle.readiness() == (False, "failed", "FileNotFoundError: config.json")
    assert lifecycle.refusal().message == "the model failed to load: FileNotFoundError: config.json"

    lifecycle = tools.make()
    rank_error = RuntimeError("rank 1 did not start")
    rank_error.fatal = True

    def rank_died():
        raise rank_error

    lifecycle.load(rank_died)
    assert lifecycle.phase is Phase.FAILED and recorder.exits == [EXIT_TENSOR_PARALLEL_LOST]


@pytest.mark.parametrize("mode", ["enforce", "warn", "off"])
def test_a_failed_selfcheck_under_each_mode(tools, recorder, mode):
    tools.check = lambda: report(False)
    lifecycle = tools.make(selfcheck=mode)
    engine = FakeEngine()
    lifecycle.start(engine)
    if mode == "enforce":
        assert lifecycle.phase is Phase.FAILED and engine.calls == [] and recorder.exits == []
        ready, status, why = lifecycle.readiness()
        assert not ready and status == "selfcheck_failed" and "gated_delta_rule" in why
        assert lifecycle.refusal().message.startswith("this server does not answer: the on-device kernel self-check")
    else:
        assert lifecycle.phase is Phase.READY and engine.calls == ["start", "decide"]
    assert recorder.phases == ([Phase.TUNING] if mode == "off" else [Phase.TUNING, Phase.SELF_CHECKING])


def test_an_autotune_that_raises_serves_on_the_guarded_default_kernels(tools, recorder):
    def broken():
        raise RuntimeError("no timer")

    tools.tune = broken
    lifecycle = tools.make()
    engine = FakeEngine()
    lifecycle.start(engine)
    assert lifecycle.phase is Phase.READY and lifecycle.autotune is None
    (installed,) = tools.installed  # the guarded op library, with no choices: the dispatch rule's kernels
    assert installed.choices == {} and engine.on_kernel_fault is not None


def test_a_kernel_fault_is_recorded_in_the_cache_and_exits(tools, recorder, tmp_path: Path):
    key = {"device": "fake", "mode": "fast"}
    tools.tune = lambda: AutotuneReport("fast", key)
    lifecycle = tools.make(autotune="fast", autotune_cache=str(tmp_path))
    engine = FakeEngine()
    lifecycle.start(engine)
    assert lifecycle.phase is Phase.READY
    engine.on_kernel_fault(KernelFault("paged_attention:wmma2", "illegal memory access"))
    assert lifecycle.phase is Phase.FAILED and recorder.exits == [EXIT_KERNEL_FAULT]
    assert "paged_attention:wmma2" in cache_file(tmp_path, key).read_text()
    assert lifecycle.readiness()[:2] == (False, "failed")
    assert lifecycle.refusal().message.startswith("this server does not answer: CUDA fault in paged_attention")


def test_a_kernel_fault_in_the_selfcheck_stops_the_start(tools, recorder):
    def faults():
        raise KernelFault("gated_delta_rule:chunked:s64", "misaligned address")

    tools.check = faults
    lifecycle = tools.make()
    engine = FakeEngine()
    lifecycle.start(engine)
    assert lifecycle.phase is Phase.FAILED and engine.calls == [] and recorder.exits == [EXIT_KERNEL_FAULT]


def test_a_lost_rank_exits_and_a_workers_cuda_fault_is_a_kernel_fault(tools, recorder):
    peers = SimpleNamespace(on_lost=None, lost=None)
    lifecycle = tools.make()
    lifecycle.start(FakeEngine(peers=peers))
    assert lifecycle.phase is Phase.READY and peers.on_lost == lifecycle.rank_lost
    peers.on_lost("rank 1 exited")
    assert lifecycle.failure.kind == "rank_lost" and recorder.exits == [EXIT_TENSOR_PARALLEL_LOST]

    lifecycle, phases_before = tools.make(), list(recorder.phases)
    lifecycle.start(FakeEngine(peers=SimpleNamespace(on_lost=None, lost="rank 1 never started")))
    assert lifecycle.phase is Phase.FAILED and recorder.phases == phases_before  # neither tuned nor checked

    lifecycle = tools.make()
    lifecycle.rank_lost("rank 1 faulted", KernelFault("conv1d:cuda", "illegal instruction"))
    assert lifecycle.failure.kind == "kernel_fault" and recorder.exits[-1] == EXIT_KERNEL_FAULT


def test_failed_is_final_and_the_first_failure_is_kept(tools, recorder):
    lifecycle = tools.make()
    lifecycle.fail("load", "first")
    lifecycle.fail("rank_lost", "second", EXIT_TENSOR_PARALLEL_LOST)
    lifecycle.drain()
    engine = FakeEngine()
    lifecycle.start(engine)
    assert lifecycle.phase is Phase.FAILED and lifecycle.failure.reason == "first"
    assert recorder.exits == [] and engine.calls == [] and recorder.phases == [] and recorder.failed == ["load"]


def test_a_drain_during_warm_up_stops_the_start_and_reaches_the_engine(tools, recorder):
    lifecycle = tools.make()
    engine = FakeEngine(on_decide=lambda: lifecycle.drain())
    lifecycle.start(engine)
    assert lifecycle.phase is Phase.DRAINING and recorder.ready == [False]  # never ready
    lifecycle.shutdown()
    assert engine.calls == ["start", "decide", "drain", "drain", "stop"]  # the started engine is stopped


def test_a_warm_up_that_raises_fails_instead_of_loading_forever(tools, recorder):
    def raises():
        raise RuntimeError("out of KV blocks")

    lifecycle = tools.make()
    lifecycle.start(FakeEngine(on_decide=raises))
    assert lifecycle.phase is Phase.FAILED and lifecycle.status == "failed"
    assert "the warm-up decision failed: RuntimeError: out of KV blocks" in lifecycle.refusal().message


@pytest.mark.parametrize("mode", ["enforce", "warn"])
def test_a_failed_timed_selfcheck_under_each_mode(tools, recorder, mode, caplog):
    """The engine's timed self-check fails while serving (through the hook the lifecycle gave it): under enforce
    FAILED, /ready "verification_failed" with the checks that failed, decisions refused, no exit (out of rotation
    until restarted), counted as clef_failed{kind="timed_selfcheck"}; under warn READY, logged loudly."""
    lifecycle = tools.make(selfcheck=mode)
    engine = FakeEngine()
    lifecycle.start(engine)
    assert lifecycle.selfcheck_report() is lifecycle.selfcheck
    engine.selfcheck_report = report(False)
    engine.on_timed_selfcheck_failed(engine.selfcheck_report)
    assert lifecycle.selfcheck_report() is engine.selfcheck_report  # the timed one, once it ran
    if mode == "warn":
        assert lifecycle.phase is Phase.READY and lifecycle.refusal() is None and recorder.failed == []
        assert "SERVING ANYWAY" in caplog.text
        return
    ready, status, why = lifecycle.readiness()
    assert lifecycle.phase is Phase.FAILED and not ready and status == "verification_failed"
    assert why.startswith("the on-device kernel self-check FAILED") and "gated_delta_rule" in why
    assert lifecycle.refusal() == lifecycle_module.Refusal("verification_failed", f"this server does not answer: {why}")
    assert recorder.failed == ["timed_selfcheck"] and recorder.ready == [True, False] and recorder.exits == []


@pytest.mark.parametrize("mode", ["enforce", "warn"])
def test_shadow_mismatches_under_each_mode_and_the_most_allowed(tools, recorder, mode, caplog):
    """The shadow's mismatches (through the hook the lifecycle gave it): under enforce with
    --shadow-max-mismatches 2 the first leaves the server READY and the second is FAILED, /ready
    "verification_failed" with the shadow's reason, no exit; under warn each is logged and serving goes on."""
    lifecycle = tools.make()
    engine = FakeEngine(shadow=ShadowConfig(mode=mode, max_mismatches=2))
    lifecycle.start(engine)
    engine.shadow.on_mismatch(1, "shadow verification failed: 1 served record(s) differed (layer 3)")
    assert lifecycle.phase is Phase.READY and lifecycle.refusal() is None
    engine.shadow.on_mismatch(2, "shadow verification failed: 2 served record(s) differed (layer 3)")
    if mode == "warn":
        assert lifecycle.phase is Phase.READY and recorder.failed == [] and "SERVING ANYWAY" in caplog.text
        return
    assert lifecycle.readiness() == (
        False,
        "verification_failed",
        "shadow verification failed: 2 served record(s) differed (layer 3)",
    )
    assert lifecycle.refusal().message.startswith("this server does not answer: shadow verification failed: 2")
    assert recorder.failed == ["shadow_mismatch"] and recorder.exits == []
    lifecycle.drain()  # a verification failure stays the reason through a drain, and the engine still drains
    assert lifecycle.status == "verification_failed" and engine.calls[-1] == "drain"


def test_the_shadow_of_the_warm_up_decision_keeps_the_server_from_ready(tools, recorder):
    """The warm-up decision is the first the shadow may judge: a mismatch there and the server never turns ready."""
    lifecycle = tools.make()
    engine = FakeEngine(on_decide=lambda: engine.shadow.on_mismatch(1, "shadow verification failed: warm-up"))
    lifecycle.start(engine)
    assert lifecycle.phase is Phase.FAILED and lifecycle.status == "verification_failed" and True not in recorder.ready


def test_idle_counts_the_handlers_and_the_engine(tools):
    lifecycle = tools.make()
    assert lifecycle.idle()
    engine = FakeEngine()
    lifecycle.start(engine)
    with lifecycle.handling():
        assert not lifecycle.idle() and not lifecycle.wait_until_idle(0.05, poll=0.01)
    assert lifecycle.idle()
    engine.running = 1
    assert not lifecycle.idle()
    threading.Timer(0.1, lambda: setattr(engine, "running", 0)).start()
    assert lifecycle.wait_until_idle(5.0, poll=0.01)  # a drain waits for the engine's last step


def test_transitions_from_many_threads_leave_one_failure(tools, recorder):
    lifecycle = tools.make()
    lifecycle.start(FakeEngine())
    threads = [threading.Thread(target=lifecycle.rank_lost, args=(f"rank {i} lost",)) for i in range(8)] + [
        threading.Thread(target=lifecycle.drain) for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert lifecycle.phase in (Phase.FAILED, Phase.DRAINING)
    assert len(recorder.exits) == (1 if lifecycle.phase is Phase.FAILED else 0)


def test_an_unknown_selfcheck_mode_is_refused():
    with pytest.raises(ValueError, match="--selfcheck must be one of enforce, warn, off"):
        Lifecycle(LifecycleSettings(selfcheck="maybe"))
