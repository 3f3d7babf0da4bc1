"""The HTTP service: POST /v1/systemone per shared/specs/systemone-api.md, plus /v1/models, /health, /ready
and /metrics. Routes validate and translate; the engine (clef_cuda.serving.engine) owns the model.

Every error a client can cause is a 4xx in the contract's shape: 422 `{"detail": [{"loc", "msg", "type"}]}`
for an invalid body, `{"detail": {"error_type", "message"}}` for the rest. Only the server's own faults
are 5xx, in the same shape and counted (503 with Retry-After while loading, draining, overloaded, after a
failed on-device self-check, for a step out of device memory or failed on a tensor-parallel rank, and on a
lost rank or GPU fault before the process exits; 500 for a numerical overflow or anything else of ours).

With an API key, every /v1 route needs it (RequireKeyOnV1, so a route added later cannot forget it);
/health, /ready and /metrics stay open for probes and scrapers. No response names a server path: the
model is described by name, and messages that would name the release or adapter directories say
"the release" / "<adapter-root>" instead.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from app import workers_ai
from app.intake import ClientError, InvalidBody, decompress, parse_json, read_body
from app.logs import log_decision, request_id_of
from app.media import collect_images, parse_multipart
from app.metrics import Metrics
from app.schemas import SystemOneRequest, capacity_message, unsupported_question_errors
from clef_cuda.errors import NumericalOverflowError, RequestError, RequestTooLongError
from clef_cuda.model.adapters import AdapterError, check_variant_name
from clef_cuda.parallel.tensor_parallel import StepFailedOnRank, TensorParallelLost
from clef_cuda.request.images import ImageError
from clef_cuda.request.routing import prefix_key
from clef_cuda.runtime.cuda_errors import OUT_OF_MEMORY, TRANSIENT, classify, first_line
from clef_cuda.serving.engine import Engine, EngineStoppedError, QueueFullError, RequestCancelledError
from clef_cuda.tuning.autotune import AutotuneReport, autotune, cache_file, install, record_kernel_failure
from clef_cuda.verification.guarded_ops import KernelFault
from clef_cuda.verification.selfcheck import SelfCheckReport, run_selfcheck

# A sticky CUDA error killed this process's GPU context (clef_cuda.verification.guarded_ops): the kernel is recorded
# as failed in the autotune cache and the process exits with this, for its supervisor to start it again.
EXIT_KERNEL_FAULT = 4
EXIT_TENSOR_PARALLEL_LOST = 5  # a tensor-parallel rank died, hung or failed a collective

log = logging.getLogger("clef_serve")
RETRY_AFTER_SECONDS = "1"


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str = "clef-flash"
    aliases: tuple[str, ...] = ("jev-latest",)
    api_key: str | None = None
    max_body_bytes: int = 32 * 2**20  # compressed or not, and again after decompression
    request_timeout: float = 600.0
    body_timeout: float = 30.0  # seconds to receive a whole request body (slow or stalled clients: 408)
    cors_origins: tuple[str, ...] = ()  # no CORS headers at all unless origins are configured
    model_description: str = "clef-flash System One decision model"  # a name, never where it lives
    release_dir: str | None = None  # never shown to clients: messages naming it say "the release"
    release_date: str = "2026-10-01"
    disconnect_poll_seconds: float = 0.05
    selfcheck: str = "enforce"  # enforce: a failed on-device self-check keeps /ready 503; warn: serve anyway; off
    # The start-up autotune (clef_cuda.tuning.autotune): fast, full or off (the CLI's default is fast), and
    # where its choices are cached (None: not cached).
    autotune: str = "off"
    autotune_cache: str | None = None
    # Where never-run kernels are first tried (clef_cuda.tuning.trials): auto (a child process on a GPU),
    # child, inline.
    kernel_trials: str = "auto"
    adapter_root: str | None = None  # set: runtime adapter loading is on, from under this directory only
    vllm_metric_aliases: bool = True  # the protocol gauges under vLLM's names too
    max_json_depth: int = 256  # deeper bodies are a 422 before they are parsed


class ServerState:
    """loading -> ready -> draining (or failed, or selfcheck_failed: never ready). The engine appears once
    the model is loaded, its kernels passed the self-check and a warm-up decision is done."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.status = "loading"
        self.error: str | None = None
        self.in_flight = 0  # decision requests being handled (a drain waits for them)
        self.selfcheck: SelfCheckReport | None = None
        self.autotune: AutotuneReport | None = None

    def idle(self) -> bool:
        engine = self.engine
        return self.in_flight == 0 and (engine is None or (engine.queue_depth == 0 and engine.running == 0))


def error_response(status: int, error_type: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": {"error_type": error_type, "message": message}}, status_code=status, headers=headers)


def key_is_valid(headers, api_key: str) -> bool:
    """`Authorization: Bearer <api_key>`, compared in constant time (equal-length digests: the key never
    leaks through timing)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    given = token.strip().encode() if scheme.lower() == "bearer" else b""
    return hmac.compare_digest(
        hmac.new(b"clef", given, "sha256").digest(), hmac.new(b"clef", api_key.encode(), "sha256").digest()
    )


MISSING_KEY = "missing or invalid API key (Authorization: Bearer <key>)"


def missing_key_response() -> JSONResponse:
    return error_response(401, "authentication_error", MISSING_KEY, {"WWW-Authenticate": "Bearer"})


class RequireKeyOnV1:
    """ASGI middleware: with an API key set, any request to /v1 or under /v1/ without it is a 401 before a
    route (or its 404) is reached. `checked_in_route` lists the routes that check the key themselves so
    that a refusal is logged and counted as theirs (POST /v1/systemone's decision log line)."""

    def __init__(self, app, api_key: str | None, checked_in_route: frozenset[str]) -> None:
        self.app, self.api_key, self.checked_in_route = app, api_key, checked_in_route

    async def __call__(self, scope, receive, send) -> None:
        if (
            self.api_key is not None
            and scope["type"] == "http"
            and (scope["path"] == "/v1" or scope["path"].startswith("/v1/"))
            and scope["path"] not in self.checked_in_route
        ):
            from starlette.datastructures import Headers

            if not key_is_valid(Headers(scope=scope), self.api_key):
                await missing_key_response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def validation_response(errors: list[dict[str, Any]]) -> JSONResponse:
    return JSONResponse({"detail": errors}, status_code=422)


def _pydantic_errors(error: ValidationError) -> list[dict[str, Any]]:
    """FastAPI's 422 items; a count over or under its limit (questions, options, levels) in words that name
    the kind, the limit and the value sent (app.schemas.capacity_message)."""
    return [
        {
            "loc": ["body", *e["loc"]],
            "msg": capacity_message(e["loc"], e["type"], _count(e.get("input"))) or e["msg"],
            "type": e["type"],
        }
        for e in error.errors(include_url=False, include_input=True)
    ]


def _count(value: Any) -> int | None:
    # pydantic stops counting a dict at its limit (ctx's actual_length is None there): the input is counted here.
    return len(value) if isinstance(value, dict | list) else None


def create_app(
    settings: ServerSettings = ServerSettings(),
    load_engine: Callable[[], Engine] | None = None,
    engine: Engine | None = None,
    warm_up: bool = True,
) -> FastAPI:
    """The ASGI app. Give either an `engine` (ready now) or `load_engine` (called on a background thread at
    start-up, so /health answers while weights load)."""
    state = ServerState()
    metrics = Metrics(vllm_aliases=settings.vllm_metric_aliases)
    names = {settings.served_model_name, *settings.aliases}

    def passes_selfcheck(loaded: Engine) -> bool:
        """The kernels proven on this device before any traffic (clef_cuda.verification.selfcheck); False when a failure
        must keep the server unready."""
        if settings.selfcheck == "off":
            log.warning("the on-device kernel self-check is off (--selfcheck off): kernels are not verified here")
            return True
        try:
            report = run_selfcheck(loaded.decider.trunk, block_size=loaded.config.block_size)
        except KernelFault as fault:  # a kernel the trials never ran at these shapes took the device down
            kernel_fault(state.autotune, fault)
            return False
        except TensorParallelLost as error:
            tensor_parallel_lost(str(error), error.kernel_fault)
            return False
        state.selfcheck = report
        metrics.observe_selfcheck(report)
        if report.passed:
            log.info("on-device kernel self-check %s\n%s", report.summary(), report.table())
            return True
        banner = "!" * 100
        log.error("%s\non-device kernel self-check %s\n%s\n%s", banner, report.summary(), report.table(), banner)
        if settings.selfcheck == "warn":
            log.error("--selfcheck warn: SERVING ANYWAY on kernels that failed their self-check; answers may be wrong")
            return True
        state.status, state.error = "selfcheck_failed", f"the on-device kernel self-check {report.summary()}"
        return False

    def tune(loaded: Engine) -> None:
        """Every kernel tried (on a GPU in a child process first: clef_cuda.tuning.trials) and the fastest
        verified implementation per op and call shape chosen, on this device; the trunk then runs on the
        guarded op library. Never fatal: a failure leaves the dispatch rule's kernels."""
        trunk = loaded.decider.trunk
        loaded.on_kernel_fault = functools.partial(kernel_fault, None)  # wired whatever the autotune does
        try:
            report = autotune(trunk, loaded.config, settings.autotune, settings.autotune_cache, settings.kernel_trials)
        except Exception:
            log.exception("the autotune failed: serving on the default kernels, each one guarded")
            try:  # a fault is still named by kernel, a launch error still routed to the reference
                install(trunk, AutotuneReport(settings.autotune, {}), [], None, loaded.config)
            except Exception:
                log.exception("installing the guarded op library failed")
            return
        loaded.on_kernel_fault = functools.partial(kernel_fault, report)
        if report is not None:
            state.autotune = report
            metrics.observe_autotune(report)
            log.info("%s", report.table())

    def kernel_fault(report: AutotuneReport | None, fault: KernelFault) -> None:
        """A sticky CUDA error: this process can run nothing more on its GPU. The kernel is recorded as failed
        in the autotune cache (the next start skips it), /ready turns 503, and the process exits with
        EXIT_KERNEL_FAULT a moment later (in-flight requests get their 503 first)."""
        where = "not recorded (no --autotune-cache: the next start tries it again)"
        if report is not None and settings.autotune_cache and report.key:
            path = cache_file(Path(settings.autotune_cache), report.key)
            record_kernel_failure(path, report.key, fault.kernel, f"faulted while serving: {fault.error}")
            where = "recorded as failed in the autotune cache: the next start runs without it"
        state.status, state.error = "failed", str(fault)
        metrics.ready.set(0)
        log.critical("clef-serve: %s; %s; exiting (%d)", fault, where, EXIT_KERNEL_FAULT)
        timer = threading.Timer(1.0, lambda: os._exit(EXIT_KERNEL_FAULT))
        timer.daemon = True
        timer.start()

    def tensor_parallel_lost(reason: str, fault: KernelFault | None = None) -> None:
        """A rank is gone (exited, hung past --tensor-parallel-timeout, a collective failed, or it never started):
        no step can run again. /ready turns 503, and the process exits EXIT_TENSOR_PARALLEL_LOST a moment later
        (the restart starts every rank afresh); a worker's sticky CUDA fault is a kernel fault instead: recorded,
        exit EXIT_KERNEL_FAULT."""
        if fault is not None:
            kernel_fault(state.autotune, fault)
            return
        state.status, state.error = "failed", reason
        metrics.ready.set(0)
        log.critical("clef-serve: %s; exiting (%d)", reason, EXIT_TENSOR_PARALLEL_LOST)
        timer = threading.Timer(1.0, lambda: os._exit(EXIT_TENSOR_PARALLEL_LOST))
        timer.daemon = True
        timer.start()

    def become_ready(loaded: Engine) -> None:
        peers = loaded.decider.trunk.peers
        if peers is not None:  # tensor parallel: a rank lost from here on takes the server down
            peers.on_lost = tensor_parallel_lost
            if peers.lost is not None:
                tensor_parallel_lost(peers.lost)
                return
        tune(loaded)  # first: on a GPU it tries every kernel where a fault costs nothing
        if not passes_selfcheck(loaded):
            return  # never started: /ready stays 503 and decisions are refused, naming the failed checks
        if loaded.adapters is not None:  # the start-up loads (runtime ones are counted as they happen)
            metrics.adapter_loads.labels(result="ok").inc(loaded.adapters.loads["ok"])
        loaded.start()
        if warm_up:
            loaded.decide(
                {
                    "model": settings.served_model_name,
                    "state": "warm-up",
                    "questions": {"ready": {"type": "noul", "instructions": "Is the server ready?"}},
                },
                timeout=600,
            )
        state.engine = loaded
        state.status = "ready"
        metrics.ready.set(1)
        log.info("ready: serving %s", settings.served_model_name)

    def load_in_background() -> None:
        try:
            become_ready(load_engine())
        except Exception as error:
            state.status, state.error = "failed", f"{type(error).__name__}: {error}"
            log.exception("loading the model failed")
            if getattr(error, "fatal", False):  # a tensor-parallel rank could not start: restart them all
                tensor_parallel_lost(str(error))

    async def lifespan(_app: FastAPI):
        if engine is not None:
            become_ready(engine)
        elif load_engine is not None:
            threading.Thread(target=load_in_background, name="clef-loader", daemon=True).start()
        yield
        state.status = "draining"
        metrics.ready.set(0)
        if state.engine is not None:
            await run_in_threadpool(state.engine.stop, 60.0)

    app = FastAPI(title="clef-serve", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    # Added first, so it sits inside CORS: a browser's preflight (no credentials by design) is answered.
    app.add_middleware(RequireKeyOnV1, api_key=settings.api_key, checked_in_route=frozenset({"/v1/systemone"}))
    if settings.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "Content-Encoding"],
        )
    app.state.server = state
    app.state.metrics = metrics
    app.state.tensor_parallel_lost = tensor_parallel_lost  # the CLI hands it to the group before the load starts
    app.state.settings = settings

    def drain() -> None:
        """Stop taking decisions (SIGTERM): /ready turns 503, in-flight ones finish."""
        state.status = "draining"
        metrics.ready.set(0)
        if state.engine is not None:
            state.engine.drain()

    app.state.drain = drain

    @app.exception_handler(ClientError)
    async def client_error(_request: Request, error: ClientError) -> JSONResponse:
        return error_response(error.status, error.error_type, error.message, error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "method_not_allowed"}.get(error.status_code, "invalid_request_error")
        return error_response(error.status_code, kind, str(error.detail), getattr(error, "headers", None))

    def check_auth(request: Request) -> None:
        """The decision route's own check (RequireKeyOnV1 guards every other /v1 route)."""
        if settings.api_key is not None and not key_is_valid(request.headers, settings.api_key):
            raise ClientError(401, "authentication_error", MISSING_KEY, {"WWW-Authenticate": "Bearer"})

    def ready_engine() -> Engine:
        failure = state.engine.verification_failure if state.engine is not None else None
        if failure:  # a shadow mismatch or a timed self-check failed (enforce): out of rotation, kept alive
            raise ClientError(
                503,
                "service_unavailable",
                f"this server does not answer: {failure}",
                {"Retry-After": RETRY_AFTER_SECONDS},
            )
        if state.status != "ready" or state.engine is None:
            why = {
                "loading": "the model is still loading",
                "draining": "the server is shutting down",
                "selfcheck_failed": f"this server does not answer: {state.error}",
            }.get(state.status, f"the model failed to load: {state.error}")
            raise ClientError(503, "service_unavailable", why, {"Retry-After": RETRY_AFTER_SECONDS})
        return state.engine

    @app.post(
        "/v1/systemone",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": SystemOneRequest.model_json_schema()}},
            }
        },
    )
    async def systemone(request: Request) -> Response:
        return await _decision(request, lambda: _systemone(request))

    @app.post(workers_ai.ROUTE)
    async def workers_ai_run(request: Request, account_id: str, model_path: str) -> Response:
        """Cloudflare Workers AI's route (app/workers_ai.py): any account id, the path's model, its envelope.
        RequireKeyOnV1 does not cover it: the key is checked here, first, so a refusal is the envelope's."""

        async def decide() -> Response:
            if settings.api_key is not None and not key_is_valid(request.headers, settings.api_key):
                return missing_key_response()
            model = workers_ai.route_model(model_path)
            engine = state.engine
            variant = model is not None and engine is not None and engine.adapters is not None
            variant = variant and engine.adapters.get(model) is not None
            if model not in names and not variant:
                return error_response(
                    404,
                    "not_found_error",
                    f"no route for {model_path!r}: this server serves "
                    f"{workers_ai.MODEL_PREFIX}{settings.served_model_name}",
                )
            return await _systemone(request, confidence="hosted", route_model=model)

        return await _decision(request, decide, lambda response: workers_ai.envelope(response, state.status))

    async def _decision(request: Request, decide, present: Callable[[Response], Response] = lambda r: r) -> Response:
        """A decision route's frame: the request id, the in-flight count (a drain waits for it), a fault of ours
        nothing below caught still in the contract's body, the metrics and the log line of what the client got
        (`present`: the route's form of the response)."""
        started = time.perf_counter()
        request.state.request_id = request_id_of(request)
        state.in_flight += 1
        try:
            response = await decide()
        except Exception as error:  # a fault of ours nothing above caught: still the contract's body, counted
            log.exception("POST %s failed", request.url.path)
            response = error_response(
                500,
                "internal_error",
                _hide_directory(f"the server failed: {first_line(error)}", settings.release_dir, "the release"),
            )
        finally:
            state.in_flight -= 1
        seconds = time.perf_counter() - started
        response.headers["X-Request-Id"] = request.state.request_id
        response = present(response)
        metrics.requests.labels(status=str(response.status_code)).inc()
        if response.status_code == 200:
            metrics.latency.observe(seconds)
        log_decision(request, response.status_code, seconds)
        return response

    async def _systemone(request: Request, confidence: str | None = None, route_model: str | None = None) -> Response:
        """POST /v1/systemone's work; the Workers AI route's too, with its `route_model` (the path's: it replaces
        the body's `model`, and top-level fields the hosted validator does not know are a 422) and the hosted
        `confidence`."""
        try:
            check_auth(request)
            engine = ready_engine()
            raw = await read_body(request, settings.max_body_bytes, settings.body_timeout)
            raw = decompress(raw, request.headers.get("content-encoding", ""), settings.max_body_bytes)
            content_type = request.headers.get("content-type", "")
            parts = None
            try:  # off the event loop: a body of many megabytes takes a while to parse
                if content_type.lower().startswith("multipart/form-data"):  # the SDK's image uploads
                    raw, parts = await run_in_threadpool(parse_multipart, raw, content_type)
                body = await run_in_threadpool(parse_json, raw, settings.max_json_depth)
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
                return validation_response(_pydantic_errors(error))
            # The routing hint, from the request as the client sent it (before [image N] and the alias).
            key_material = (body["model"], body["state"])
            variant = body["model"] not in names
            if variant and (engine.adapters is None or engine.adapters.get(body["model"]) is None):
                raise ClientError(
                    404,
                    "not_found_error",
                    f"model {body['model']!r} is not served here (try {settings.served_model_name!r})",
                )
            if not variant:
                body["model"] = settings.served_model_name  # answer with the served name, also for the alias
            request.state.model = body["model"]
            try:
                found = collect_images(body, parts, engine.decider.options.image_limits)
            except InvalidBody as error:
                return validation_response(error.as_detail())
            adapter = engine.adapters.acquire(body["model"]) if variant else None
            if variant and adapter is None:  # unloaded in the meantime
                raise ClientError(404, "not_found_error", f"model {body['model']!r} is not served here")
            try:
                try:
                    record, prepared = await run_in_threadpool(engine.encode, body, found.images)
                except BaseException:
                    if adapter is not None:
                        engine.adapters.release(adapter)
                    raise
                # the engine releases the adapter from here on
                ticket = engine.submit(body, record, prepared, adapter, request.state.request_id, confidence)
            except ImageError as error:
                if error.status == 413:
                    raise ClientError(413, "request_too_large", str(error)) from error
                return validation_response([{"loc": found.loc_of(error.loc), "msg": str(error), "type": "value_error"}])
            except RequestError as error:
                return validation_response([{"loc": ["body", *error.loc], "msg": str(error), "type": "value_error"}])
            except RequestTooLongError as error:
                raise ClientError(413, "request_too_large", str(error)) from error
            except QueueFullError as error:
                raise ClientError(503, "overloaded_error", str(error), {"Retry-After": RETRY_AFTER_SECONDS}) from error
            except EngineStoppedError as error:
                raise ClientError(
                    503, "service_unavailable", str(error), {"Retry-After": RETRY_AFTER_SECONDS}
                ) from error
            result = await _wait(request, engine, ticket)
            metrics.prompt_tokens.inc(result["usage"]["input_tokens"])
            metrics.cached_tokens.inc(result.get("x_cached_tokens", 0))
            metrics.queue_latency.observe(result.get("x_timing_ms", {}).get("queue", 0.0) / 1e3)
            metrics.observe_decision(request.state.model, result)
            request.state.result = result
            routing = {
                "X-Clef-Prefix-Key": prefix_key(*key_material, found.images),
                "X-Clef-Prefix-Cache": "hit" if result.get("x_cached_tokens", 0) > 0 else "miss",
            }
            return JSONResponse(result, headers=routing)
        except ClientError as error:
            request.state.error_type = error.error_type
            return error_response(error.status, error.error_type, error.message, error.headers)

    async def _wait(request: Request, engine: Engine, ticket) -> dict[str, Any]:
        future = asyncio.wrap_future(ticket.future)
        deadline = time.monotonic() + settings.request_timeout
        try:
            while True:
                done, _ = await asyncio.wait({future}, timeout=settings.disconnect_poll_seconds)
                if done:
                    return future.result()
                if await request.is_disconnected():
                    engine.cancel(ticket)  # frees its slot and blocks at the next step
                    raise ClientError(499, "client_closed_request", "the client disconnected")
                if time.monotonic() > deadline:
                    engine.cancel(ticket)
                    raise ClientError(
                        503,
                        "timeout",
                        f"no answer within {settings.request_timeout:.0f} s",
                        {"Retry-After": RETRY_AFTER_SECONDS},
                    )
        except asyncio.CancelledError:
            engine.cancel(ticket)
            raise
        except NumericalOverflowError as error:
            log.error("numerical overflow: %s", error)
            raise ClientError(500, "internal_error", str(error)) from error
        except (KernelFault, TensorParallelLost, EngineStoppedError) as error:  # the server is about to restart
            raise ClientError(503, "service_unavailable", str(error), {"Retry-After": RETRY_AFTER_SECONDS}) from error
        except RequestCancelledError as error:
            raise ClientError(499, "client_closed_request", "the request was cancelled") from error
        except Exception as error:  # a step that failed: this request fails, the server serves on
            log.error("request %s failed: %s", request.state.request_id, first_line(error))
            if isinstance(error, StepFailedOnRank) or classify(error) in (OUT_OF_MEMORY, TRANSIENT):
                raise ClientError(
                    503,
                    "service_unavailable",
                    _hide_directory(
                        f"this request's step failed: {first_line(error)}", settings.release_dir, "the release"
                    ),
                    {"Retry-After": RETRY_AFTER_SECONDS},
                ) from error
            message = _hide_directory(f"this request failed: {first_line(error)}", settings.release_dir, "the release")
            raise ClientError(500, "internal_error", message) from error

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        created = 1_767_225_600  # 2026-01-01, a fixed timestamp
        base = settings.served_model_name
        variants = state.engine.adapters.names() if state.engine is not None and state.engine.adapters else []
        return {
            "models": [{"name": base, "description": settings.model_description, "release_date": settings.release_date}]
            + [
                {"name": v, "description": f"a fine-tuned variant of {base}", "release_date": settings.release_date}
                for v in variants
            ],
            "object": "list",
            "data": [{"id": base, "object": "model", "created": created, "owned_by": "clef-cuda"}]
            + [
                {"id": v, "object": "model", "created": created, "owned_by": "clef-cuda", "parent": base}
                for v in variants
            ],
        }

    # ---- runtime variants (vLLM's endpoints and bodies), only with --enable-adapter-loading ----------------
    def adapter_admin(request: Request) -> Engine:
        if settings.adapter_root is None:
            raise ClientError(404, "not_found_error", "runtime adapter loading is off (--enable-adapter-loading)")
        engine = ready_engine()
        if engine.adapters is None:
            raise ClientError(404, "not_found_error", "this server holds no adapters")
        return engine

    async def admin_body(request: Request, fields: tuple[str, ...]) -> dict[str, str]:
        raw = await read_body(request, 64 * 1024, settings.body_timeout)
        try:
            body = parse_json(raw, 8)
        except InvalidBody as error:
            raise ClientError(400, "invalid_request_error", error.message) from error
        if not isinstance(body, dict) or not all(isinstance(body.get(f), str) and body[f] for f in fields):
            raise ClientError(400, "invalid_request_error", f"the body must be a JSON object with {', '.join(fields)}")
        return body

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        try:
            engine = adapter_admin(request)
            body = await admin_body(request, ("lora_name", "lora_path"))
            name = body["lora_name"]
            try:
                check_variant_name(name)
            except ValueError as error:
                raise ClientError(400, "invalid_request_error", f"lora_name: {error}") from error
            if name in names:
                raise ClientError(400, "invalid_request_error", f"{name!r} is the served model's name")
            directory = _under_root(settings.adapter_root, body["lora_path"])
            try:
                await run_in_threadpool(engine.adapters.load, name, directory)
            except AdapterError as error:
                metrics.adapter_loads.labels(result="error").inc()
                message = _hide_directory(str(error), settings.adapter_root, "<adapter-root>")
                raise ClientError(400, "invalid_request_error", message) from error
            metrics.adapter_loads.labels(result="ok").inc()
            log.info("adapter %s loaded at runtime", name)
            return JSONResponse({"lora_name": name, "loaded": True})
        except ClientError as error:
            return error_response(error.status, error.error_type, error.message, error.headers)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        try:
            engine = adapter_admin(request)
            name = (await admin_body(request, ("lora_name",)))["lora_name"]
            adapter = engine.adapters.unload(name)
            if adapter is None:
                raise ClientError(404, "not_found_error", f"no adapter named {name!r} is loaded")
            engine.forget_variant(adapter.digest)
            log.info("adapter %s unloaded (its in-flight requests finish)", name)
            return JSONResponse({"lora_name": name, "unloaded": True})
        except ClientError as error:
            return error_response(error.status, error.error_type, error.message, error.headers)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        """{"status", "selfcheck": the report or null (off, or not run yet)}; 503 adds the error body."""
        engine = state.engine
        report = engine.selfcheck_report if engine is not None and engine.selfcheck_report else state.selfcheck
        failure = engine.verification_failure if engine is not None else None
        body: dict[str, Any] = {
            "status": "verification_failed" if failure else state.status,
            "selfcheck": report.to_json() if report is not None else None,
        }
        if engine is not None:
            stats = engine.shadow.stats
            body["shadow"] = {
                "match": stats.match,
                "mismatch": stats.mismatch,
                "marginal": stats.marginal,
                "dropped": stats.dropped,
                "resumed": stats.resumed,
                "restarted": stats.restarted,
                "floor_chunks": stats.floor_chunks,
                "last_mismatch": stats.last_mismatch,  # the request, and the first layer (and kind) that differed
            }
        if state.autotune is not None:
            body["autotune"] = state.autotune.to_json()
        if state.status == "ready" and not failure:
            return JSONResponse(body)
        message = failure or (state.status if state.error is None else state.error)
        body["detail"] = {
            "error_type": "service_unavailable",
            "message": _hide_directory(message, settings.release_dir, "the release"),
        }
        return JSONResponse(body, status_code=503, headers={"Retry-After": RETRY_AFTER_SECONDS})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        metrics.observe_engine(state.engine)
        return Response(metrics.render(), media_type=metrics.content_type)

    app.openapi = lambda: _openapi(app)
    return app


def _under_root(root: str, path: str) -> Path:
    """`path` (relative to the root, or absolute) resolved with every symlink, and inside the root: a path
    that leaves it, by .. or by a link, is refused; so is one the OS cannot take (a NUL byte, too long)."""
    base = Path(root).resolve()
    try:
        target = (base / path).resolve()
    except (ValueError, OSError) as error:  # "embedded null byte", ENAMETOOLONG, a symlink loop
        raise ClientError(400, "invalid_request_error", f"lora_path {path!r} is not a usable path ({error})") from error
    if target != base and base not in target.parents:
        raise ClientError(400, "invalid_request_error", f"lora_path {path!r} is outside --adapter-root")
    return target


def _hide_directory(message: str, directory: str | None, name: str) -> str:
    """`message` with a server directory (as given and as resolved) replaced by `name`: errors from the
    release or adapter loaders name files, and no response may say where they live."""
    if not directory:
        return message
    # The given form only when it looks like a path ("models" alone would clobber words of the message).
    forms = {str(Path(directory).resolve())} | {f for f in (directory, str(Path(directory))) if "/" in f}
    for form in sorted(forms, key=len, reverse=True):
        message = message.replace(form, name)
    return message


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document plus the request body's schema: the route reads the raw body itself (to decode
    gzip/zstd and bound its size), so the schema is declared here, with its parts under components."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        body = SystemOneRequest.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(body.pop("$defs", {}))
        schemas["SystemOneRequest"] = body
        document["paths"]["/v1/systemone"]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/SystemOneRequest"}}},
        }
        app.openapi_schema = document
    return app.openapi_schema


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains: /ready turns 503 and new decisions get 503 (with
    Retry-After) while the in-flight ones finish, for at most drain_timeout seconds; then uvicorn's own
    graceful stop and the engine's shutdown, exit code 0. A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout: float) -> None:
        super().__init__(config)
        self._app, self._drain_timeout, self._draining = app, drain_timeout, False

    @classmethod
    def run_app(cls, app: FastAPI, host: str, port: int, log_level: str, drain_timeout: float) -> None:
        # log_config=None: uvicorn writes through the root handler (app.logs), in the chosen format.
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, log_config=None)
        cls(config, app, drain_timeout).run()

    def handle_exit(self, sig: int, frame) -> None:
        if self._draining:
            return super().handle_exit(sig, frame)
        self._draining = True
        log.info("signal %s: draining (at most %.0f s)", sig, self._drain_timeout)
        self._app.state.drain()
        threading.Thread(target=self._stop_when_idle, name="clef-drain", daemon=True).start()

    def _stop_when_idle(self) -> None:
        deadline = time.monotonic() + self._drain_timeout
        state: ServerState = self._app.state.server
        while time.monotonic() < deadline and not state.idle():
            time.sleep(0.05)
        # Not super().handle_exit: uvicorn would re-raise the recorded signal after its shutdown and the
        # process would die of SIGTERM. A completed drain is a clean exit: code 0.
        self.should_exit = True
