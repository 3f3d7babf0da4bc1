"""benchmarks/fault_matrix.py's judge: a row passes only when its fault is seen to fire (the failing request's status
and message, the kernels or trials /ready lists, the shadow verdict it caused, the server's last log line), a fatal
fault's exit is timed from the fault, and a promised 503 is a 503 with the contract's body. The rows are judged on
Row objects here (every row with its hook emptied fails; every row as a real run saw it passes), and one cheap row
is run for real both ways; the whole matrix (about 6 minutes on 2 cores) is the benchmark's to run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("fault_matrix", ROOT / "benchmarks" / "fault_matrix.py")
fault_matrix = sys.modules["fault_matrix"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
spec.loader.exec_module(fault_matrix)
Row, scenarios = fault_matrix.Row, fault_matrix.scenarios

SHADOW = {"match": 2, "marginal": 0, "mismatch": 0, "dropped": 0}
# What each row's fault left behind in a real run (benchmarks/fault_matrix.py --check, 2 CPU cores): the failing
# request's status and message, /ready's failed kernels and trials, the shadow verdict it added, the log's last words.
SEEN = {
    "overflow": {"failing": "500", "failing_message": "non-finite hidden states in a torch.float32 forward pass"},
    "rank0-oom": {"failing": "503", "failing_message": "this request's step failed: CUDA out of memory. Tried"},
    "worker-oom": {
        "failing": "503",
        "failing_message": "this request's step failed: tensor-parallel rank 1: OutOfMemoryError: CUDA out of memory",
    },
    "killed-before": {
        "log": "CRITICAL clef_serve: clef-serve: tensor-parallel rank 1 killed by SIGKILL (its channel closed); "
        "exiting (5)\n"
    },
    "killed-after": {
        "failing": "503",
        "failing_message": "a tensor-parallel worker stopped listening ([Errno 32] Broken pipe)",
        "log": "CRITICAL clef_serve: clef-serve: tensor-parallel rank 1 exited (killed by SIGKILL); exiting (5)\n",
    },
    "hung": {
        "failing": "503",
        "failing_message": "collective 1 of 9 of a forward did not finish within the tensor-parallel timeout (5 s): a "
        "rank hung",
        "log": "CRITICAL clef_serve: clef-serve: collective 1 of 9 of a forward ...: a rank hung; exiting (5)\n",
    },
    "trial-sticky": {
        "failures": {
            "paged_attention:test-crash": "crashed its trial process (killed by SIGSEGV)",
            "paged_attention:test-sticky": "left a CUDA error: CUDA error: an illegal memory access",
        }
    },
    "sticky-rank0": {
        "failing": "503",
        "failing_message": "CUDA fault in rms_norm_rope (kernel cpu): CUDA error: an illegal memory access",
        "log": "CRITICAL clef_serve: clef-serve: CUDA fault in rms_norm_rope (kernel cpu): ...; exiting (4)\n",
    },
    "sticky-worker": {
        "failing": "503",
        "failing_message": "tensor-parallel rank 1: CUDA fault in rms_norm_rope (kernel cpu): CUDA error: ...",
        "log": "CRITICAL clef_serve: clef-serve: tensor-parallel rank 1: CUDA fault in rms_norm_rope ...; exiting (4)",
    },
    "launch": {"failing": "200", "failures": {"silu_mul:cpu": "could not launch: silu_mul: CUDA launch failed"}},
    "trials-unavailable": {"trials": "unavailable: could not start on the device: CUDA error: CUDA-capable device"},
    "shadow-oom": {"failing": "200", "shadow_after": SHADOW | {"dropped": 1}},
    "near-tolerance": {"failing": "200", "shadow_after": SHADOW | {"marginal": 1}},
}
ROWS = [(name, tp) for name, scenario in scenarios().items() for tp in scenario.sizes]


def judged(name: str, tp: int, **outcome) -> Row:
    scenario = scenarios()[name]
    row = Row(name, tp, scenario.what, scenario.expect, **outcome)
    fault_matrix._judge(row)
    return row


def nothing_happened(name: str, tp: int) -> Row:
    """The row as a server whose hook did nothing shows it: every request answered, nothing failed or exited."""
    return judged(
        name,
        tp,
        failing="200",
        following="200",
        ready="200",
        seconds=0.3,
        same_answer="yes",
        leaked="none",
        shadow_before=SHADOW,
        shadow_after=SHADOW | {"match": 4},
        trials="child",
    )


def as_seen(name: str, tp: int, **changes) -> Row:
    """The row as a real run with its fault saw it (SEEN), with `changes`."""
    scenario = scenarios()[name]
    if scenario.expect == "serves on":
        outcome = {"failing": "200", "following": "200", "ready": "200", "seconds": 0.5, "same_answer": "yes"}
        outcome |= {"leaked": "none", "shadow_before": SHADOW, "shadow_after": SHADOW | {"match": 3}}
    else:
        outcome = {"following": "503", "ready": "down", "exit_code": scenario.expect.split()[-1], "seconds": 1.2}
    return judged(name, tp, **(outcome | SEEN[name] | changes))


def test_every_row_names_what_proves_its_fault_fired():
    assert set(SEEN) == set(scenarios())
    for name, scenario in scenarios().items():
        assert scenario.fired != fault_matrix.Fired(), f"{name}: no evidence that its fault fired"


@pytest.mark.parametrize(("name", "tp"), ROWS)
def test_a_row_passes_with_what_its_fault_left_behind(name, tp):
    assert as_seen(name, tp).problems == []


@pytest.mark.parametrize(("name", "tp"), ROWS)
def test_a_row_whose_hook_did_nothing_fails_on_its_evidence_alone(name, tp):
    """The 8 "serves on" rows used to pass here: a server that served on was all they asked for."""
    row = nothing_happened(name, tp)
    assert any(p.startswith("fault not seen: ") for p in row.problems), row.problems


def test_a_fatal_fault_must_be_a_503_with_the_contracts_body_not_no_answer():
    for failing in ("no answer (ReadTimeout)", "503 WITHOUT the contract's body", "500"):
        row = as_seen("sticky-rank0", 1, failing=failing)
        assert f"the failing request got {failing}, not a 503 with the contract's body" in row.problems


def test_the_exit_is_timed_from_the_fault():
    assert as_seen("killed-after", 2, seconds=14.9).problems == []
    late = as_seen("killed-after", 2, seconds=15.5)
    assert late.problems == ["the exit 15.5 s after the fault (the rule: within 15 s)"]
    assert as_seen("hung", 2, seconds=19.9).problems == []  # its fault is seen at the 5 s timeout's end
    never = as_seen("sticky-worker", 2, seconds=None, exit_code="-")
    assert (
        "no exit after the fault (the rule: within 15 s)" in never.problems and "exit -, expected 4" in never.problems
    )


def test_emptied_rows_inject_nothing():
    for name, scenario in scenarios().items():
        empty = scenario.emptied()
        assert empty.trigger in ("none", "wait-before"), name
        assert set(empty.faults.values()) <= {"none", ""}, (name, empty.faults)


@pytest.mark.slow
def test_a_real_row_passes_with_its_fault_and_fails_with_its_hook_emptied():
    """The shadow's out-of-memory under one device (the cheapest row: about 12 s a run on 2 cores), both ways."""
    with_fault = fault_matrix.run_row("shadow-oom", 1, None)
    assert with_fault.problems == [] and with_fault.shadow_after["dropped"] == 1, with_fault.problems
    emptied = fault_matrix.run_row("shadow-oom", 1, None, empty_hooks=True)
    assert emptied.problems == ["fault not seen: no shadow verdict 'dropped' after the fault"], emptied.problems
