"""A kernel that faults must never take the server down (clef_cuda.tuning.trials, guarded_ops): every kernel
first runs in a trial process, and one that crashes, hangs or leaves a sticky CUDA error there is recorded as
failed, never run by the server, and its op answered by the reference; a fault that still reaches the serving
process is named by kernel, recorded, and the process exits so its supervisor restarts it without that kernel.

No GPU here: the trial process runs on the CPU (--kernel-trials child), with test-only candidates that fail the
ways a never-run GPU kernel can (tests/trial_faults.py, run as the trial process: trial.CHILD_COMMAND), and a
test-only op that raises the error a sticky CUDA fault raises (tests/faulty_clef_serve.py). A server that ran any of
them in its own process would die."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import httpx
import pytest
import torch
import trial_faults
from conftest import cuda_available
from live import clef_serve_process, wait_until
from parity import PARITY_BOUND, assert_answers_match, reference_response
from random_requests import random_request
from releases import reference_model, tiny_release

from clef_cuda import Decider
from clef_cuda.kernels import reference
from clef_cuda.runtime.cuda_errors import classify
from clef_cuda.serving.engine import EngineConfig
from clef_cuda.tuning import autotune as tuning
from clef_cuda.tuning import trials as trial
from clef_cuda.tuning import tunes
from clef_cuda.verification.guarded_ops import GUARDED_OPS, GuardedOps, KernelFault

CONFIG = EngineConfig(max_model_len=4096, kv_fraction=0.05, prefill_chunk_size=256, max_num_seqs=2)


@pytest.fixture(scope="module")
def tiny():
    return Decider.from_release(tiny_release(), device="cpu", progress=False)


def test_cuda_errors_are_told_apart_by_what_they_say_not_by_our_prefix():
    """One classifier, from the CUDA runtime's own words: every launcher error carries our "CUDA launch failed"
    prefix, which says nothing about the kind (it once made every wrapped error a launch error)."""
    wrapped = "silu_mul: CUDA launch failed: "
    assert classify(RuntimeError("CUDA error: an illegal memory access was encountered")) == "sticky"
    assert classify(RuntimeError("CUDA error: misaligned address\nCUDA kernel errors ...")) == "sticky"
    assert classify(RuntimeError(wrapped + "unspecified launch failure")) == "sticky"
    assert classify(RuntimeError(wrapped + "the launch timed out and was terminated")) == "sticky"
    assert classify(RuntimeError("no kernel image is available for execution on the device")) == "launch"
    assert classify(RuntimeError(wrapped + "too many resources requested for launch")) == "launch"
    assert classify(RuntimeError(wrapped + "invalid configuration argument")) == "launch"
    assert classify(RuntimeError(wrapped + "out of memory")) == "out-of-memory"
    assert classify(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")) == "out-of-memory"
    assert classify(RuntimeError("CUDA error: CUDA-capable device(s) is/are busy or unavailable")) == "transient"
    # Not a CUDA runtime error, whatever prefix it wears: a launcher refusing a shape, a bad argument.
    assert classify(RuntimeError(wrapped + "paged_attention: more sequences in one call than a grid's 65,535")) is None
    assert classify(ValueError("paged_attention: query must be [num_tokens, ...]")) is None


def test_an_out_of_memory_or_a_busy_device_fails_the_call_and_bans_no_kernel():
    seen = []

    class Starved:
        def silu_mul(self, *args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")

        def add_rms_norm(self, *args, **kwargs):
            raise RuntimeError("silu_mul: CUDA launch failed: CUDA-capable device(s) is/are busy or unavailable")

    ops_ = GuardedOps(Starved(), on_failure=lambda kernel, why: seen.append(kernel))
    with pytest.raises(torch.OutOfMemoryError):
        ops_.silu_mul(torch.randn(3, 8))
    with pytest.raises(RuntimeError, match="busy"):
        ops_.add_rms_norm(torch.randn(3, 8), None, torch.ones(8), 1e-6)
    assert seen == [] and ops_.failed == {}


def test_every_failed_kernel_runs_the_reference_and_answers_stay_right(tiny):
    """With every op's kernel failed, the trunk runs clef_cuda.kernels.reference throughout: the answers equal the
    plain-ops trunk's within the parity bound (both are fp32 references of the same math)."""
    requests = [random_request(random.Random(seed), state_words=(40, 200)) for seed in range(3)]
    before = [tiny.probabilities(tiny.encode(r)) for r in requests]
    calls = []

    class Counting:
        def __getattr__(self, name):
            def run(*args, **kwargs):
                calls.append(name)
                return getattr(reference, name)(*args, **kwargs)

            return run

    failed = {f"{op}:cpu": "test" for op in (*GUARDED_OPS, "paged_attention", "gated_delta_rule_chunk")}
    base = tiny.trunk.ops
    tiny.trunk.ops = GuardedOps(base, failed, fallback=Counting())
    try:
        after = [tiny.probabilities(tiny.encode(r)) for r in requests]
    finally:
        tiny.trunk.ops = base
    assert {"paged_attention", "rms_norm_rope", "causal_conv1d_fwd", "gated_delta_rule_chunk", "add_rms_norm"} <= set(
        calls
    )
    pairs = zip(before, after, strict=True)
    worst = max(abs(a - b) for x, y in pairs for p, q in zip(x, y, strict=True) for a, b in zip(p, q, strict=True))
    assert worst < PARITY_BOUND, worst


class _OnTheGpu:
    """Stands in for a CUDA tensor where only its device is asked (GuardedOps' choice between kernels)."""

    device = torch.device("cuda", 0) if torch.cuda.is_available() else SimpleNamespace(type="cuda")


@pytest.mark.parametrize(
    "op, dispatch, universal",
    [
        ("gated_delta_rule_chunk", "gated_delta_rule_dispatch", "serial"),
        ("paged_attention", "paged_attention_dispatch", "simt"),
    ],
)
def test_an_op_with_a_choice_of_kernels_is_steered_around_a_failed_one(op, dispatch, universal):
    """The dispatch rule's pick runs while it has not failed; once it has, the universal kernel (the serial delta
    rule, SIMT attention) runs its calls; with both failed the reference does; a forced failed kernel is refused;
    a launch error marks the kernel that raised failed and runs the call again, steered around it."""
    other = "chunked" if op == "gated_delta_rule_chunk" else "wmma"
    ran, recorded, no_image = [], [], set()

    class Base:
        def __getattr__(self, name):
            if name == dispatch:
                return lambda *args: other
            if name == op:

                def run(*args, kernel="auto"):
                    if kernel in no_image:  # "auto" runs the dispatch rule's pick: `other`
                        raise RuntimeError(f"{op}: CUDA launch failed: no kernel image is available for execution")
                    ran.append(kernel)
                    return kernel

                return run
            raise AttributeError(name)

    class Fallback:
        def __getattr__(self, name):
            return lambda *args, **kwargs: ran.append("reference") or "reference"

    args = (_OnTheGpu(),) + (None,) * (8 if op == "gated_delta_rule_chunk" else 5)
    guarded = GuardedOps(Base(), fallback=Fallback(), on_failure=lambda kernel, why: recorded.append(kernel))
    assert getattr(guarded, op)(*args) == "auto"  # nothing failed: the op's own rule
    guarded.failed[f"{op}:{other}"] = "crashed its trial"
    assert getattr(guarded, op)(*args) == universal
    assert getattr(guarded, op)(*args, kernel=universal) == universal
    with pytest.raises(ValueError, match=f"kernel='{other}' failed on this device"):
        getattr(guarded, op)(*args, kernel=other)
    guarded.failed[f"{op}:{universal}"] = "hung its trial"
    assert getattr(guarded, op)(*args) == "reference"
    guarded.failed.clear()
    no_image.update({"auto", other})  # the dispatch rule's pick cannot launch on this card
    assert getattr(guarded, op)(*args) == universal  # marked failed, and the call ran again around it
    assert recorded == [f"{op}:{other}"] and set(guarded.failed) == {f"{op}:{other}"}
    with pytest.raises(ValueError, match="failed on this device"):  # forced, it is refused from now on
        getattr(guarded, op)(*args, kernel=other)


def test_a_launch_error_fails_the_kernel_once_and_reruns_the_call_on_the_reference():
    seen = []

    class NoImage:
        def silu_mul(self, *args, **kwargs):
            raise RuntimeError("silu_mul: CUDA launch failed: no kernel image is available for execution on the device")

    ops_ = GuardedOps(NoImage(), on_failure=lambda kernel, why: seen.append((kernel, why)))
    gate_up = torch.randn(3, 8)
    assert torch.equal(ops_.silu_mul(gate_up), reference.silu_mul(gate_up))
    assert torch.equal(ops_.silu_mul(gate_up), reference.silu_mul(gate_up))  # routed now: no second failure
    assert seen == [
        (
            "silu_mul:cpu",
            "could not launch: silu_mul: CUDA launch failed: no kernel image is available for execution on the device",
        )
    ]


def test_a_sticky_error_is_a_kernel_fault_naming_the_kernel():
    class Poisoned:
        def rms_norm_rope(self, *args, **kwargs):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(KernelFault, match=r"CUDA fault in rms_norm_rope \(kernel cpu\): CUDA error: an illegal"):
        GuardedOps(Poisoned()).rms_norm_rope(
            torch.randn(2, 1, 8), torch.ones(8), torch.ones(2, 2), torch.ones(2, 2), 1e-6
        )


def test_the_trials_record_a_crash_a_sticky_error_and_a_hang(tiny, monkeypatch):
    """Three never-run candidates in the trial processes: one kills its process (SIGSEGV), one leaves a sticky
    CUDA error, one never returns. Each is recorded as failed, with what happened, and never chosen; the
    others are tuned as usual, and the same trial run on healthy kernels reports no failure."""
    monkeypatch.setattr(trial, "CHILD_COMMAND", trial_faults.CHILD_COMMAND)
    monkeypatch.setenv(trial_faults.CANDIDATES_ENV, "crash,sticky,hang")
    monkeypatch.setattr(trial, "UNIT_TIMEOUT_S", 15.0)
    buckets = tunes.attention_buckets("fast", CONFIG.max_num_seqs, CONFIG.prefill_chunk_size, CONFIG.max_model_len)
    report = trial.tune_in_trials(tiny.trunk, CONFIG, "fast", buckets, {"test": 1})
    assert report.trials == "child"
    assert report.failures["paged_attention:test-crash"].startswith("crashed its trial process (killed by SIGSEGV)")
    assert report.failures["paged_attention:test-sticky"] == (
        "left a CUDA error: CUDA error: an illegal memory access was encountered"
    )
    assert report.failures["paged_attention:test-hang"] == "hung its trial process (no answer in 15 s)"
    assert len(report.failures) == 3, report.failures
    chosen = set(report.choices["paged_attention"].values())
    assert chosen and not chosen & {"test-crash", "test-sticky", "test-hang"}
    assert {r.candidate for r in report.rows if r.ms is not None} >= {"ours", "sdpa-flash"}

    monkeypatch.delenv(trial_faults.CANDIDATES_ENV)
    healthy = trial.tune_in_trials(tiny.trunk, CONFIG, "fast", buckets, {"test": 2})
    assert healthy.failures == {} and healthy.choices["paged_attention"]


def test_a_trial_process_that_cannot_start_makes_the_trials_unavailable_not_the_kernels_failed(
    tiny, monkeypatch, tmp_path
):
    """A trial process that dies before it has a device (an exclusive-process GPU, a transient out-of-memory) says
    nothing about any kernel: the trials are unavailable, this process keeps every untried kernel from running
    (its op on the reference), and nothing is cached, so the next start tries again."""
    monkeypatch.setattr(trial, "CHILD_COMMAND", ("/bin/false",))
    monkeypatch.setattr(trial, "START_RETRY_S", 0.0)
    report = trial.tune_in_trials(tiny.trunk, CONFIG, "off", [], {"test": 3})
    expected = {f"{op}:cpu" for op in GUARDED_OPS} | {"paged_attention:cpu", "gated_delta_rule_chunk:cpu"}
    assert set(report.failures) == expected and not report.cacheable
    assert report.trials.startswith("unavailable: crashed its trial process (exit 1)"), report.trials
    assert all(why.startswith("untried: the kernel trials were unavailable") for why in report.failures.values())
    trunk = Decider.from_release(tiny_release(), device="cpu", progress=False).trunk
    tuning.autotune(trunk, CONFIG, "off", tmp_path, "child")
    assert list(tmp_path.iterdir()) == []  # nothing cached: a restart tries the trials again
    assert set(trunk.ops.failed) == expected  # ... while this process runs the reference ops


def test_the_real_layer_checks_and_the_int8_tune_run_in_the_trial_process(monkeypatch):
    """The self-check's real-layer checks run in the trial process on random weights of the model's layer shapes,
    and the int8 tune on a random weight of its largest shape (the serving process then tunes nothing itself). A
    layer unit that crashes its trial process outside our kernels fails that self-check in the server (never run
    there); the kernels it ran are not blamed."""
    int8 = Decider.from_release(tiny_release(), device="cpu", progress=False, quantize="int8")
    buckets = tunes.attention_buckets("fast", CONFIG.max_num_seqs, CONFIG.prefill_chunk_size, CONFIG.max_model_len)
    report = trial.tune_in_trials(int8.trunk, CONFIG, "fast", buckets, {"test": 4})
    assert report.failures == {} and set(report.choices["int8_linear"]) == {n for n, _ in tunes.int8_buckets(CONFIG)}
    monkeypatch.setattr(trial, "CHILD_COMMAND", trial_faults.CHILD_COMMAND)
    monkeypatch.setenv(trial_faults.FAULT_ENV, "crash_in:selfcheck:delta_net")
    crashed = trial.tune_in_trials(int8.trunk, CONFIG, "off", [], {"test": 5})
    assert list(crashed.failures) == ["selfcheck:delta_net"], crashed.failures
    assert crashed.failures["selfcheck:delta_net"].startswith("crashed its trial process (killed by SIGSEGV)")
    tuning.install(int8.trunk, crashed, [], None, CONFIG)
    from clef_cuda.verification.selfcheck import run_selfcheck

    selfcheck = run_selfcheck(int8.trunk)
    (failed,) = selfcheck.failures
    assert failed.name == "layer0.delta_net" and "crashed its trial process" in failed.error, selfcheck.summary()


def test_a_server_comes_up_serving_right_around_a_kernel_that_kills_its_trial(tmp_path):
    """The issue's test: clef-serve with a test-only attention candidate that kills the process it runs in (and
    one that leaves a sticky error). The server starts, serves, its answers equal the reference, /ready lists
    the failures, and its autotune cache names the candidates as failed, so a restart does not try them again."""
    release = tiny_release()
    cache = tmp_path / "autotune"
    faults = {trial_faults.CANDIDATES_ENV: "crash,sticky"}
    args = (
        "--w",
        str(release),
        "--d",
        "cpu",
        "--kernel-trials",
        "child",
        "--autotune-cache",
        str(cache),
        "--max-model-len",
        "4096",
        "--kv-fraction",
        "0.05",
    )
    requests = [
        random_request(random.Random(seed), state_words=(40, 300), null_score_levels=False) for seed in range(3)
    ]
    expected = [reference_response(reference_model(release), r) for r in requests]
    with clef_serve_process(*args, faults=faults, ready_timeout=600) as (url, _, output):
        ready = httpx.get(url + "/ready").json()
        failed_metric = {
            line for line in httpx.get(url + "/metrics").text.splitlines() if line.startswith("clef_kernel_failed{")
        }
        for request, (want, unrounded) in zip(requests, expected, strict=True):
            got = httpx.post(url + "/v1/systemone", json=request, timeout=60)
            assert got.status_code == 200, got.text
            assert_answers_match(got.json()["answers"], want["answers"], unrounded)
    failures = ready["autotune"]["failures"]
    assert failures["paged_attention:test-crash"].startswith("crashed its trial process (killed by SIGSEGV)")
    assert failures["paged_attention:test-sticky"].startswith("left a CUDA error")
    assert ready["autotune"]["trials"] == "child" and ready["selfcheck"]["passed"]
    assert failed_metric == {
        'clef_kernel_failed{kernel="paged_attention:test-crash"} 1.0',
        'clef_kernel_failed{kernel="paged_attention:test-sticky"} 1.0',
    }
    (path,) = cache.glob("autotune-*.json")
    cached = json.loads(path.read_text())["report"]
    assert set(cached["failures"]) == {"paged_attention:test-crash", "paged_attention:test-sticky"}
    assert set(cached["choices"]["paged_attention"].values()) <= {"ours", "sdpa-flash", "sdpa-math"}
    assert any("FAILED KERNEL paged_attention:test-crash" in line for line in output)
    # The restart reads it: no trial process runs, the same failures are kept from running, the same choices run.
    with clef_serve_process(*args, faults=faults, ready_timeout=600) as (url, _, _):
        again = httpx.get(url + "/ready").json()["autotune"]
    assert again["cached"] and again["failures"] == failures and again["choices"] == cached["choices"]


def test_a_server_whose_trials_are_unavailable_serves_on_the_reference_and_caches_nothing(tmp_path):
    """The trial process cannot start (test-only: the device reported busy, as an exclusive-process GPU does): /ready
    says the trials are unavailable, the server answers right on the reference ops, and nothing is cached."""
    release = tiny_release()
    cache = tmp_path / "autotune"
    args = ("--w", str(release), "--d", "cpu", "--kernel-trials", "child", "--autotune-cache", str(cache))
    request = random_request(random.Random(3), state_words=(40, 200), null_score_levels=False)
    want, unrounded = reference_response(reference_model(release), request)
    faults = {trial_faults.FAULT_ENV: "busy_at_start"}
    with clef_serve_process(*args, faults=faults, ready_timeout=600) as (url, _, _):
        ready = httpx.get(url + "/ready")
        got = httpx.post(url + "/v1/systemone", json=request, timeout=60)
    assert ready.status_code == 200
    trials = ready.json()["autotune"]["trials"]
    assert trials.startswith("unavailable: could not start on the device: CUDA error: CUDA-capable device"), trials
    assert got.status_code == 200 and not list(cache.glob("*.json"))
    assert_answers_match(got.json()["answers"], want["answers"], unrounded)


def test_a_sticky_fault_while_serving_exits_naming_the_kernel_and_the_restart_runs_without_it(tmp_path):
    """A fault the trials could not see (tests/faulty_clef_serve.py: rms_norm_rope raises a sticky CUDA error once
    the test arms it, after start-up): the request gets a 503, the process
    exits with EXIT_KERNEL_FAULT after one line naming the op and kernel, the autotune cache records it, and
    the next start serves the same request right, rms_norm_rope on the reference."""
    from clef_cuda.lifecycle import EXIT_KERNEL_FAULT

    release = tiny_release()
    cache = tmp_path / "autotune"
    armed = tmp_path / "armed"
    faults = {"CLEF_TEST_FAULT": "sticky_rope_when_armed", "CLEF_TEST_FAULT_ARMED": str(armed)}
    args = (
        "--w",
        str(release),
        "--d",
        "cpu",
        "--autotune-cache",
        str(cache),
        "--max-model-len",
        "4096",
        "--kv-fraction",
        "0.05",
    )
    request = random_request(random.Random(7), state_words=(40, 200), null_score_levels=False)
    want, unrounded = reference_response(reference_model(release), request)
    with clef_serve_process(*args, faults=faults) as (url, process, output):
        armed.touch()
        response = httpx.post(url + "/v1/systemone", json=request, timeout=60)
        assert response.status_code == 503, response.text
        assert "CUDA fault in rms_norm_rope (kernel cpu)" in response.json()["detail"]["message"]
        wait_until(lambda: process.poll() is not None, "clef-serve to exit after the fault")
        assert process.returncode == EXIT_KERNEL_FAULT
    fault_lines = [line for line in output if "CUDA fault in rms_norm_rope (kernel cpu)" in line and "exiting" in line]
    assert len(fault_lines) == 1 and "recorded as failed in the autotune cache" in fault_lines[0], output[-20:]
    (path,) = cache.glob("autotune-*.json")
    assert "rms_norm_rope:cpu" in json.loads(path.read_text())["report"]["failures"]
    with clef_serve_process(*args, faults=faults) as (url, _, output):
        response = httpx.post(url + "/v1/systemone", json=request, timeout=60)
        assert response.status_code == 200, response.text
        assert_answers_match(response.json()["answers"], want["answers"], unrounded)
        assert "rms_norm_rope:cpu" in httpx.get(url + "/ready").json()["autotune"]["failures"]


README_EXAMPLE = {
    "model": "clef-tiny",
    "state": "09:12:01 INFO api: request served\n09:12:04 ERROR db: connection refused\n"
    "09:12:09 WARN cache: high latency\n09:12:15 ERROR queue: write failed",
    "questions": {
        "last_failure": {
            "type": "choice",
            "instructions": "Which component logged the latest ERROR?",
            "criteria": {"db": None, "api": None, "cache": None, "queue": None, "auth": None},
        }
    },
}


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_available(), reason="needs a GPU and the CUDA build")
def test_the_server_starts_on_the_gpu_after_its_kernel_trials(tmp_path):
    """On a real GPU with no cache entry: every kernel is tried in a child process first, none fails, the
    self-check passes, and the embedded model answers the README example as on the CPU."""
    with clef_serve_process("--d", "0", "--autotune-cache", str(tmp_path), ready_timeout=600) as (url, _, output):
        ready = httpx.get(url + "/ready").json()
        answer = httpx.post(url + "/v1/systemone", json=README_EXAMPLE, timeout=60)
    log = "".join(output)
    assert "autotune" in ready, log
    assert ready["autotune"]["trials"] == "child" and ready["autotune"]["failures"] == {}, (ready["autotune"], log)
    assert ready["selfcheck"]["passed"], ready["selfcheck"]
    assert answer.status_code == 200 and answer.json()["answers"]["last_failure"]["choice"] == "queue"


def test_an_autotune_that_raises_still_leaves_the_fault_handler_wired_and_the_ops_guarded(monkeypatch):
    """The autotune raising (a bug, a disk error) is logged and the server serves on the dispatch rule's kernels,
    but never unguarded: a sticky fault later still stops the engine and reaches the server's handler (exit 4),
    instead of a black-hole pod whose /ready stays 200."""
    from fastapi.testclient import TestClient

    from app.server import ServerSettings, create_app
    from clef_cuda import lifecycle as server_module
    from clef_cuda.serving.engine import Engine

    def broken(*args, **kwargs):
        raise OSError("the autotune cache's disk is gone (test-only)")

    monkeypatch.setattr(server_module, "autotune", broken)
    decider = Decider.from_release(tiny_release(), device="cpu", progress=False)
    engine = Engine(decider, CONFIG)
    with TestClient(create_app(ServerSettings(autotune="fast"), engine=engine)) as client:
        assert client.get("/ready").status_code == 200
        assert isinstance(decider.trunk.ops, GuardedOps) and engine.on_kernel_fault is not None
        handled = []
        monkeypatch.setattr(engine, "on_kernel_fault", handled.append)
        decider.trunk.ops.base = OpFaultSticky()
        response = client.post("/v1/systemone", json=README_EXAMPLE | {"model": "clef-flash"})
        assert response.status_code == 503 and "CUDA fault in rms_norm_rope" in response.json()["detail"]["message"]
    assert [fault.kernel for fault in handled] == ["rms_norm_rope:cpu"]


class OpFaultSticky:
    """clef_cuda.kernels.ops with rms_norm_rope raising the error a sticky CUDA fault raises."""

    def __getattr__(self, name):
        from clef_cuda.kernels import ops

        if name == "rms_norm_rope":

            def sticky(*args, **kwargs):
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

            return sticky
        return getattr(ops, name)
