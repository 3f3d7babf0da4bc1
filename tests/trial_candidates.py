"""Test-only attention candidates for the kernel trials (clef_cuda.serving.trial), loaded through
CLEF_TEST_ATTENTION_CANDIDATES: each fails the way a never-run GPU kernel can, so the fail-safe is shown to
work without a GPU. CLEF_TEST_CANDIDATE_SET picks them (comma-separated; default crash,sticky):

- crash: kills the process it runs in, as an illegal address does (SIGSEGV);
- sticky: raises the error a sticky CUDA fault raises, and every later call would too;
- hang: never returns, as a deadlocked kernel does.

Nothing in clef_cuda or app imports this; a server that ran one of them in its own process would die, which
is what the tests that use them would see."""

from __future__ import annotations

import os
import signal
import time


def _crash(*_):
    os.kill(os.getpid(), signal.SIGSEGV)


def _sticky(*_):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def _hang(*_):
    time.sleep(3600)


KINDS = {"crash": _crash, "sticky": _sticky, "hang": _hang}


def attention_candidates(target) -> dict:
    chosen = os.environ.get("CLEF_TEST_CANDIDATE_SET", "crash,sticky").split(",")
    return {f"test-{kind}": KINDS[kind] for kind in chosen if kind}
