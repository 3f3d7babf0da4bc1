"""Runtime variants (vLLM's endpoints and bodies), only with --enable-adapter-loading: POST /v1/load_lora_adapter
and /v1/unload_lora_adapter, from under --adapter-root only."""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from app.context import ServerContext, context_of
from app.intake import ClientError, InvalidBody, parse_json, read_body
from app.responses import error_response, hide_directory
from clef_cuda.model.adapters import AdapterError, check_variant_name

log = logging.getLogger("clef_serve")
router = APIRouter()


def admin_engine(context: ServerContext):
    if context.settings.adapter_root is None:
        raise ClientError(404, "not_found_error", "runtime adapter loading is off (--enable-adapter-loading)")
    engine = context.answering_engine()
    if engine.adapters is None:
        raise ClientError(404, "not_found_error", "this server holds no adapters")
    return engine


async def admin_body(request: Request, context: ServerContext, fields: tuple[str, ...]) -> dict[str, str]:
    raw = await read_body(request, 64 * 1024, context.settings.body_timeout)
    try:
        body = parse_json(raw, 8)
    except InvalidBody as error:
        raise ClientError(400, "invalid_request_error", error.message) from error
    if not isinstance(body, dict) or not all(isinstance(body.get(f), str) and body[f] for f in fields):
        raise ClientError(400, "invalid_request_error", f"the body must be a JSON object with {', '.join(fields)}")
    return body


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    context = context_of(request)
    try:
        engine = admin_engine(context)
        body = await admin_body(request, context, ("lora_name", "lora_path"))
        name = body["lora_name"]
        try:
            check_variant_name(name)
        except ValueError as error:
            raise ClientError(400, "invalid_request_error", f"lora_name: {error}") from error
        if name in context.names:
            raise ClientError(400, "invalid_request_error", f"{name!r} is the served model's name")
        directory = under_root(context.settings.adapter_root, body["lora_path"])
        try:
            await run_in_threadpool(engine.adapters.load, name, directory)
        except AdapterError as error:
            context.metrics.adapter_loads.labels(result="error").inc()
            message = hide_directory(str(error), context.settings.adapter_root, "<adapter-root>")
            raise ClientError(400, "invalid_request_error", message) from error
        context.metrics.adapter_loads.labels(result="ok").inc()
        log.info("adapter %s loaded at runtime", name)
        return JSONResponse({"lora_name": name, "loaded": True})
    except ClientError as error:
        return error_response(error.status, error.error_type, error.message, error.headers)


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    context = context_of(request)
    try:
        engine = admin_engine(context)
        name = (await admin_body(request, context, ("lora_name",)))["lora_name"]
        adapter = engine.adapters.unload(name)
        if adapter is None:
            raise ClientError(404, "not_found_error", f"no adapter named {name!r} is loaded")
        engine.forget_variant(adapter.digest)
        log.info("adapter %s unloaded (its in-flight requests finish)", name)
        return JSONResponse({"lora_name": name, "unloaded": True})
    except ClientError as error:
        return error_response(error.status, error.error_type, error.message, error.headers)


def under_root(root: str, path: str) -> Path:
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
