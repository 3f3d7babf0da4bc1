"""Prometheus metrics of one server instance (its own registry: nothing global)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("clef_requests", "System One requests by HTTP status", ["status"], registry=r)
        self.latency = Histogram(
            "clef_request_latency_seconds",
            "Time from receiving a decision request to answering it",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_latency = Histogram(
            "clef_queue_latency_seconds",
            "Time a decision waited before its prefill started",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("clef_prompt_tokens", "Input tokens of answered requests", registry=r)
        self.cached_tokens = Counter(
            "clef_cached_tokens", "Input tokens served from the prefix cache instead of recomputed", registry=r
        )
        self.queue_depth = Gauge("clef_queue_depth", "Requests waiting for the engine", registry=r)
        self.running = Gauge("clef_running_sequences", "Sequences being prefilled", registry=r)
        self.kv_blocks_used = Gauge("clef_kv_blocks_used", "KV cache blocks in use (sequences and cache)", registry=r)
        self.kv_blocks_total = Gauge("clef_kv_blocks_total", "KV cache blocks", registry=r)
        self.state_slots_used = Gauge("clef_state_slots_used", "Delta-net state slots in use", registry=r)
        self.state_slots_total = Gauge("clef_state_slots_total", "Delta-net state slots", registry=r)
        self.prefix_hits = Gauge("clef_prefix_cache_hits", "Records that started from a cached prefix", registry=r)
        self.prefix_misses = Gauge(
            "clef_prefix_cache_misses", "Records with reuse points and no cached prefix", registry=r
        )
        self.prefix_evictions = Gauge("clef_prefix_cache_evictions", "Prefix-cache entries evicted", registry=r)
        self.prefix_entries = Gauge("clef_prefix_cache_entries", "Prefix-cache entries held", registry=r)
        self.prefix_blocks = Gauge(
            "clef_prefix_cache_blocks", "KV blocks held by prefix-cache entries (one snapshot slot each)", registry=r
        )
        self.ready = Gauge("clef_ready", "1 when the model is loaded, warmed up and taking requests", registry=r)
        self.images = Gauge("clef_images", "Images of admitted records (counted once per record)", registry=r)
        self.image_tokens = Gauge("clef_image_tokens", "Image tokens of admitted records", registry=r)
        self.vision_seconds = Gauge("clef_vision_seconds", "Time spent in the vision tower", registry=r)
        self.vision_cache_hits = Gauge(
            "clef_vision_cache_hits", "Images whose tower output came from the cache", registry=r
        )
        self.vision_cache_misses = Gauge("clef_vision_cache_misses", "Images that went through the tower", registry=r)
        self._selfcheck: tuple[Gauge, Gauge, Gauge, Gauge] | None = None  # made by observe_selfcheck
        self.adapters_loaded = Gauge("clef_adapters_loaded", "Fine-tuned variants being served", registry=r)
        self.adapter_slots = Gauge("clef_adapter_slots", "Variants the server can hold (--max-adapters)", registry=r)
        self.adapter_bytes = Gauge("clef_adapter_bytes", "Device memory of the loaded variants", registry=r)
        self.adapter_loads = Counter(
            "clef_adapter_loads", "Variant loads by result (ok, error)", ["result"], registry=r
        )
        self.model_requests = Counter(
            "clef_model_requests", "Answered decisions by model (base or variant)", ["model"], registry=r
        )
        self.model_cached_tokens = Counter(
            "clef_model_cached_tokens", "Input tokens served from the prefix cache, by model", ["model"], registry=r
        )
        self._model_labels: set[str] = set()

    def observe_selfcheck(self, report) -> None:
        """The on-device self-check's outcome (clef_cuda.selfcheck.SelfCheckReport). The families exist only
        once a check ran: with --selfcheck off they are absent, not a misleading 0."""
        if self._selfcheck is None:
            r = self.registry
            self._selfcheck = (
                Gauge("clef_selfcheck_passed", "1 when every on-device kernel self-check passed, else 0", registry=r),
                Gauge("clef_selfcheck_seconds", "Time the on-device kernel self-check took", registry=r),
                Gauge(
                    "clef_selfcheck_max_abs_error",
                    "Largest |fast op - reference| of each self-check (+Inf: NaN written or the op raised)",
                    ["check"],
                    registry=r,
                ),
                Gauge(
                    "clef_selfcheck_tolerance",
                    "The bound each self-check's error must stay within",
                    ["check"],
                    registry=r,
                ),
            )
        passed, seconds, error, tolerance = self._selfcheck
        passed.set(1 if report.passed else 0)
        seconds.set(report.seconds)
        for check in report.checks:
            error.labels(check=check.name).set(check.max_abs_error)
            tolerance.labels(check=check.name).set(check.tolerance)

    def observe_engine(self, engine) -> None:
        """Copy the engine's counters into the gauges (called at scrape time)."""
        if engine is None:
            return
        self.queue_depth.set(engine.queue_depth)
        self.running.set(engine.running)
        self.kv_blocks_used.set(engine.blocks.used)
        self.kv_blocks_total.set(engine.blocks.capacity)
        self.state_slots_used.set(engine.state_slots_in_use())
        self.state_slots_total.set(engine.plan.running_slots + engine.plan.snapshot_slots)
        cache = engine.prefix_cache
        self.prefix_hits.set(cache.hits)
        self.prefix_misses.set(cache.misses)
        self.prefix_evictions.set(cache.evictions)
        self.prefix_entries.set(len(cache))
        self.prefix_blocks.set(cache.blocks_held)
        self.images.set(engine.images)
        self.image_tokens.set(engine.image_tokens)
        self.vision_seconds.set(engine.vision_seconds)
        self.vision_cache_hits.set(engine.vision_cache.hits)
        self.vision_cache_misses.set(engine.vision_cache.misses)
        if engine.adapters is not None:
            self.adapters_loaded.set(len(engine.adapters.names()))
            self.adapter_slots.set(engine.adapters.max_adapters)
            self.adapter_bytes.set(engine.adapters.bytes())

    MAX_MODEL_LABELS = 64  # label values are model names clients chose: bounded, the rest count as "other"

    def observe_decision(self, model: str, result: dict) -> None:
        if model not in self._model_labels:
            if len(self._model_labels) >= self.MAX_MODEL_LABELS:
                model = "other"
            else:
                self._model_labels.add(model)
        self.model_requests.labels(model=model).inc()
        self.model_cached_tokens.labels(model=model).inc(result.get("x_cached_tokens", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
