"""A decision over HTTP, the work both decision routes share (POST /v1/systemone, Cloudflare's Workers AI route):
the frame every decision goes through (request id, in-flight count, the contract's body for a fault of ours,
metrics, the log line) and the System One work itself (auth, intake, validation, images, submission, the wait).

Every error a client can cause is a 4xx in the contract's shape; only the server's own faults are 5xx, in the same
shape and counted (503 with Retry-After while loading, draining, overloaded, after a failed on-device self-check,
for a step out of device memory or failed on a tensor-parallel rank, and on a lost rank or GPU fault before the
process exits; 500 for a numerical overflow or anything else of ours).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from app import workers_ai
from app.auth import MISSING_KEY, key_is_valid
from app.context import ServerContext, context_of
from app.intake import ClientError, InvalidBody, decompress, parse_json, parse_multipart, read_body
from app.logs import current_request, log_decision, request_id_of
from app.responses import (
    RETRY_AFTER_SECONDS,
    error_response,
    hide_directory,
    pydantic_errors,
    validation_response,
)
from app.schemas import SystemOneRequest, unsupported_question_errors
from clef_cuda.errors import NumericalOverflowError, RequestError, RequestTooLongError
from clef_cuda.parallel.tensor_parallel import StepFailedOnRank, TensorParallelLost
from clef_cuda.request.images import ImageError
from clef_cuda.request.media import RequestMedia, collect_media
from clef_cuda.request.routing import prefix_key
from clef_cuda.runtime.cuda_errors import OUT_OF_MEMORY, TRANSIENT, classify, first_line
from clef_cuda.serving.engine import EngineStoppedError, QueueFullError, RequestCancelledError
from clef_cuda.verification.guarded_ops import KernelFault

log = logging.getLogger("clef_serve")


async def frame(
    request: Request,
    decide: Callable[[], Awaitable[Response]],
    present: Callable[[Response], Response] = lambda r: r,
) -> Response:
    """A decision route's frame: the request id, the in-flight count (a drain waits for it), a fault of ours
    nothing below caught still in the contract's body, the metrics and the log line of what the client got
    (`present`: the route's form of the response)."""
    context = context_of(request)
    started = time.perf_counter()
    request.state.request_id = request_id_of(request)
    trace = None
    if context.tracing is not None:
        trace = context.tracing.start(request.method, request.url.path, request.headers, request.state.request_id)
    request.state.trace = trace
    current = current_request.set((request.state.request_id, trace.trace_id if trace is not None else None))
    with context.lifecycle.handling():
        try:
            response = await decide()
        except Exception as error:  # a fault of ours nothing above caught: still the contract's body, counted
            log.exception("POST %s failed", request.url.path)
            message = f"the server failed: {first_line(error)}"
            response = error_response(
                500, "internal_error", hide_directory(message, context.settings.release_dir, "the release")
            )
    seconds = time.perf_counter() - started
    response.headers["X-Request-Id"] = request.state.request_id
    response = present(response)
    context.metrics.requests.labels(status=str(response.status_code)).inc()
    if response.status_code == 200:
        context.metrics.latency.observe(seconds)
    log_decision(request, response.status_code, seconds)
    context.recent.record(response.status_code, seconds, getattr(request.state, "result", None))
    if trace is not None:
        state = request.state
        trace.finish(
            response.status_code,
            getattr(state, "model", None),
            getattr(state, "variant", False),
            getattr(state, "result", None),
            getattr(state, "error_type", None),
        )
    current_request.reset(current)
    return response


def check_key(context: ServerContext, request: Request) -> None:
    """The decision route's own check (RequireKeyOnV1 guards every other /v1 route)."""
    api_key = context.settings.api_key
    if api_key is not None and not key_is_valid(request.headers, api_key):
        raise ClientError(401, "authentication_error", MISSING_KEY, {"WWW-Authenticate": "Bearer"})


async def read_request(request: Request, context: ServerContext) -> tuple[Any, dict[str, bytes] | None]:
    """The body as JSON (decompressed, bounded, off the event loop) and, for the SDK's multipart uploads, its other
    parts. InvalidBody for a body that is not JSON."""
    settings = context.settings
    raw = await read_body(request, settings.max_body_bytes, settings.body_timeout)
    raw = decompress(raw, request.headers.get("content-encoding", ""), settings.max_body_bytes)
    content_type = request.headers.get("content-type", "")
    parts = None
    # off the event loop: a body of many megabytes takes a while to parse
    if content_type.lower().startswith("multipart/form-data"):  # the SDK's image uploads
        raw, parts = await run_in_threadpool(parse_multipart, raw, content_type)
    body = await run_in_threadpool(parse_json, raw, settings.max_json_depth)
    return body, parts


def image_refusal(error: ImageError, found: RequestMedia | None = None) -> Response:
    """An image or video the request cannot use (VideoError is an ImageError): a 413 over a byte, pixel or length
    limit, else a 422 located where the client put it (`found`: the request's media, for an error about one of the
    combined lists)."""
    if error.status == 413:
        raise ClientError(413, "request_too_large", str(error)) from error
    loc = found.loc_of(error.loc) if found is not None else ["body", *error.loc]
    return validation_response([{"loc": loc, "msg": str(error), "type": error.error_type}])


async def systemone(request: Request, confidence: str | None = None, route_model: str | None = None) -> Response:
    """POST /v1/systemone's work; the Workers AI route's too, with its `route_model` (the path's: it replaces the
    body's `model`, and top-level fields the hosted validator does not know are a 422) and the hosted
    `confidence`."""
    context = context_of(request)
    try:
        check_key(context, request)
        engine = context.answering_engine()
        try:
            body, parts = await read_request(request, context)
        except InvalidBody as error:
            return validation_response(error.as_detail())
        if route_model is not None:
            unknown = workers_ai.unknown_fields(body)
            if unknown:
                return validation_response(unknown)
            if isinstance(body, dict):
                body["model"] = route_model
        unsupported = unsupported_question_errors(body)
        if unsupported:
            return validation_response(unsupported)
        try:
            await run_in_threadpool(SystemOneRequest.model_validate, body)
        except ValidationError as error:
            return validation_response(pydantic_errors(error))
        return await _decide(request, context, engine, body, parts, confidence)
    except ClientError as error:
        request.state.error_type = error.error_type
        return error_response(error.status, error.error_type, error.message, error.headers)


async def _decide(request: Request, context: ServerContext, engine, body, parts, confidence) -> Response:
    """A valid body: its model resolved, its images collected, its record encoded and submitted, the answer waited
    for. ClientError for what refuses it."""
    # The routing hint, from the request as the client sent it (before [image N] and the alias).
    key_material = (body["model"], body["state"])
    variant = body["model"] not in context.names
    if variant and (engine.adapters is None or engine.adapters.get(body["model"]) is None):
        raise ClientError(
            404,
            "not_found_error",
            f"model {body['model']!r} is not served here (try {context.settings.served_model_name!r})",
        )
    if not variant:
        body["model"] = context.settings.served_model_name  # answer with the served name, also for the alias
    request.state.model, request.state.variant = body["model"], variant
    trace = request.state.trace
    try:
        options = engine.decider.options
        found = collect_media(body, parts, options.image_limits, options.video_limits)
    except ImageError as error:
        return image_refusal(error)
    deadline = time.monotonic() + context.settings.request_timeout  # a slot's wait, the encoding, the answer's
    try:
        with engine.admit() as admission:  # a place in the queue first: its refusal comes before any decoding
            adapter = engine.adapters.acquire(body["model"]) if variant else None
            if variant and adapter is None:  # unloaded in the meantime
                raise ClientError(404, "not_found_error", f"model {body['model']!r} is not served here")
            try:
                record, prepared = await _encode(context, engine, body, found, trace, deadline)
            except BaseException:
                if adapter is not None:
                    engine.adapters.release(adapter)
                raise
            timeline = trace.timeline if trace is not None else None
            # the engine releases the adapter from here on, refused or not
            ticket = engine.submit(
                body, record, prepared, adapter, request.state.request_id, confidence, timeline, admission
            )
    except ImageError as error:
        return image_refusal(error, found)
    except RequestError as error:
        return validation_response([{"loc": ["body", *error.loc], "msg": str(error), "type": "value_error"}])
    except RequestTooLongError as error:
        raise ClientError(413, "request_too_large", str(error)) from error
    except QueueFullError as error:
        raise ClientError(503, "overloaded_error", str(error), {"Retry-After": RETRY_AFTER_SECONDS}) from error
    except EngineStoppedError as error:
        raise ClientError(503, "service_unavailable", str(error), {"Retry-After": RETRY_AFTER_SECONDS}) from error
    result = await _wait(request, context, engine, ticket, deadline)
    metrics = context.metrics
    metrics.prompt_tokens.inc(result["usage"]["input_tokens"])
    metrics.cached_tokens.inc(result.get("x_cached_tokens", 0))
    metrics.queue_latency.observe(result.get("x_timing_ms", {}).get("queue", 0.0) / 1e3)
    metrics.observe_decision(request.state.model, result)
    request.state.result = result
    routing = {
        "X-Clef-Prefix-Key": prefix_key(*key_material, found.images, [video for video, _ in found.videos]),
        "X-Clef-Prefix-Cache": "hit" if result.get("x_cached_tokens", 0) > 0 else "miss",
    }
    return JSONResponse(result, headers=routing)


async def _encode(context: ServerContext, engine, body, found: RequestMedia, trace, deadline: float):
    """The record and its media's tower inputs (Engine.encode, on a worker thread), a request with videos first
    waiting for one of the server's decoding slots (context.video_decodes) until `deadline`."""
    timeline = trace.timeline if trace is not None else None
    started = time.time_ns()
    slot = context.video_decodes.slot(deadline - time.monotonic()) if found.videos else contextlib.nullcontext()
    async with slot:
        record, prepared = await run_in_threadpool(engine.encode, body, found.images, found.videos, timeline)
    if timeline is not None:  # a child of the request's span like the engine's steps: clef.images, ...
        timeline.add("encode", started, images=len(found.images), videos=len(found.videos), tokens=record.num_tokens)
    return record, prepared


async def _wait(request: Request, context: ServerContext, engine, ticket, deadline: float) -> dict[str, Any]:
    """The ticket's answer; the client's disconnect (499) or the request timeout (503 timeout) cancels it; what a
    failed step means to this request as the contract's error. The wait's own refusals are raised outside the
    step's mapping below, which would make them a 500 internal_error logged as a failed request."""
    settings = context.settings
    future = asyncio.wrap_future(ticket.future)
    try:
        while not (await asyncio.wait({future}, timeout=settings.disconnect_poll_seconds))[0]:
            if await request.is_disconnected():
                engine.cancel(ticket)  # frees its slot and blocks at the next step
                raise ClientError(499, "client_closed_request", "the client disconnected")
            if time.monotonic() > deadline:
                engine.cancel(ticket)
                raise ClientError(
                    503,
                    "timeout",
                    f"no answer within {settings.request_timeout:g} s (--request-timeout)",
                    {"Retry-After": RETRY_AFTER_SECONDS},
                )
    except asyncio.CancelledError:
        engine.cancel(ticket)
        raise
    try:
        return future.result()
    except NumericalOverflowError as error:
        log.error("numerical overflow: %s", error)
        raise ClientError(500, "internal_error", str(error)) from error
    except (KernelFault, TensorParallelLost, EngineStoppedError) as error:  # the server is about to restart
        raise ClientError(503, "service_unavailable", str(error), {"Retry-After": RETRY_AFTER_SECONDS}) from error
    except RequestCancelledError as error:
        raise ClientError(499, "client_closed_request", "the request was cancelled") from error
    except Exception as error:  # a step that failed: this request fails, the server serves on
        log.error("request %s failed: %s", request.state.request_id, first_line(error))
        release = settings.release_dir
        if isinstance(error, StepFailedOnRank) or classify(error) in (OUT_OF_MEMORY, TRANSIENT):
            message = hide_directory(f"this request's step failed: {first_line(error)}", release, "the release")
            raise ClientError(503, "service_unavailable", message, {"Retry-After": RETRY_AFTER_SECONDS}) from error
        message = hide_directory(f"this request failed: {first_line(error)}", release, "the release")
        raise ClientError(500, "internal_error", message) from error
