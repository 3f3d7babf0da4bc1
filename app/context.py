"""What every route of one server reads: its settings, its lifecycle (clef_cuda.lifecycle: whether it may answer),
its metrics. One ServerContext per app, on app.state.context; a route reaches it through its request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from app.intake import ClientError
from app.metrics import Metrics, RecentDecisions
from app.responses import RETRY_AFTER_SECONDS
from clef_cuda.lifecycle import Lifecycle


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


@dataclass
class ServerContext:
    settings: ServerSettings
    lifecycle: Lifecycle
    metrics: Metrics
    tracing: Any = None  # app.tracing.Tracing when traces are on
    recent: RecentDecisions = field(default_factory=RecentDecisions)  # the last minutes, for the status page

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
