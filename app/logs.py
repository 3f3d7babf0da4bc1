"""The server's log: text or JSON lines (--log-format), and one line per decision request with its id,
status, token counts and timings. Never a request body, a header or a key: nothing here reads them but
X-Request-Id, which is echoed only when it is a plain token (else a new id replaces it).

In JSON, every line written while a decision request is handled (on the event loop or a worker thread it hands work
to) carries its `request_id`, and its `trace_id` when traces are on; a line logged elsewhere about a request (the
shadow's verdict, on the engine's thread) passes `extra={"request_id": ...}` itself."""

from __future__ import annotations

import datetime
import json
import logging
import re
import sys
import uuid
from contextvars import ContextVar
from typing import Any

from fastapi import Request

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# What a client's X-Request-Id may be: the characters of UUIDs, ULIDs, W3C trace ids and the like. Anything
# else (spaces, quotes, newlines: a way to forge log lines) is replaced by an id of our own.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:+=/-]{1,128}")

decisions_log = logging.getLogger("clef_serve.requests")
# The decision request being handled here (set by app.decisions.frame; asyncio tasks and run_in_threadpool carry it).
current_request: ContextVar[tuple[str, str | None] | None] = ContextVar("clef_current_request", default=None)


class RequestContext(logging.Filter):
    """Stamps each record with the request being handled (request_id, trace_id) unless it names one itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        current = current_request.get()
        if current is not None and getattr(record, "request_id", None) is None:
            record.request_id, trace_id = current
            if trace_id is not None:
                record.trace_id = trace_id
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, the record's `fields`."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in ("request_id", "trace_id"):
            if getattr(record, name, None) is not None:
                line[name] = getattr(record, name)
        line.update(getattr(record, "fields", {}))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)  # ASCII-escaped: a log line is always one valid line


def configure_logging(level: str, log_format: str) -> None:
    """The root handler every logger (uvicorn's included) writes through, on stderr."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(RequestContext())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def request_id_of(request: Request) -> str:
    given = request.headers.get("x-request-id", "")
    return given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


def log_decision(request: Request, status: int, seconds: float) -> None:
    """The line for one POST /v1/systemone: what the route left in request.state, never the body."""
    fields: dict[str, Any] = {"request_id": request.state.request_id, "status": status, "seconds": round(seconds, 4)}
    result = getattr(request.state, "result", None)
    if result is not None:
        fields["input_tokens"] = result["usage"]["input_tokens"]
        fields["cached_tokens"] = result.get("x_cached_tokens", 0)
        for name, ms in result.get("x_timing_ms", {}).items():
            fields[f"{name}_ms"] = ms
    elif status != 200:
        fields["error_type"] = getattr(request.state, "error_type", "validation_error" if status == 422 else "error")
    decisions_log.info("decision %s", " ".join(f"{k}={v}" for k, v in fields.items()), extra={"fields": fields})
