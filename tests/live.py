"""A real uvicorn server on 127.0.0.1 in a background thread (tests and the load benchmark)."""

from __future__ import annotations

import contextlib
import threading
import time

import uvicorn

from app.server import ServerSettings, create_app
from clef_cuda.engine import Engine


@contextlib.contextmanager
def live_server(engine: Engine, settings: ServerSettings):
    app = create_app(settings, engine=engine)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(600):  # up to 30 s for start-up (the warm-up decision included)
        if server.started:
            break
        time.sleep(0.05)
    assert server.started, "uvicorn did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", port
    finally:
        server.should_exit = True
        thread.join(30)
