"""Live servers for tests and benchmarks: a real uvicorn server on 127.0.0.1 in a background thread, or
clef-serve as its own process."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import uvicorn

from app.server import ServerSettings, create_app
from clef_cuda.serving.engine import Engine

# How long a test waits for something that must happen (a server up, a request running). A hang guard,
# not a speed limit: generous, so a slow or loaded machine only takes longer.
WAIT_SECONDS = 120.0


def wait_until(condition: Callable[[], bool], what: str, timeout: float = WAIT_SECONDS, poll: float = 0.01) -> None:
    """Polls `condition` until it holds; fails naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout:.0f} s for {what}"
        time.sleep(poll)


@contextlib.contextmanager
def live_server(engine: Engine, settings: ServerSettings):
    app = create_app(settings, engine=engine)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), "uvicorn to start (the warm-up decision included)")
    assert server.started, "uvicorn did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", port
    finally:
        server.should_exit = True
        thread.join(30)


class GatedEngine(Engine):
    """An engine whose scheduler admits nothing until `gate` is set (or 60 s pass): a test fills its queue
    first, then lets it run."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def _admit(self):
        self.gate.wait(60)
        super()._admit()


class PausingEngine(Engine):
    """Once `pausing` is set, waits for `resume` after each trunk step that leaves a record mid-prefill (the warm-up
    decision at start runs unpaused): a test looks at the server while a long record is being prefilled."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pausing, self.paused, self.resume = threading.Event(), threading.Event(), threading.Event()

    def _step(self):
        super()._step()
        if self.pausing.is_set() and self._running:
            self.paused.set()
            self.resume.wait(60)


@contextlib.contextmanager
def resident_growth(process: psutil.Process, every: float = 0.01) -> Iterator[list[float]]:
    """MiB of `process`'s resident memory above its level on entry at its peak while the block runs, sampled every
    `every` seconds: the yielded list's one value, set on exit."""
    baseline, peak, stop, grown = process.memory_info().rss, [0], threading.Event(), [0.0]

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(every)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield grown
    finally:
        stop.set()
        sampler.join()
        grown[0] = (max(peak[0], process.memory_info().rss) - baseline) / 2**20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ClefServe:
    """`clef-serve ARGS --host 127.0.0.1 --p PORT` as a child process, started at once, its output kept (stdout and
    stderr, by line, in `output`). The one launcher of clef-serve for the tests and the benchmarks.

    `env` adds variables; `port` is the port to serve on (default: a free one; a restart on the same port is the same
    scrape target). `faults`, when given, runs tests/faulty_clef_serve.py instead of `python -m app`: the
    test-only fault hooks, picked by these variables (CLEF_TEST_FAULT "none" unless they name one; the trial process
    and the worker ranks run tests/trial_faults.py and tests/tp_worker_faults.py, healthy unless the variables name
    their faults). Nothing reaches a plain clef-serve: it reads no test hook from its environment."""

    def __init__(
        self, *args: str, env: dict[str, str] | None = None, faults: dict[str, str] | None = None, port: int = 0
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        entry = ["-m", "app"] if faults is None else [str(Path(__file__).parent / "faulty_clef_serve.py")]
        hooks = {} if faults is None else {"CLEF_TEST_FAULT": "none"} | faults
        self.process = subprocess.Popen(
            [sys.executable, *entry, *args, "--host", "127.0.0.1", "--p", str(self.port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=os.environ | hooks | (env or {}),
            cwd=Path(__file__).parents[1],
        )
        self.output: list[str] = []
        self.exited_at: float | None = None  # time.monotonic() when the process ended (a thread waits for it)
        self._reader = threading.Thread(target=lambda: self.output.extend(self.process.stdout), daemon=True)
        self._reader.start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        self.process.wait()
        self.exited_at = time.monotonic()

    def text(self) -> str:
        """The output so far (all of it once the process and its children have ended)."""
        if self.process.poll() is not None:
            self._reader.join(5)
        return "".join(self.output)

    def ready(self) -> bool:
        try:
            return httpx.get(self.url + "/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float = WAIT_SECONDS) -> bool:
        """Whether /ready answered 200 within `timeout` seconds (False at once if the process ended)."""
        deadline = time.monotonic() + timeout
        while self.process.poll() is None and time.monotonic() < deadline:
            if self.ready():
                return True
            time.sleep(0.1)
        return False

    def assert_ready(self, timeout: float = WAIT_SECONDS) -> None:
        if not self.wait_ready(timeout):
            ended = self.process.poll()
            why = f"exited ({ended})" if ended is not None else f"was not ready in {timeout:.0f} s"
            raise AssertionError(f"clef-serve {why}:\n{self.text()[-4000:]}")

    def workers(self) -> list[psutil.Process]:
        """Its tensor-parallel worker ranks (psutil processes; the kernel trial process is not one)."""
        try:
            children = psutil.Process(self.process.pid).children()
        except psutil.NoSuchProcess:
            return []
        found = []
        for child in children:
            try:
                if "--rank" in child.cmdline():
                    found.append(child)
            except psutil.NoSuchProcess:
                pass
        return found

    def stop(self, grace: float = 30) -> int:
        """SIGTERM (a graceful drain), then SIGKILL after `grace` seconds; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)
        self._reader.join(5)


@contextlib.contextmanager
def clef_serve_process(
    *args: str,
    ready_timeout: float = WAIT_SECONDS,
    env: dict[str, str] | None = None,
    faults: dict[str, str] | None = None,
):
    """ClefServe(ARGS) once /ready answers 200; yields (url, process, output lines so far). Killed on exit."""
    server = ClefServe(*args, env=env, faults=faults)
    try:
        server.assert_ready(ready_timeout)
        yield server.url, server.process, server.output
    finally:
        server.kill()
