"""The processes clef-serve starts beside itself, kept on one leash: the kernel trial processes
(clef_cuda.tuning.trials) and the tensor-parallel worker ranks (clef_cuda.parallel.tensor_parallel).

Both need the same four things, and each is done here once:
  a start budget    START_TIMEOUT_S from the moment a child is started to its first report (a trial's torch
                    import and CUDA context; a worker's shard loaded and self-checked); past it the child is
                    failed, never waited on longer;
  liveness          while waiting on a child, whether it is still alive is polled (every POLL_S), so a child
                    that dies is seen at once, not when a timeout runs out;
  reaping           every child started is stopped and waited for on every way out (Child.reap: ask, then
                    kill), and a child exits when its parent is gone, even by SIGKILL (die_with_parent);
  what happened     how a child ended, in words ("exit 3", "killed by SIGSEGV") for the log and /ready.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

from clef_cuda.errors import ClefError

log = logging.getLogger("clef_cuda.runtime.children")

# One budget for every child's start, from the moment it is started to its first report.
START_TIMEOUT_S = 600.0
POLL_S = 0.1  # how often a waiting parent looks whether its children are alive


class ChildFailed(ClefError):
    """A child exited, or did not report within its budget, while its parent waited on it."""


class Child:
    """One child process: started at once, with a name for messages ("tensor-parallel rank 1")."""

    def __init__(self, name: str, argv: Sequence[str], **popen) -> None:
        self.name = name
        self.started = time.monotonic()
        self.process = subprocess.Popen(list(argv), **popen)

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll()

    def alive(self) -> bool:
        return self.process.poll() is None

    def how_ended(self) -> str:
        """'exit N' or 'killed by SIGNAME' ('running' while it runs)."""
        code = self.process.poll()
        if code is None:
            return "running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit {code}"

    def reap(self, grace: float = 10.0) -> None:
        """Wait `grace` seconds for it to end on its own (it was told to), then kill it; always waited for."""
        if self.process.poll() is None:
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process.wait()


def wait_for(
    ready: Callable[[], bool], children: Sequence[Child], deadline: float, what: str, poll: float = POLL_S
) -> None:
    """Return once ready() is true; ChildFailed as soon as one of `children` has ended (how, named) or when
    time.monotonic() passes `deadline` (`what` says what was awaited: "to report ready")."""
    while True:
        if ready():
            return
        for child in children:
            if not child.alive():
                raise ChildFailed(f"{child.name} {child.how_ended()} before it was {what}")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            waited = time.monotonic() - min((c.started for c in children), default=time.monotonic())
            raise ChildFailed(f"{', '.join(c.name for c in children)} not {what} after {waited:.0f} s")
        if poll > 0:  # (a ready() that itself waits a slice, as a channel's poll(timeout) does, passes poll=0)
            time.sleep(min(poll, remaining))


def reap_all(children: Sequence[Child], grace: float = 10.0) -> None:
    """Reap every child: they share one grace period, then the rest are killed."""
    deadline = time.monotonic() + grace
    for child in children:
        child.reap(max(0.1, deadline - time.monotonic()))


def die_with_parent(parent_pid: int, poll: float = 0.5) -> None:
    """In a child: exit as soon as the parent process is gone, however it went (even by SIGKILL, which leaves it
    no time to reap). A thread watches whether the child has been re-parented. (prctl's PR_SET_PDEATHSIG would
    fire when the parent *thread* that started the child ends, and clef-serve starts its children from a loader
    thread that ends once the model is up.)"""
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll)
        os._exit(1)

    threading.Thread(target=watch, name="clef-parent-watch", daemon=True).start()
