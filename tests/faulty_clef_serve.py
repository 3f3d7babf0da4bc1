"""clef-serve with a test-only fault injected into every model it loads; the tests run it as a process.
CLEF_TEST_FAULT picks the fault: key_band (the default: the seed's conv that zeroes the key band, which the
self-check must catch) or sticky_rope_when_armed (rms_norm_rope raising the error a sticky CUDA fault raises,
once the file CLEF_TEST_FAULT_ARMED names exists: a test creates it after start-up, so only serving meets it) or
tp:<fault>, one of tests/tp_worker_faults.py's on rank 0 (armed by CLEF_TEST_TP_FAULT_ARMED), or shadow_oom_when_armed
(the shadow run's reference attention out of memory while CLEF_TEST_TP_FAULT_ARMED exists; the serving ops healthy)
or near_tolerance_when_armed (healthy ops; while armed, each record's probability tolerance is half its
difference: it lands just past it, every layer matched, as a healthy record on another machine can).
Its children run the tests' own entry points: the kernel trial process tests/trial_faults.py and each tensor-parallel
worker tests/tp_worker_faults.py, each healthy unless its own variables name a fault (their docstrings).
Run by tests/live.py's launcher (ClefServe with `faults`); test-only: nothing in clef_cuda or app imports this."""

from __future__ import annotations

import os
import sys

import tp_worker_faults
import trial_faults
from faults import KeyBandZeroedOps, OpFault

from app.cli import main
from clef_cuda.decider import Decider
from clef_cuda.model.config import load_release_config
from clef_cuda.parallel import tensor_parallel
from clef_cuda.tuning import trials as trial

_load = Decider.from_release.__func__


def _sticky_when_armed(original, *args, **kwargs):
    if os.path.exists(os.environ["CLEF_TEST_FAULT_ARMED"]):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return original(*args, **kwargs)


def _reference_oom_when_armed():
    import torch

    from clef_cuda.kernels import reference

    healthy = reference.paged_attention

    def paged_attention(*args, **kwargs):
        if os.path.exists(os.environ["CLEF_TEST_TP_FAULT_ARMED"]):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.40 GiB (test-only)")
        return healthy(*args, **kwargs)

    reference.paged_attention = paged_attention


def _near_tolerance_when_armed():
    """While armed, the shadow judges each record with its probability tolerance at half the record's healthy
    difference: the record lands just past it, every layer matched. The record's own tolerance is the one judged
    (ShadowResult.tolerance; the verifier's is only the fallback): setting the verifier's alone fired nothing."""
    from clef_cuda.verification.shadow import ShadowVerifier

    judge = ShadowVerifier._judge

    def near(self, result):
        saved = self.tolerance
        if os.path.exists(os.environ["CLEF_TEST_TP_FAULT_ARMED"]) and result.max_abs_error > 0:
            result.tolerance = result.max_abs_error / 2
        try:
            return judge(self, result)
        finally:
            self.tolerance = saved

    ShadowVerifier._judge = near


def _faulty_ops(path):
    fault = os.environ.get("CLEF_TEST_FAULT", "key_band")
    if fault == "none":  # healthy: the other test hooks (a worker's, a trial's) do the faulting
        return None
    if fault == "shadow_oom_when_armed":
        _reference_oom_when_armed()
        return None
    if fault == "near_tolerance_when_armed":
        _near_tolerance_when_armed()
        return None
    if fault == "key_band":
        return KeyBandZeroedOps(load_release_config(path).trunk.key_dim)
    if fault == "sticky_rope_when_armed":
        return OpFault("rms_norm_rope", _sticky_when_armed)
    if fault.startswith("tp:"):
        return tp_worker_faults.rank0_ops(fault.removeprefix("tp:"))
    raise SystemExit(f"faulty_clef_serve.py: unknown CLEF_TEST_FAULT={fault!r}")


def _faulty_load(cls, path, *args, **kwargs):
    return _load(cls, path, *args, ops=_faulty_ops(path), **kwargs)


Decider.from_release = classmethod(_faulty_load)
trial.CHILD_COMMAND = trial_faults.CHILD_COMMAND
tensor_parallel.WORKER_COMMAND = tp_worker_faults.WORKER_COMMAND

if __name__ == "__main__":
    sys.exit(main())
