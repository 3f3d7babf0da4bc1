"""Request traces with OpenTelemetry (--otlp-traces-endpoint, vLLM's flag): a span per decision request with a child
for its encoding (with its images and videos), its videos' decoding, its wait in the queue, its images and frame
groups through the tower, each prefill chunk it was part of, its head, and, when the shadow re-decides it later, the
shadow's run. Exported over OTLP/HTTP (protobuf) in batches.

Off by default and free when off: without the flag the SDK is never loaded, no span is made and the engine keeps no
timeline. The SDK and its exporter are an optional extra (`pip install 'clef-cuda[otel]'`; the API alone comes with
fastapi); the flag without them is a one-line error before the load (app.cli.checks).

An incoming W3C `traceparent` is honoured: the request's span is its child, in the client's trace. The span carries
the X-Request-Id (clef.request_id), and the JSON log lines of the request carry the trace id (app.logs)."""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlsplit

from clef_cuda.serving.timeline import Event, Timeline

OTEL_EXTRA = "pip install 'clef-cuda[otel]'"


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of `endpoint`: as given, or with /v1/traces when it names only the receiver.
    ValueError (one line) for anything that is not an http(s) URL."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp-traces-endpoint {endpoint!r}: expected an http(s) URL, e.g. http://collector:4318")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


def check_available() -> None:
    """ImportError naming the extra when the OpenTelemetry SDK or its OTLP/HTTP exporter is missing."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as error:
        raise ImportError(f"--otlp-traces-endpoint needs the OpenTelemetry packages: {OTEL_EXTRA} ({error})") from None


class Tracing:
    """The process's tracer: one per server, its spans batched to `endpoint` on a background thread."""

    def __init__(self, endpoint: str, service_name: str, version: str, batch_delay_ms: int = 1000) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create({"service.name": service_name, "service.version": version})
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint)), schedule_delay_millis=batch_delay_ms)
        )
        self.tracer = self.provider.get_tracer("clef-serve")
        self.propagator = TraceContextTextMapPropagator()

    def start(self, method: str, path: str, headers, request_id: str) -> RequestTrace:
        """The request's span, a child of the client's `traceparent` when it sent one."""
        from opentelemetry.trace import SpanKind

        parent = self.propagator.extract(carrier={k.lower(): v for k, v in headers.items()})
        span = self.tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path, "clef.request_id": request_id},
        )
        return RequestTrace(self, span)

    def shutdown(self) -> None:
        """Export what is batched and stop (the server's shutdown)."""
        self.provider.shutdown()


class RequestTrace:
    """One request's span and the engine timeline its children come from."""

    def __init__(self, tracing: Tracing, span) -> None:
        self.tracing, self.span = tracing, span
        self.timeline = Timeline(on_shadow=self._shadow)

    @property
    def trace_id(self) -> str:
        return format(self.span.get_span_context().trace_id, "032x")

    def child(self, name: str, start_ns: int, end_ns: int | None = None, **attributes: Any) -> None:
        """A finished child span of the request's (times in time.time_ns)."""
        from opentelemetry import trace

        context = trace.set_span_in_context(self.span)
        child = self.tracing.tracer.start_span(name, context=context, start_time=start_ns, attributes=attributes)
        child.end(end_time=time.time_ns() if end_ns is None else end_ns)

    def _event(self, event: Event) -> None:
        attributes = {f"clef.{k}": v for k, v in event.attributes.items() if isinstance(v, (str, bool, int, float))}
        self.child(event.name, event.start_ns, event.end_ns, **attributes)

    def _shadow(self, event: Event) -> None:
        """The shadow's re-decision, after the request's span ended (on the engine's thread)."""
        self._event(event)

    def finish(
        self, status: int, model: str | None, variant: bool, result: dict | None, error_type: str | None
    ) -> None:
        """The engine's events as children, the outcome as attributes (`variant`: the model is a LoRA variant);
        the span ends."""
        for event in list(self.timeline.events):
            self._event(event)
        span = self.span
        span.set_attribute("http.response.status_code", status)
        if model is not None:
            span.set_attribute("clef.model", model)
            span.set_attribute("clef.variant", variant)
        if result is not None:
            span.set_attribute("clef.input_tokens", result["usage"]["input_tokens"])
            span.set_attribute("clef.cached_tokens", result.get("x_cached_tokens", 0))
        if error_type is not None:
            span.set_attribute("error.type", error_type)
        if status >= 500:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error_type or str(status)))
        span.end()
