"""What every route of one server reads: its settings, its lifecycle (clef_cuda.lifecycle: whether it may answer),
its metrics. One ServerContext per app, on app.state.context; a route reaches it through its request."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from app.intake import ClientError
from app.metrics import Metrics, RecentDecisions
from app.responses import RETRY_AFTER_SECONDS
from clef_cuda.lifecycle import Lifecycle


def usable_cores() -> int:
    """The cores this process may run on (its affinity, which a container's cpuset sets), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_video_decodes(cores: int | None = None) -> int:
    """Requests whose videos decode at once, by default: one for every 4 cores (at least one), each decode on its
    share of them (app.cli.engine: FFmpeg's threads), so a decode gets the cores its budget was measured with."""
    return max(1, (cores or usable_cores()) // 4)


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str = "clef-flash"
    aliases: tuple[str, ...] = ("jev-latest",)
    api_key: str | None = None
    max_body_bytes: int = 48 * 2**20  # compressed or not, and again after decompression: two 16 MiB videos in base64
    request_timeout: float = 600.0
    body_timeout: float = 30.0  # seconds to receive a whole request body (slow or stalled clients: 408)
    cors_origins: tuple[str, ...] = ()  # no CORS headers at all unless origins are configured
    model_description: str = "clef-flash System One decision model"  # a name, never where it lives
    release_dir: str | None = None  # never shown to clients: messages naming it say "the release"
    release_date: str = "2026-10-01"
    disconnect_poll_seconds: float = 0.05
    selfcheck: str = "enforce"  # enforce: a failed on-device self-check keeps /ready 503; warn: serve anyway; off
    # The start-up autotune (clef_cuda.tuning.autotune): fast, full or off (the CLI's default is fast), and
    # where its choices are cached (None: not cached).
    autotune: str = "off"
    autotune_cache: str | None = None
    # Where never-run kernels are first tried (clef_cuda.tuning.trials): auto (a child process on a GPU),
    # child, inline.
    kernel_trials: str = "auto"
    adapter_root: str | None = None  # set: runtime adapter loading is on, from under this directory only
    vllm_metric_aliases: bool = True  # the protocol gauges under vLLM's names too
    max_json_depth: int = 256  # deeper bodies are a 422 before they are parsed
    otlp_traces_endpoint: str | None = None  # set: a trace per decision request, exported there (app.tracing)
    status_page: bool = True  # GET /: the status page (app/routes/status_page.py)
    quantize: str = "none"  # what the status page says the weights are (the CLI's --quantize)
    tensor_parallel_size: int = 1  # the cards the trunk is sharded over (the CLI's --tensor-parallel-size)
    max_video_decodes: int = field(default_factory=default_video_decodes)  # requests' videos decoded at once


@dataclass
class ServerContext:
    settings: ServerSettings
    lifecycle: Lifecycle
    metrics: Metrics
    tracing: Any = None  # app.tracing.Tracing when traces are on
    recent: RecentDecisions = field(default_factory=RecentDecisions)  # the last minutes, for the status page
    video_decodes: VideoDecodeSlots | None = None  # made from settings.max_video_decodes

    def __post_init__(self) -> None:
        if self.video_decodes is None:
            self.video_decodes = VideoDecodeSlots(self.settings.max_video_decodes)

    @property
    def names(self) -> set[str]:
        """The served model's names: its own and its aliases."""
        return {self.settings.served_model_name, *self.settings.aliases}

    def answering_engine(self):
        """The engine, when the lifecycle lets this server answer; else the contract's 503 saying why."""
        refusal = self.lifecycle.refusal()
        if refusal is not None:
            raise ClientError(503, "service_unavailable", refusal.message, {"Retry-After": RETRY_AFTER_SECONDS})
        return self.lifecycle.engine


def context_of(request: Request) -> ServerContext:
    return request.app.state.context


class VideoDecodeSlots:
    """At most `size` requests' videos decoded at once, server-wide (--max-video-decodes): N hostile clips take one
    slot's cores at a time, each stopped by its decode budget, while requests without videos pass them by. A request
    with videos waits for a slot on the event loop (holding no worker thread) until its deadline: then the
    contract's 503 timeout. The semaphore is made on the event loop that uses it (tests run an app on several)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.decoding = 0  # requests decoding now
        self.waiting = 0  # requests waiting for a slot
        self._semaphore: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @contextlib.asynccontextmanager
    async def slot(self, timeout: float) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._semaphore, self._loop = asyncio.Semaphore(self.size), loop
        semaphore = self._semaphore
        self.waiting += 1
        try:
            await asyncio.wait_for(semaphore.acquire(), max(timeout, 0.0))
        except asyncio.TimeoutError:  # TimeoutError from 3.11 on
            raise ClientError(
                503,
                "timeout",
                f"no video decoding slot within the request's time (--request-timeout; {self.size} at once: "
                "--max-video-decodes)",
                {"Retry-After": RETRY_AFTER_SECONDS},
            ) from None
        finally:
            self.waiting -= 1
        self.decoding += 1
        try:
            yield
        finally:
            self.decoding -= 1
            semaphore.release()
