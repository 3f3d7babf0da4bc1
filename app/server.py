"""The HTTP service: builds the app (middleware, error handlers, one router per surface: app/routes/) around one
server's context (app.context: its settings, its lifecycle, its metrics) and runs it (DrainingServer). The
lifecycle (clef_cuda.lifecycle) decides whether the server may answer; the routes map HTTP onto it.

With an API key, every /v1 route needs it (RequireKeyOnV1, so a route added later cannot forget it);
/health, /ready and /metrics stay open for probes and scrapers. No response names a server path: the
model is described by name, and messages that would name the release or adapter directories say
"the release" / "<adapter-root>" instead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

import clef_cuda
from app.auth import RequireKeyOnV1
from app.context import ServerContext, ServerSettings
from app.intake import ClientError
from app.metrics import LifecycleMetrics, Metrics
from app.responses import error_response
from app.routes import adapters, probes, status_page, systemone, workers_ai
from app.schemas import SystemOneRequest
from clef_cuda.lifecycle import Lifecycle, LifecycleSettings
from clef_cuda.serving.engine import Engine

__all__ = ["DrainingServer", "ServerSettings", "create_app"]

log = logging.getLogger("clef_serve")


def create_app(
    settings: ServerSettings = ServerSettings(),
    load_engine: Callable[[], Engine] | None = None,
    engine: Engine | None = None,
    warm_up: bool = True,
) -> FastAPI:
    """The ASGI app. Give either an `engine` (ready now) or `load_engine` (called on a background thread at
    start-up, so /health answers while weights load)."""
    metrics = Metrics(vllm_aliases=settings.vllm_metric_aliases)
    lifecycle = Lifecycle(
        LifecycleSettings(
            served_model_name=settings.served_model_name,
            selfcheck=settings.selfcheck,
            autotune=settings.autotune,
            autotune_cache=settings.autotune_cache,
            kernel_trials=settings.kernel_trials,
            warm_up=warm_up,
        ),
        LifecycleMetrics(metrics),
    )

    tracing = None
    if settings.otlp_traces_endpoint:
        from app.tracing import Tracing

        tracing = Tracing(settings.otlp_traces_endpoint, "clef-serve", clef_cuda.__version__)

    async def lifespan(_app: FastAPI):
        if engine is not None:
            lifecycle.start(engine)
        elif load_engine is not None:
            threading.Thread(target=lifecycle.load, args=(load_engine,), name="clef-loader", daemon=True).start()
        yield
        await run_in_threadpool(lifecycle.shutdown, 60.0)
        if tracing is not None:  # after the engine: a shadow span of the last records may still come
            await run_in_threadpool(tracing.shutdown)

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
    app.state.context = ServerContext(settings, lifecycle, metrics, tracing)
    app.state.lifecycle = lifecycle  # the CLI hands its rank_lost to the group before the load starts
    app.state.drain = lifecycle.drain  # SIGTERM (DrainingServer)

    @app.exception_handler(ClientError)
    async def client_error(_request: Request, error: ClientError) -> JSONResponse:
        return error_response(error.status, error.error_type, error.message, error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "method_not_allowed"}.get(error.status_code, "invalid_request_error")
        return error_response(error.status_code, kind, str(error.detail), getattr(error, "headers", None))

    for surface in (systemone, workers_ai, adapters, probes, status_page):
        # The surface's routes on the app itself: FastAPI's include_router nests a router lazily, so app.routes (what
        # the key's middleware tests, the probes' manifests and the OpenAPI document walk) would not list them.
        app.router.routes.extend(surface.router.routes)
    app.openapi = lambda: _openapi(app)
    return app


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
        lifecycle: Lifecycle = self._app.state.lifecycle
        lifecycle.wait_until_idle(self._drain_timeout)
        # Not super().handle_exit: uvicorn would re-raise the recorded signal after its shutdown and the
        # process would die of SIGTERM. A completed drain is a clean exit: code 0.
        self.should_exit = True
