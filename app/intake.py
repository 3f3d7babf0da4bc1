"""Request intake: the body read within its size and time limits and decoded (gzip, zstd), before
anything parses it. Everything here raises ClientError (a 4xx in the contract's error shape)."""

from __future__ import annotations

import asyncio
import json
import re
import zlib
from typing import Any

import numpy as np
from fastapi import Request


class ClientError(Exception):
    """A 4xx in the contract's error shape."""

    def __init__(self, status: int, error_type: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.error_type, self.message, self.headers = status, error_type, message, headers or {}


def decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """gzip / zstd request bodies (the SDK sends zstd); the result is bounded by `limit` too."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    try:
        if encoding in ("gzip", "x-gzip", "deflate"):
            inflater = zlib.decompressobj(wbits=47 if encoding != "deflate" else 15)  # 47: gzip or zlib header
            out = inflater.decompress(body, limit + 1)
            if not inflater.eof and len(out) <= limit:
                raise ValueError("truncated stream")
        elif encoding == "zstd":
            import io

            import zstandard

            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)) as reader:
                out = reader.read(limit + 1)  # bounded: a small body cannot expand into unbounded memory
        else:
            raise ClientError(
                415, "unsupported_media_type", f"Content-Encoding {encoding!r} is not supported (gzip, zstd)"
            )
    except ClientError:
        raise
    except Exception as error:  # zlib.error, zstandard.ZstdError, ValueError: all mean a corrupt body
        raise ClientError(
            400, "invalid_request_error", f"the {encoding} request body could not be decoded: {error}"
        ) from error
    if len(out) > limit:
        raise ClientError(
            413, "request_too_large", f"the decoded request body is over {limit} bytes: {limit} bytes per request body"
        )
    return out


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, refusing one over `limit` before reading it (by Content-Length) or as soon as it passes the
    limit, and one that does not arrive within `timeout` seconds (a stalled or trickling client)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ClientError(
            413,
            "request_too_large",
            f"the request body is {declared} bytes, over the {limit}-byte limit per request body",
        )
    chunks, size = [], 0

    async def receive_all() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ClientError(
                    413, "request_too_large", f"the request body is over {size} bytes: {limit} bytes per request body"
                )
            chunks.append(chunk)

    try:
        await asyncio.wait_for(receive_all(), timeout)
    except TimeoutError as error:
        raise ClientError(408, "request_timeout", f"the request body did not arrive within {timeout:.0f} s") from error
    return b"".join(chunks)


# An escape (a backslash and the byte after it): never a string delimiter or a bracket.
_JSON_ESCAPE = re.compile(rb"\\.", re.DOTALL)
# +1 for an opening bracket, -1 for a closing one, 0 for every other byte.
_BRACKET_STEP = np.zeros(256, dtype=np.int8)
_BRACKET_STEP[[ord("["), ord("{")]] = 1
_BRACKET_STEP[[ord("]"), ord("}")]] = -1
# \uD800-\uDFFF escapes: the only way a JSON text can carry a lone surrogate once it is valid UTF-8.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class InvalidBody(Exception):
    """The body is not a usable JSON document (a 422 in FastAPI's `detail` list shape)."""

    def __init__(self, loc: list, message: str, kind: str) -> None:
        super().__init__(message)
        self.loc, self.message, self.kind = loc, message, kind

    def as_detail(self) -> list[dict]:
        return [{"loc": self.loc, "msg": self.message, "type": self.kind}]


def json_depth(raw: bytes) -> int:
    """How deep the document nests ([ and { levels), from the bytes alone and without recursion, in
    array passes: escapes blanked, then a bracket counts when an even number of quotes precedes it
    (it is outside every string literal), and the depth is the maximum of the running sum."""
    if b"\\" in raw:
        raw = _JSON_ESCAPE.sub(b"__", raw)
    data = np.frombuffer(raw, dtype=np.uint8)
    step = _BRACKET_STEP[data]
    brackets = np.flatnonzero(step)
    if not brackets.size:
        return 0
    quotes = np.flatnonzero(data == ord('"'))
    outside = np.searchsorted(quotes, brackets) % 2 == 0
    running = np.cumsum(step[brackets[outside]], dtype=np.int32)
    return max(0, int(running.max())) if running.size else 0


def parse_json(raw: bytes, max_depth: int) -> Any:
    """The body as JSON, or InvalidBody: not UTF-8, nested deeper than max_depth (refused before parsing:
    Python's decoder, pydantic and the renderer all recurse), not JSON (numbers with more digits than
    Python converts included), or a string with a lone surrogate ("\\ud800" is legal JSON, but the
    tokenizer and the response encoder cannot take it), named by its place in the body."""
    try:
        text = raw.decode("utf-8-sig")  # strict: UTF-8 (RFC 8259), a leading BOM tolerated
    except UnicodeDecodeError as error:
        raise InvalidBody(["body"], f"the body is not valid UTF-8: {error}", "json_invalid") from error
    # Only a body with more opening brackets than the limit can nest deeper than it.
    depth = json_depth(raw) if raw.count(b"[") + raw.count(b"{") > max_depth else 0
    if depth > max_depth:
        raise InvalidBody(
            ["body"],
            f"the body nests {depth} levels deep; this server accepts at most {max_depth} (--max-json-depth)",
            "json_too_deep",
        )
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, ValueError, RecursionError) as error:
        raise InvalidBody(["body"], f"the body is not valid JSON: {error}", "json_invalid") from error
    if _SURROGATE_ESCAPE.search(text):  # rare (emoji escaped as pairs also match): only then walk the body
        loc = _lone_surrogate(body)
        if loc is not None:
            raise InvalidBody(
                ["body", *loc], "a string here contains a lone UTF-16 surrogate (not Unicode text)", "string_unicode"
            )
    return body


def _lone_surrogate(value: Any) -> list | None:
    """The path to the first string (or object key) that is not encodable as UTF-8, else None."""
    stack: list[tuple[list, Any]] = [([], value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if not _encodable(item):
                return path
        elif isinstance(item, dict):
            for key, child in item.items():
                if not _encodable(key):
                    return [*path, key.encode("utf-8", "backslashreplace").decode()]
                stack.append(([*path, key], child))
        elif isinstance(item, list):
            stack.extend(([*path, index], child) for index, child in enumerate(item))
    return None


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# ---- multipart/form-data (the official SDK's image uploads) ---------------------------------------
MAX_PARTS = 64  # multipart parts read at most (the request part plus assets)


def parse_multipart(raw: bytes, content_type: str) -> tuple[bytes, dict[str, bytes]]:
    """(the `request` part's bytes, the other parts by name). The body limit has already bounded `raw`."""
    from python_multipart.multipart import MultipartParser, parse_options_header

    _, options = parse_options_header(content_type.encode("latin-1", "replace"))
    boundary = options.get(b"boundary")
    if not boundary:
        raise InvalidBody(["body"], "a multipart/form-data body needs a boundary parameter", "multipart_invalid")
    parts: dict[str, bytes] = {}
    current: dict[str, Any] = {}

    def on_part_begin() -> None:
        current.clear()
        current.update(header_field=b"", header_value=b"", headers={}, data=bytearray())

    def on_header_field(data: bytes, start: int, end: int) -> None:
        current["header_field"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        current["header_value"] += data[start:end]

    def on_header_end() -> None:
        current["headers"][current["header_field"].lower()] = current["header_value"]
        current["header_field"] = current["header_value"] = b""

    def on_part_data(data: bytes, start: int, end: int) -> None:
        current["data"] += data[start:end]

    def on_part_end() -> None:
        _, disposition = parse_options_header(current["headers"].get(b"content-disposition", b""))
        name = disposition.get(b"name", b"").decode("utf-8", "replace")
        if not name:
            raise InvalidBody(["body"], "a multipart part has no name", "multipart_invalid")
        if name in parts:
            raise InvalidBody(["body"], f"multipart part {name!r} appears twice", "multipart_invalid")
        if len(parts) >= MAX_PARTS:
            raise InvalidBody(["body"], f"more than {MAX_PARTS} multipart parts", "multipart_invalid")
        parts[name] = bytes(current["data"])

    callbacks = {
        "on_part_begin": on_part_begin,
        "on_header_field": on_header_field,
        "on_header_value": on_header_value,
        "on_header_end": on_header_end,
        "on_part_data": on_part_data,
        "on_part_end": on_part_end,
    }
    try:
        parser = MultipartParser(boundary, callbacks)
        parser.write(raw)
        parser.finalize()
    except InvalidBody:
        raise
    except Exception as error:  # python_multipart raises its own MultipartParseError and ValueErrors
        raise InvalidBody(
            ["body"], f"the multipart/form-data body is malformed: {error}", "multipart_invalid"
        ) from error
    request = parts.pop("request", None)
    if request is None:
        raise InvalidBody(
            ["body"], "a multipart body needs a part named 'request' (the JSON body)", "multipart_invalid"
        )
    return request, parts
