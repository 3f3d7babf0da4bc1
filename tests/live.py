"""Live servers for tests and benchmarks: a real uvicorn server on 127.0.0.1 in a background thread, or
clef-serve as its own process."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def clef_serve_process(
    *args: str, ready_timeout: float = WAIT_SECONDS, env: dict[str, str] | None = None, faulty: bool = False
):
    """`clef-serve ARGS --host 127.0.0.1 --p PORT` as a child process, once /ready answers 200; yields
    (url, process, output lines so far). Killed on exit. `env` adds variables; `faulty` runs
    tests/faulty_clef_serve.py (a test-only fault in every model it loads) instead."""
    port = free_port()
    entry = [str(Path(__file__).parent / "faulty_clef_serve.py")] if faulty else ["-m", "app"]
    process = subprocess.Popen(
        [sys.executable, *entry, *args, "--host", "127.0.0.1", "--p", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ | (env or {}),
        cwd=Path(__file__).parents[1],
    )
    url = f"http://127.0.0.1:{port}"
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(process.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            assert process.poll() is None, "".join(output)
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "clef-serve did not become ready"
            time.sleep(0.1)
        yield url, process, output
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)
        reader.join(5)
