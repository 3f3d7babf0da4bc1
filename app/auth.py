"""The API key: with one set (--api-key), every /v1 route and the Workers AI route need `Authorization: Bearer
<key>`; /health, /ready and /metrics stay open for probes and scrapers."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from app.responses import error_response

MISSING_KEY = "missing or invalid API key (Authorization: Bearer <key>)"


def key_is_valid(headers, api_key: str) -> bool:
    """`Authorization: Bearer <api_key>`, compared in constant time (equal-length digests: the key never
    leaks through timing)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    given = token.strip().encode() if scheme.lower() == "bearer" else b""
    return hmac.compare_digest(
        hmac.new(b"clef", given, "sha256").digest(), hmac.new(b"clef", api_key.encode(), "sha256").digest()
    )


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
