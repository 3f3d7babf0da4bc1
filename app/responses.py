"""The contract's error shapes, in one place (shared/specs/systemone-api.md): `{"detail": {"error_type", "message"}}`
for refusals, FastAPI's 422 `{"detail": [{"loc", "msg", "type"}]}` for an invalid body; and the rule that no
response names a server directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from app.schemas import capacity_message

RETRY_AFTER_SECONDS = "1"


def error_response(status: int, error_type: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": {"error_type": error_type, "message": message}}, status_code=status, headers=headers)


def validation_response(errors: list[dict[str, Any]]) -> JSONResponse:
    return JSONResponse({"detail": errors}, status_code=422)


def pydantic_errors(error: ValidationError) -> list[dict[str, Any]]:
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


def hide_directory(message: str, directory: str | None, name: str) -> str:
    """`message` with a server directory (as given and as resolved) replaced by `name`: errors from the
    release or adapter loaders name files, and no response may say where they live."""
    if not directory:
        return message
    # The given form only when it looks like a path ("models" alone would clobber words of the message).
    forms = {str(Path(directory).resolve())} | {f for f in (directory, str(Path(directory))) if "/" in f}
    for form in sorted(forms, key=len, reverse=True):
        message = message.replace(form, name)
    return message
