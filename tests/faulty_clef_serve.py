"""clef-serve with a test-only fault injected into every model it loads; the tests run it as a process.
CLEF_TEST_FAULT picks the fault: key_band (the default: the seed's conv that zeroes the key band, which the
self-check must catch) or sticky_rope_when_armed (rms_norm_rope raising the error a sticky CUDA fault raises,
once the file CLEF_TEST_FAULT_ARMED names exists: a test creates it after start-up, so only serving meets it) or
tp:<fault>, one of tests/tp_worker_faults.py's on rank 0 (armed by CLEF_TEST_TP_FAULT_ARMED).
Test-only; nothing in clef_cuda or app imports this."""

from __future__ import annotations

import os
import sys

from faults import KeyBandZeroedOps, OpFault

from app.cli import main
from clef_cuda.decider import Decider
from clef_cuda.model.config import load_release_config

_load = Decider.from_release.__func__


def _sticky_when_armed(original, *args, **kwargs):
    if os.path.exists(os.environ["CLEF_TEST_FAULT_ARMED"]):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return original(*args, **kwargs)


def _faulty_ops(path):
    fault = os.environ.get("CLEF_TEST_FAULT", "key_band")
    if fault == "key_band":
        return KeyBandZeroedOps(load_release_config(path).trunk.key_dim)
    if fault == "sticky_rope_when_armed":
        return OpFault("rms_norm_rope", _sticky_when_armed)
    if fault.startswith("tp:"):
        from tp_worker_faults import rank0_ops

        return rank0_ops(fault.removeprefix("tp:"))
    raise SystemExit(f"faulty_clef_serve.py: unknown CLEF_TEST_FAULT={fault!r}")


def _faulty_load(cls, path, *args, **kwargs):
    return _load(cls, path, *args, ops=_faulty_ops(path), **kwargs)


Decider.from_release = classmethod(_faulty_load)

if __name__ == "__main__":
    sys.exit(main())
