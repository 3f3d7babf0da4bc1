"""Cloudflare Workers AI's route (app/workers_ai.py: the path, its envelope and codes): any account id, the path's
model, the hosted confidence."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app import decisions, workers_ai
from app.auth import key_is_valid, missing_key_response
from app.context import context_of
from app.responses import error_response

router = APIRouter()


@router.post(workers_ai.ROUTE)
async def workers_ai_run(request: Request, account_id: str, model_path: str) -> Response:
    """RequireKeyOnV1 does not cover it: the key is checked here, first, so a refusal is the envelope's."""
    context = context_of(request)
    settings = context.settings

    async def decide() -> Response:
        if settings.api_key is not None and not key_is_valid(request.headers, settings.api_key):
            return missing_key_response()
        model = workers_ai.route_model(model_path)
        engine = context.lifecycle.engine
        variant = model is not None and engine is not None and engine.adapters is not None
        variant = variant and engine.adapters.get(model) is not None
        if model not in context.names and not variant:
            return error_response(
                404,
                "not_found_error",
                f"no route for {model_path!r}: this server serves "
                f"{workers_ai.MODEL_PREFIX}{settings.served_model_name}",
            )
        return await decisions.systemone(request, confidence="hosted", route_model=model)

    return await decisions.frame(
        request, decide, lambda response: workers_ai.envelope(response, context.lifecycle.status)
    )
