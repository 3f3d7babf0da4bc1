"""Test-only faults of a kernel trial process (clef_cuda.tuning.trials), so that what they lead to is shown without
a GPU. Run as the trial process itself: a test points clef_cuda.tuning.trials.CHILD_COMMAND at CHILD_COMMAND (in
its own process with monkeypatch, in a server through tests/faulty_clef_serve.py); this script installs the
faults its environment names, then runs the real trial's main(). With neither variable set it is the healthy trial.

CLEF_TEST_CANDIDATE_SET (comma-separated) adds attention candidates that fail the way a never-run GPU kernel can:
  crash   kills the process it runs in, as an illegal address does (SIGSEGV);
  sticky  raises the error a sticky CUDA fault raises, and every later call would too;
  hang    never returns, as a deadlocked kernel does.
CLEF_TEST_TRIAL_FAULT breaks the trial process itself:
  exit_at_start     it dies before it has a device;
  busy_at_start     the device is busy (an exclusive-process GPU);
  crash_in:<unit>   it dies of SIGSEGV inside that real-layer unit ("selfcheck:delta_net"), outside any of our kernels.

Nothing in clef_cuda or app imports this; a server that ran one of these candidates in its own process would die,
which is what the tests that use them would see."""

from __future__ import annotations

import os
import signal
import sys
import time

CHILD_COMMAND = (sys.executable, os.path.abspath(__file__))
CANDIDATES_ENV, FAULT_ENV = "CLEF_TEST_CANDIDATE_SET", "CLEF_TEST_TRIAL_FAULT"


def _crash(*_):
    os.kill(os.getpid(), signal.SIGSEGV)


def _sticky(*_):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def _hang(*_):
    time.sleep(3600)


KINDS = {"crash": _crash, "sticky": _sticky, "hang": _hang}


def attention_candidates(kinds: str) -> dict:
    """The candidates `kinds` names ("crash,sticky"), as clef_cuda.tuning.tunes names candidates."""
    unknown = [kind for kind in kinds.split(",") if kind and kind not in KINDS]
    if unknown:
        raise SystemExit(f"trial_faults.py: unknown {CANDIDATES_ENV} kind(s) {unknown}; known: {', '.join(KINDS)}")
    return {f"test-{kind}": KINDS[kind] for kind in kinds.split(",") if kind}


def install(candidates: str, fault: str) -> None:
    """Break this process's trial as `candidates` (CLEF_TEST_CANDIDATE_SET) and `fault` (CLEF_TEST_TRIAL_FAULT) say."""
    from clef_cuda.tuning import trials as trial
    from clef_cuda.tuning import tunes

    if candidates:
        extra = attention_candidates(candidates)
        healthy_candidates = tunes.attention_candidates
        tunes.attention_candidates = lambda target: healthy_candidates(target) | extra
    if fault == "exit_at_start":
        trial._start_on = lambda device: os._exit(1)
    elif fault == "busy_at_start":

        def busy(device):
            raise RuntimeError("CUDA error: CUDA-capable device(s) is/are busy or unavailable")

        trial._start_on = busy
    elif fault.startswith("crash_in:"):
        from clef_cuda.verification.selfcheck import SelfCheckCases

        unit, healthy_check = fault.removeprefix("crash_in:"), SelfCheckCases.layer_check

        def layer_check(self, name, layer_index):
            if name == unit:
                os.kill(os.getpid(), signal.SIGSEGV)
            return healthy_check(self, name, layer_index)

        SelfCheckCases.layer_check = layer_check
    elif fault:
        raise SystemExit(f"trial_faults.py: unknown {FAULT_ENV}={fault!r}")


if __name__ == "__main__":
    install(os.environ.get(CANDIDATES_ENV, ""), os.environ.get(FAULT_ENV, ""))
    from clef_cuda.tuning import trials as trial

    sys.exit(trial.main())
