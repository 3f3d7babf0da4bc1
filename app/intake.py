"""Request intake: the body read within its size and time limits and decoded (gzip, zstd), before
anything parses it. Everything here raises ClientError (a 4xx in the contract's error shape)."""

from __future__ import annotations

import asyncio
import zlib

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
        raise ClientError(413, "request_too_large", f"the decoded request body exceeds {limit} bytes")
    return out


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, refusing one over `limit` before reading it (by Content-Length) or as soon as it passes the
    limit, and one that does not arrive within `timeout` seconds (a stalled or trickling client)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ClientError(413, "request_too_large", f"the request body ({declared} bytes) exceeds {limit} bytes")
    chunks, size = [], 0

    async def receive_all() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ClientError(413, "request_too_large", f"the request body exceeds {limit} bytes")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(receive_all(), timeout)
    except TimeoutError as error:
        raise ClientError(408, "request_timeout", f"the request body did not arrive within {timeout:.0f} s") from error
    return b"".join(chunks)
