"""What happened to one request inside the engine, and when: its videos' decoding, its wait in the queue, its images
and frame groups through the tower, each prefill chunk it was part of, its head, and later the shadow's re-decision.
Kept only for a request submitted with a Timeline (the server's traces, app/tracing.py, when --otlp-traces-endpoint
is set); without one the engine records nothing.

Times are wall-clock nanoseconds (time.time_ns), what a trace's spans carry."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Event:
    name: str  # "encode" (the HTTP layer's), "videos" (decoding), "queue", "images" (the tower: images, frame
    # groups), "prefill", "head", "shadow"
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]


@dataclass
class Timeline:
    submitted_ns: int = field(default_factory=time.time_ns)  # set again by Engine.submit: the queue wait's start
    events: list[Event] = field(default_factory=list)  # appended by the engine's threads; read once answered
    # Called with the shadow's "shadow" event when the answered record is re-decided (after the answer went out;
    # possibly never: only sampled records are, and a sample may be dropped).
    on_shadow: Callable[[Event], None] | None = None

    def add(self, name: str, start_ns: int, end_ns: int | None = None, **attributes: Any) -> None:
        self.events.append(Event(name, start_ns, time.time_ns() if end_ns is None else end_ns, attributes))

    def shadow(self, verdict: str, start_ns: int, end_ns: int, max_abs_dp: float) -> None:
        if self.on_shadow is not None:
            self.on_shadow(Event("shadow", start_ns, end_ns, {"verdict": verdict, "max_abs_dp": max_abs_dp}))
