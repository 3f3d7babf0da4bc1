"""Test-only faults of one tensor-parallel rank, so that what the group does about them is shown without a GPU.
Loaded by path: by a worker through CLEF_TEST_TP_WORKER_OPS (worker_ops), by rank 0 from the tests (rank0_ops,
faulty_clef_serve.py). CLEF_TEST_TP_FAULT picks the fault; the "_when_armed" ones fire while the file
CLEF_TEST_TP_FAULT_ARMED exists, and "once" ones delete it as they fire (the next call is healthy):

  oom_once_when_armed        the MLP's silu_mul raises an out-of-memory, part way through a step
  overflow_once_when_armed   the MLP's silu_mul returns infinities: every rank's hidden states overflow after the
                             all-reduces, as an f16 record whose activations pass 65504 does
  sticky_when_armed          rms_norm_rope raises the error a sticky CUDA fault raises
  launch_when_armed          silu_mul raises the error a kernel with no image for the card raises
  hang_when_armed            silu_mul never returns (a kernel that deadlocks)
  attention_scaled_long      paged_attention's output x 1.5 past 256 tokens of context: this rank's heads answer
                             long records wrongly, where the start-up self-check (short contexts) cannot see
  hang_at_start              the worker never gets to load (storage that hangs), so it can be killed before the
                             rendezvous
  exit_at_start              the worker exits before it loads

Nothing in clef_cuda or app imports this."""

from __future__ import annotations

import os
import time

import torch

FAULT_ENV, ARMED_ENV = "CLEF_TEST_TP_FAULT", "CLEF_TEST_TP_FAULT_ARMED"


def _armed(once: bool) -> bool:
    path = os.environ.get(ARMED_ENV)
    if not path or not os.path.exists(path):
        return False
    if once:
        try:
            os.remove(path)
        except FileNotFoundError:  # another rank's call fired it first
            return False
    return True


class FaultyOps:
    """`base` (clef_cuda.ops) with the fault FAULT_ENV names."""

    def __init__(self, base, fault: str) -> None:
        self.base, self.fault = base, fault

    def __getattr__(self, name: str):
        original = getattr(self.base, name)
        fault = self.fault
        if name == "silu_mul" and fault == "oom_once_when_armed":
            return lambda *a, **k: _raise_oom() if _armed(once=True) else original(*a, **k)
        if name == "silu_mul" and fault == "overflow_once_when_armed":
            return lambda *a, **k: original(*a, **k).mul_(float("inf")) if _armed(once=True) else original(*a, **k)
        if name == "silu_mul" and fault == "hang_when_armed":
            return lambda *a, **k: time.sleep(3600) if _armed(once=False) else original(*a, **k)
        if name == "silu_mul" and fault == "launch_when_armed":
            return lambda *a, **k: _raise_launch() if _armed(once=False) else original(*a, **k)
        if name == "rms_norm_rope" and fault == "sticky_when_armed":
            return lambda *a, **k: _raise_sticky() if _armed(once=False) else original(*a, **k)
        if name == "paged_attention" and fault == "attention_scaled_long":
            return lambda *a, **k: original(*a, **k).mul_(1.5 if int(a[4].max()) > 256 else 1.0)
        return original


def _raise_oom():
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (test-only)")


def _raise_launch():
    raise RuntimeError("silu_mul: CUDA launch failed: no kernel image is available for execution on the device")


def _raise_sticky():
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def worker_ops(rank: int, base):
    """The op library a worker runs (clef_cuda.serving.tensor_parallel.TEST_WORKER_OPS_ENV); start faults fire here."""
    fault = os.environ.get(FAULT_ENV, "")
    if fault == "hang_at_start":
        time.sleep(3600)
    if fault == "exit_at_start":
        os._exit(9)
    return FaultyOps(base, fault)


def rank0_ops(fault: str, base=None):
    from clef_cuda import ops

    return FaultyOps(base or ops, fault)
