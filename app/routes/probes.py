"""The probes and metrics: GET /health (the process is up, also while the weights load), GET /ready (the
lifecycle's verdict: 200 once it answers, else 503 saying why; the self-check's, shadow's and autotune's reports)
and GET /metrics (Prometheus)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app.context import context_of
from app.responses import RETRY_AFTER_SECONDS, hide_directory

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> Response:
    """{"status", "selfcheck": the report or null (off, or not run yet)}; 503 adds the error body."""
    context = context_of(request)
    lifecycle = context.lifecycle
    is_ready, status, why = lifecycle.readiness()
    report = lifecycle.selfcheck_report()
    body: dict[str, Any] = {"status": status, "selfcheck": report.to_json() if report is not None else None}
    engine = lifecycle.engine
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
    if lifecycle.autotune is not None:
        body["autotune"] = lifecycle.autotune.to_json()
    if is_ready:
        return JSONResponse(body)
    body["detail"] = {
        "error_type": "service_unavailable",
        "message": hide_directory(why, context.settings.release_dir, "the release"),
    }
    return JSONResponse(body, status_code=503, headers={"Retry-After": RETRY_AFTER_SECONDS})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    context = context_of(request)
    context.metrics.observe_engine(context.lifecycle.engine)
    return Response(context.metrics.render(), media_type=context.metrics.content_type)
