"""Test-only faults of one tensor-parallel rank, so that what the group does about them is shown without a GPU.
Run as a worker rank itself: a test points clef_cuda.parallel.tensor_parallel.WORKER_COMMAND at WORKER_COMMAND (in
its own process with monkeypatch, in a server through tests/faulty_clef_serve.py); this script puts worker_ops in
the worker's place and runs the real worker_main(). Imported by rank 0's tests (rank0_ops, faulty_clef_serve.py).
CLEF_TEST_TP_FAULT picks the fault (unset or any other name: none, the healthy worker); the "_when_armed" ones fire
while the file CLEF_TEST_TP_FAULT_ARMED exists, and "once" ones delete it as they fire (the next call is healthy):

  oom_once_when_armed        the MLP's silu_mul raises an out-of-memory, part way through a step
  overflow_once_when_armed   the MLP's silu_mul returns infinities: every rank's hidden states overflow after the
                             all-reduces, as an f16 record whose activations pass 65504 does
  sticky_when_armed          rms_norm_rope raises the error a sticky CUDA fault raises
  launch_when_armed          silu_mul raises the error a kernel with no image for the card raises
  hang_when_armed            silu_mul never returns (a kernel that deadlocks)
  attention_scaled_long      paged_attention's output x 1.5 past 256 tokens of context: this rank's heads answer
                             long records wrongly, where the start-up self-check (short contexts) cannot see
  tower_oom_once_when_armed  the vision tower (on the rank that holds it) raises an out-of-memory
  hang_at_start              the worker never gets to load (storage that hangs), so it can be killed before the
                             rendezvous
  exit_at_start              the worker exits before it loads

Nothing in clef_cuda or app imports this."""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # loaded by path in a worker: tests/ for faults.py
from faults import OpFault  # noqa: E402

FAULT_ENV, ARMED_ENV = "CLEF_TEST_TP_FAULT", "CLEF_TEST_TP_FAULT_ARMED"
WORKER_COMMAND = (sys.executable, os.path.abspath(__file__))


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


def _once(raise_or_break):
    """broken(original, *args, **kwargs) for OpFault: raise_or_break(out) when armed (once), else the original."""
    return lambda original, *a, **k: raise_or_break(original(*a, **k)) if _armed(once=True) else original(*a, **k)


def _while_armed(action):
    return lambda original, *a, **k: action() if _armed(once=False) else original(*a, **k)


# fault -> (the op it breaks, how: OpFault's broken(original, *args, **kwargs))
FAULTS = {
    "oom_once_when_armed": ("silu_mul", _once(lambda out: _raise_oom())),
    "overflow_once_when_armed": ("silu_mul", _once(lambda out: out.mul_(float("inf")))),
    "hang_when_armed": ("silu_mul", _while_armed(lambda: time.sleep(3600))),
    "launch_when_armed": ("silu_mul", _while_armed(lambda: _raise_launch())),
    "sticky_when_armed": ("rms_norm_rope", _while_armed(lambda: _raise_sticky())),
    "attention_scaled_long": (
        "paged_attention",
        lambda original, *a, **k: original(*a, **k).mul_(1.5 if int(a[4].max()) > 256 else 1.0),
    ),
}


def faulty_ops(base, fault: str):
    """`base` (clef_cuda.kernels.ops) with the fault FAULTS names (tests/faults.py's OpFault); `base` itself for any
    other."""
    if fault not in FAULTS:
        return base
    op, broken = FAULTS[fault]
    return OpFault(op, broken, base)


def _raise_oom():
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (test-only)")


def _raise_launch():
    raise RuntimeError("silu_mul: CUDA launch failed: no kernel image is available for execution on the device")


def _raise_sticky():
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def worker_ops(rank: int, base):
    """The op library a worker runs (in tensor_parallel._worker_ops' place); start faults fire here."""
    fault = os.environ.get(FAULT_ENV, "")
    if fault == "hang_at_start":
        time.sleep(3600)
    if fault == "exit_at_start":
        os._exit(9)
    if fault == "tower_oom_once_when_armed":  # the tower runs no op of the library: break the class in this process
        from clef_cuda.model import vision

        healthy = vision.VisionTower.__call__

        def call(tower, images):
            if _armed(once=True):
                _raise_oom()
            return healthy(tower, images)

        vision.VisionTower.__call__ = call
    return faulty_ops(base, fault)


def rank0_ops(fault: str, base=None):
    from clef_cuda.kernels import ops

    return faulty_ops(base or ops, fault)


if __name__ == "__main__":
    from clef_cuda.kernels import ops
    from clef_cuda.parallel import tensor_parallel

    tensor_parallel._worker_ops = lambda rank: worker_ops(rank, ops)
    sys.exit(tensor_parallel.worker_main(sys.argv[1:]))
