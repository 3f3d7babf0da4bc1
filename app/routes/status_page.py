"""The status page: GET / (app/static/status.html, its script and style from /static/, nothing from anywhere else:
a strict Content-Security-Policy says so to the browser) and GET /status, the JSON it reads: the model and device,
readiness and its reason, the self-check's table, the autotune's choices, the shadow's counts and the last minutes'
decisions. Open like /ready and /metrics (it shows what they show); deciding from the page's form needs the key as
the API does, typed into the page. --no-status-page turns GET / and /static/ off (404); /status stays."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from app.context import context_of
from app.responses import error_response, hide_directory

router = APIRouter()

STATIC = Path(__file__).resolve().parents[1] / "static"
ASSETS = {  # the only files served: a name not here is a 404, never a path joined onto STATIC
    "status.js": "text/javascript; charset=utf-8",
    "status.css": "text/css; charset=utf-8",
}
# Scripts, styles and requests from this server only; no inline script or style, no frames, no form posts elsewhere.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _page_off(request: Request) -> Response | None:
    if not context_of(request).settings.status_page:
        return error_response(404, "not_found_error", "the status page is off (--no-status-page)")
    return None


@router.get("/", include_in_schema=False)
async def page(request: Request) -> Response:
    return _page_off(request) or FileResponse(STATIC / "status.html", media_type="text/html", headers=PAGE_HEADERS)


@router.get("/static/{name}", include_in_schema=False)
async def asset(request: Request, name: str) -> Response:
    off = _page_off(request)
    if off is not None:
        return off
    if name not in ASSETS:
        return error_response(404, "not_found_error", f"no asset {name!r}")
    return FileResponse(STATIC / name, media_type=ASSETS[name], headers=PAGE_HEADERS)


@router.get("/status")
async def status(request: Request) -> Response:
    """What the status page shows, as JSON."""
    context = context_of(request)
    settings, lifecycle = context.settings, context.lifecycle
    ready, state, why = lifecycle.readiness()
    engine = lifecycle.engine
    report = lifecycle.selfcheck_report()
    body: dict[str, Any] = {
        "served_model": settings.served_model_name,
        "aliases": list(settings.aliases),
        "model": settings.model_description,
        "device": None,
        "dtype": None,
        "quantize": settings.quantize,
        "tensor_parallel": settings.tensor_parallel_size,
        "variants": [],
        "ready": ready,
        "status": state,
        "reason": hide_directory(why, settings.release_dir, "the release") if why else None,
        "selfcheck": report.to_json() if report is not None else None,
        "autotune": lifecycle.autotune.to_json() if lifecycle.autotune is not None else None,
        "shadow": None,
        "recent": context.recent.summary(),
        "prefills": [],  # the running records' progress (Engine.prefills)
        "queued": 0,
    }
    if engine is not None:
        body["device"], body["dtype"] = (
            str(engine.decider.device),
            str(engine.decider.trunk.dtype).removeprefix("torch."),
        )
        body["variants"] = engine.adapters.names() if engine.adapters is not None else []
        body["prefills"], body["queued"] = engine.prefills(), engine.queue_depth
        stats = engine.shadow.stats
        body["shadow"] = {
            "verified": stats.match + stats.marginal + stats.mismatch,
            "match": stats.match,
            "marginal": stats.marginal,
            "mismatch": stats.mismatch,
            "dropped": stats.dropped,
            "rate": engine.shadow.config.rate,
        }
    return JSONResponse(body, headers={"Cache-Control": "no-store"})
