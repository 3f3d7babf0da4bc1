"""TypeSafe's System One contract (shared/specs/systemone-api.md): POST /v1/systemone and GET /v1/models."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app import decisions
from app.context import context_of
from app.schemas import SystemOneRequest

router = APIRouter()


@router.post(
    "/v1/systemone",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": SystemOneRequest.model_json_schema()}},
        }
    },
)
async def systemone(request: Request) -> Response:
    return await decisions.frame(request, lambda: decisions.systemone(request))


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    context = context_of(request)
    settings, engine = context.settings, context.lifecycle.engine
    created = 1_767_225_600  # 2026-01-01, a fixed timestamp
    base = settings.served_model_name
    variants = engine.adapters.names() if engine is not None and engine.adapters else []
    return {
        "models": [{"name": base, "description": settings.model_description, "release_date": settings.release_date}]
        + [
            {"name": v, "description": f"a fine-tuned variant of {base}", "release_date": settings.release_date}
            for v in variants
        ],
        "object": "list",
        "data": [{"id": base, "object": "model", "created": created, "owned_by": "clef-cuda"}]
        + [{"id": v, "object": "model", "created": created, "owned_by": "clef-cuda", "parent": base} for v in variants],
    }
