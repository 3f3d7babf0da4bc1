"""The JSON log (app/logs.py): every line written while a decision request is handled carries its request id (and
trace id), on the event loop and on the worker threads it hands work to; a line about another request names its own.
What is never logged (bodies, states, images, keys) is tested on a live server in test_production.py."""

from __future__ import annotations

import asyncio
import io
import json
import logging

from starlette.concurrency import run_in_threadpool

from app.logs import JsonFormatter, RequestContext, current_request


def capture() -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RequestContext())
    logger = logging.getLogger("clef_serve.test_logs")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, stream


def test_a_requests_lines_carry_its_ids_on_the_loop_and_in_worker_threads():
    logger, stream = capture()

    async def handle() -> None:
        token = current_request.set(("req-7", "4bf92f3577b34da6a3ce929d0e0e4736"))
        try:
            logger.info("on the loop")
            await run_in_threadpool(logger.warning, "in a worker thread")
            logger.error("about another request", extra={"request_id": "req-8"})
        finally:
            current_request.reset(token)
        logger.info("after the request")

    asyncio.run(handle())
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(line["message"], line.get("request_id"), line.get("trace_id")) for line in lines] == [
        ("on the loop", "req-7", "4bf92f3577b34da6a3ce929d0e0e4736"),
        ("in a worker thread", "req-7", "4bf92f3577b34da6a3ce929d0e0e4736"),
        ("about another request", "req-8", None),
        ("after the request", None, None),
    ]
    assert all({"time", "level", "logger", "message"} <= line.keys() for line in lines)
