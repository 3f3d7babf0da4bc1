"""Cloudflare Workers AI's route for the clef models (shared/specs/clients.md), so that code written against the
hosted API switches to this server by its base URL alone:

    POST /client/v4/accounts/{account_id}/ai/run/@cf/cloudflare/{model}     Authorization: Bearer <--api-key>

The body is the System One request (its `model` may be left out: the path names it); the answer comes in
Cloudflare's envelope, `{"result": <the System One response>, "success": true, "errors": [], "messages": []}`,
with the hosted confidence, (sum of p^2 - 1/n) / (1 - 1/n), in place of the reference's top probability. A
failure is `{"result": null, "success": false, "errors": [{"code", "message"}], "messages": []}` with the codes
clients document: 400/5006 no questions or an unknown question type, 400/7000 no route for that model, 400/6003
a body that is not JSON, 422/5012 any other validation failure (an unknown top-level field too, as the hosted
validator refuses it), 413/5021 too large, 429/3040 capacity (our 503 overload, with Retry-After; a server still
loading or draining stays 503, with the same code and Retry-After), 401/10000 an unknown token, and 529/5012
("inference failed") for every other 5xx: the engine refusing because its verification failed (a shadow
mismatch, a failed self-check), a model or step error, a timeout, a lost GPU or rank (Retry-After kept where
our answer had one). /v1/systemone answers those as its contract says (500, or 503 with Retry-After).

Any account id is accepted; the path's model is the served name, an alias or a loaded variant (else 400/7000).
The route runs the same pipeline as /v1/systemone (app.server): this module only names the route's model,
checks the fields the hosted validator knows, and translates the response.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse, Response

ROUTE = "/client/v4/accounts/{account_id}/ai/run/{model_path:path}"
MODEL_PREFIX = "@cf/cloudflare/"
# What the hosted validator accepts at the top level (videos: as its clef-omni takes them); anything else is its
# 422/5012. A video over a limit is 413/5021, any other bad video 422/5012, as images are.
HOSTED_FIELDS = frozenset({"model", "state", "questions", "images", "videos"})

NO_QUESTIONS_OR_TYPE = 5006  # 400
NO_ROUTE = 7000  # 400
NOT_JSON = 6003  # 400
VALIDATION = 5012  # 422
INFERENCE_FAILED = 5012  # 529: the hosted code for an inference that failed (the validation code too)
INFERENCE_FAILED_STATUS = 529
TOO_LARGE = 5021  # 413
CAPACITY = 3040  # 429
UNKNOWN_TOKEN = 10000  # 401

# Our status (for a refusal in our `{"detail": {...}}` shape) -> Cloudflare's status and code.
_BY_STATUS = {401: (401, UNKNOWN_TOKEN), 404: (400, NO_ROUTE), 413: (413, TOO_LARGE), 429: (429, CAPACITY)}
# Headers a client may read off either route.
_KEPT_HEADERS = ("retry-after", "x-request-id", "x-clef-prefix-key", "x-clef-prefix-cache", "www-authenticate")
# The server's statuses (app.server.ServerState) in which a 503 means "come back": nothing failed, the engine is
# not there yet or any more. In any other, a 5xx is an inference that failed.
_COMING_OR_GOING = frozenset({"loading", "draining"})


def route_model(model_path: str) -> str | None:
    """The model a route path names (`@cf/cloudflare/clef-flash` -> `clef-flash`); None for any other path."""
    return model_path.removeprefix(MODEL_PREFIX) if model_path.startswith(MODEL_PREFIX) else None


def failure(status: int, code: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"result": None, "success": False, "errors": [{"code": code, "message": message}], "messages": []}
    return JSONResponse(body, status_code=status, headers=headers)


def unknown_fields(body: Any) -> list[dict[str, Any]]:
    """422 items (FastAPI's shape) for top-level fields the hosted validator does not know."""
    if not isinstance(body, dict):
        return []
    return [
        {
            "loc": ["body", name],
            "msg": f"unknown field {name!r} (the hosted API accepts {sorted(HOSTED_FIELDS)})",
            "type": "extra_forbidden",
        }
        for name in body
        if name not in HOSTED_FIELDS
    ]


def _validation_status(detail: list[dict[str, Any]]) -> tuple[int, int]:
    """A 422 list's status and code on this route: a body that is not JSON, no questions or a question type
    clef does not answer are 400s with their own codes; the rest 422/5012."""
    kinds = {item.get("type") for item in detail}
    if "json_invalid" in kinds:
        return 400, NOT_JSON
    for item in detail:
        loc = list(item.get("loc", []))
        if loc == ["body", "questions"] and item.get("type") in ("missing", "too_short"):
            return 400, NO_QUESTIONS_OR_TYPE
        if loc[:2] == ["body", "questions"] and item.get("type") == "union_tag_invalid":
            return 400, NO_QUESTIONS_OR_TYPE
        if loc[:2] == ["body", "questions"] and loc[-1:] == ["type"] and item.get("type") == "value_error":
            return 400, NO_QUESTIONS_OR_TYPE  # a TypeSafe type clef has no head for (box)
    return 422, VALIDATION


def _where(loc: list) -> str:
    return ".".join(str(part) for part in loc[1:]) or "body"


def envelope(response: Response, server_status: str = "ready") -> Response:
    """A /v1/systemone response in the Workers AI form (its headers kept where a client reads them);
    `server_status`: the server's state as it answered (a 503 while loading or draining is not a failure)."""
    headers = {k: v for k, v in response.headers.items() if k.lower() in _KEPT_HEADERS}
    if "x-request-id" in headers:
        headers["cf-ray"] = headers["x-request-id"]  # what some clients log as the provider's request id
    body = json.loads(response.body)
    if response.status_code == 200:
        envelope_body = {"result": body, "success": True, "errors": [], "messages": []}
        return JSONResponse(envelope_body, headers=headers)
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, list):
        status, code = _validation_status(detail)
        message = "; ".join(f"{_where(item.get('loc', []))}: {item.get('msg')}" for item in detail)
    else:
        detail = detail if isinstance(detail, dict) else {}
        message = detail.get("message", str(body))
        if detail.get("error_type") == "overloaded_error":  # the queue is full: capacity, come back shortly
            status, code = 429, CAPACITY
        elif response.status_code == 503 and server_status in _COMING_OR_GOING:  # not capacity, but come back too
            status, code = 503, CAPACITY
        elif response.status_code >= 500:  # a verification refusal, a model or step error: the inference failed
            status, code = INFERENCE_FAILED_STATUS, INFERENCE_FAILED
        else:
            status, code = _BY_STATUS.get(response.status_code, (response.status_code, VALIDATION))
    return failure(status, code, message, headers)
