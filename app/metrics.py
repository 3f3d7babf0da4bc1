"""Prometheus metrics of one server instance (its own registry: nothing global).

Besides clef's own families, the protocol metrics inference routers read (shared/specs/scale-out.md):
queued and running requests, `clef_cache_usage_ratio` (0..1; prefix-cache blocks that could be evicted
count as free, or a warm replica would look full and be avoided), `clef_cache_config_info` and, with
variants, `clef_lora_requests_info`; by default also under vLLM's names, so an unconfigured endpoint
picker or a vLLM dashboard works (never vLLM's token or latency histograms: nothing is generated here).
Totals the engine keeps (prefix-cache hits, images, vision time, ...) are exported as counters.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, vllm_aliases: bool = True) -> None:
        self.registry = CollectorRegistry()
        self._totals: dict[str, float] = {}  # the engine's totals last exported, per counter
        self._add_request_families(self.registry)
        self._add_engine_families(self.registry)
        self._add_router_families(self.registry, vllm_aliases)
        self._add_verification_families(self.registry)
        self._add_variant_families(self.registry)

    def _add_request_families(self, r: CollectorRegistry) -> None:
        """What clients asked and how long it took."""
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
        self.tokenized_characters = Counter(
            "clef_tokenized_characters",
            "Characters of client text tokenised: bounded by the token budget, not by the body (a refused huge state "
            "costs about one budget's worth)",
            registry=r,
        )

    def _add_engine_families(self, r: CollectorRegistry) -> None:
        """The engine's queue, batch, KV blocks, state slots, prefix cache, weights and vision tower."""
        self.queue_depth = Gauge("clef_queue_depth", "Requests waiting for the engine", registry=r)
        self.queue_limit = Gauge(
            "clef_queue_limit", "Waiting requests before new ones get 503 (--max-queue)", registry=r
        )
        self.running = Gauge("clef_running_sequences", "Sequences being prefilled", registry=r)
        self.kv_blocks_used = Gauge("clef_kv_blocks_used", "KV cache blocks in use (sequences and cache)", registry=r)
        self.kv_blocks_total = Gauge("clef_kv_blocks_total", "KV cache blocks", registry=r)
        self.state_slots_used = Gauge("clef_state_slots_used", "Delta-net state slots in use", registry=r)
        self.state_slots_total = Gauge("clef_state_slots_total", "Delta-net state slots", registry=r)
        self.prefix_queries = Counter(
            "clef_prefix_cache_queries", "Records that looked for a cached prefix (they had reuse points)", registry=r
        )
        self.prefix_hits = Counter("clef_prefix_cache_hits", "Records that started from a cached prefix", registry=r)
        self.prefix_misses = Counter(
            "clef_prefix_cache_misses", "Records with reuse points and no cached prefix", registry=r
        )
        self.prefix_evictions = Counter("clef_prefix_cache_evictions", "Prefix-cache entries evicted", registry=r)
        self.prefix_entries = Gauge("clef_prefix_cache_entries", "Prefix-cache entries held", registry=r)
        self.prefix_blocks = Gauge(
            "clef_prefix_cache_blocks", "KV blocks held by prefix-cache entries (one snapshot slot each)", registry=r
        )
        self.shadow_blocks = Gauge(
            "clef_shadow_kv_blocks",
            "KV blocks lent to the shadow run in progress (real work takes them back)",
            registry=r,
        )
        self.ready = Gauge("clef_ready", "1 when the model is loaded, warmed up and taking requests", registry=r)
        self.start_time = Gauge(
            "clef_start_time_seconds", "Unix time this server process started (a change is a restart)", registry=r
        )
        self.start_time.set(time.time())
        self.failed = Gauge(
            "clef_failed",
            "1 when the server failed, by kind: load, selfcheck (at start-up), timed_selfcheck or shadow_mismatch "
            "(while serving; each stays up, unready), kernel_fault (exit 4) or rank_lost (exit 5; both a second after "
            "the failure: a scrape may miss them, the pod's exit code is kept)",
            ["kind"],
            registry=r,
        )
        for kind in ("load", "selfcheck", "kernel_fault", "rank_lost"):
            self.failed.labels(kind=kind).set(0)
        self.weight_bytes = Gauge(
            "clef_weight_bytes",
            "Device bytes of the resident weights by part (int8 under --quantize int8)",
            ["part"],
            registry=r,
        )
        self.images = Counter("clef_images", "Images of admitted records (counted once per record)", registry=r)
        self.image_tokens = Counter("clef_image_tokens", "Image tokens of admitted records", registry=r)
        self.vision_seconds = Counter("clef_vision_seconds", "Time spent in the vision tower", registry=r)
        self.vision_cache_hits = Counter(
            "clef_vision_cache_hits", "Images whose tower output came from the cache", registry=r
        )
        self.vision_cache_misses = Counter("clef_vision_cache_misses", "Images that went through the tower", registry=r)
        self.videos = Counter("clef_videos", "Videos decoded (each once a request)", registry=r)
        self.video_seconds = Counter("clef_video_seconds", "Seconds of video decoded (the clips' lengths)", registry=r)
        self.video_decode_seconds = Counter(
            "clef_video_decode_seconds", "Time spent scanning, decoding and preprocessing videos", registry=r
        )

    def _add_router_families(self, r: CollectorRegistry, vllm_aliases: bool) -> None:
        """The protocol metrics inference routers read, and (vllm_aliases) their copies under vLLM's names."""
        self.cache_usage = Gauge(
            "clef_cache_usage_ratio",
            "0..1: max(KV blocks live sequences hold / all blocks, running state slots held / all); "
            "evictable prefix-cache blocks count as free",
            registry=r,
        )
        self.cache_config = Gauge(
            "clef_cache_config_info",
            "Always 1; labels: the KV cache's shape",
            ["block_size", "num_gpu_blocks"],
            registry=r,
        )
        self.lora_info = Gauge(
            "clef_lora_requests_info",
            "Unix time of the last change; labels: variant slots and the variants with running and waiting requests",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=r,
        )
        self._lora_labels: tuple[str, str, str] | None = None
        self.aliases = None
        if vllm_aliases:
            self.aliases = {
                "waiting": Gauge("vllm:num_requests_waiting", "clef_queue_depth, under vLLM's name", registry=r),
                "running": Gauge("vllm:num_requests_running", "clef_running_sequences, under vLLM's name", registry=r),
                "usage": Gauge(
                    "vllm:kv_cache_usage_perc", "clef_cache_usage_ratio (0..1), under vLLM's name", registry=r
                ),
                "config": Gauge(
                    "vllm:cache_config_info",
                    "clef_cache_config_info, under vLLM's name",
                    ["block_size", "num_gpu_blocks"],
                    registry=r,
                ),
                "lora": Gauge(
                    "vllm:lora_requests_info",
                    "clef_lora_requests_info, under vLLM's name",
                    ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
                    registry=r,
                ),
            }

    def _add_verification_families(self, r: CollectorRegistry) -> None:
        """The self-check's (made when one runs: observe_selfcheck) and the shadow's."""
        self._selfcheck: tuple[Gauge, Gauge, Gauge, Gauge] | None = None  # made by observe_selfcheck
        self._selfcheck_seen = None  # the last report exported (the engine's timed runs replace it)
        self.shadow_checks = Counter(
            "clef_shadow_checks",
            "Answered records re-decided on the reference ops, by result: match, mismatch, marginal (only the "
            "probabilities, within 10x their tolerance, with every layer matched: a log line), or dropped (a sample "
            "that found the queue full, waited past its age or could not start)",
            ["result"],
            registry=r,
        )
        self.shadow_max_abs_error = Gauge(
            "clef_shadow_max_abs_error", "Largest |p_served - p_reference| of any shadow-checked record", registry=r
        )
        self.shadow_tolerance = Gauge(
            "clef_shadow_tolerance",
            "The bound a shadow-checked record's |p_served - p_reference| must stay within",
            registry=r,
        )
        for result in ("match", "mismatch", "marginal", "dropped"):
            self.shadow_checks.labels(result=result)
        self.shadow_mismatches = Counter(
            "clef_shadow_mismatches",
            "Shadow mismatches by where they first appeared: the layer (its index) and its kind (delta net, "
            "attention, MLP), or the head (layer -) when every layer's fingerprint matched",
            ["layer", "kind"],
            registry=r,
        )

    def _add_variant_families(self, r: CollectorRegistry) -> None:
        """LoRA variants and the decisions of each model."""
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

    def observe_autotune(self, report) -> None:
        """The autotune's choices (clef_cuda.tuning.autotune.AutotuneReport): one series per op and bucket,
        labelled with the implementation chosen, value 1."""
        if not hasattr(self, "kernel_choice"):
            self.kernel_choice = Gauge(
                "clef_kernel_choice",
                "Always 1: the implementation the start-up autotune chose for an op and call-shape bucket",
                ["op", "bucket", "impl"],
                registry=self.registry,
            )
            self.kernel_failed = Gauge(
                "clef_kernel_failed",
                "Always 1: a kernel that failed on this device (crashed, hung or faulted its trial, could not launch, "
                "or faulted while serving) and is never run; its op runs the reference",
                ["kernel"],
                registry=self.registry,
            )
        for op, buckets in report.choices.items():
            for bucket, impl in buckets.items():
                self.kernel_choice.labels(op=op, bucket=bucket, impl=impl).set(1)
        for kernel in report.failures:
            self.kernel_failed.labels(kernel=kernel).set(1)

    def observe_selfcheck(self, report) -> None:
        """The on-device self-check's outcome (clef_cuda.verification.selfcheck.SelfCheckReport). The families exist
        only once a check ran: with --selfcheck off they are absent, not a misleading 0."""
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
        self.queue_limit.set(engine.config.max_queue)
        self.running.set(engine.running)
        shadow = engine.shadow.stats
        for result in ("match", "mismatch", "marginal", "dropped"):
            self._advance(self.shadow_checks, getattr(shadow, result), result=result)
        self._advance(self.tokenized_characters, engine.decider.tokenizer.tokenized_chars)
        for (layer, kind), count in list(shadow.mismatches_by_layer.items()):
            self._advance(self.shadow_mismatches, count, layer=layer, kind=kind)
        self.shadow_max_abs_error.set(shadow.max_abs_error)
        self.shadow_tolerance.set(engine.shadow.tolerance)
        if engine.selfcheck_report is not None and engine.selfcheck_report is not self._selfcheck_seen:
            self._selfcheck_seen = engine.selfcheck_report  # a timed run: the same families as at start-up
            self.observe_selfcheck(engine.selfcheck_report)
        for part, nbytes in engine.weight_bytes.items():
            self.weight_bytes.labels(part=part).set(nbytes)
        self.weight_bytes.labels(part="adapters").set(engine.adapters.bytes() if engine.adapters is not None else 0)
        self.kv_blocks_used.set(engine.blocks.used)
        self.shadow_blocks.set(engine.shadow.lent_blocks)
        self.kv_blocks_total.set(engine.blocks.capacity)
        self.state_slots_used.set(engine.state_slots_in_use())
        self.state_slots_total.set(engine.plan.running_slots + engine.plan.snapshot_slots)
        cache = engine.prefix_cache
        self._advance(self.prefix_queries, cache.hits + cache.misses)
        self._advance(self.prefix_hits, cache.hits)
        self._advance(self.prefix_misses, cache.misses)
        self._advance(self.prefix_evictions, cache.evictions)
        self.prefix_entries.set(len(cache))
        self.prefix_blocks.set(cache.blocks_held)
        self._advance(self.images, engine.images)
        self._advance(self.image_tokens, engine.image_tokens)
        self._advance(self.vision_seconds, engine.vision_seconds)
        self._advance(self.vision_cache_hits, engine.vision_cache.hits)
        self._advance(self.vision_cache_misses, engine.vision_cache.misses)
        self._advance(self.videos, engine.videos)
        self._advance(self.video_seconds, engine.video_seconds)
        self._advance(self.video_decode_seconds, engine.video_decode_seconds)
        usage = engine.cache_usage()
        self.cache_usage.set(usage)
        config = {"block_size": str(engine.config.block_size), "num_gpu_blocks": str(engine.blocks.capacity)}
        self.cache_config.labels(**config).set(1)
        if engine.adapters is not None:
            self.adapters_loaded.set(len(engine.adapters.names()))
            self.adapter_slots.set(engine.adapters.max_adapters)
            self.adapter_bytes.set(engine.adapters.bytes())
            self._observe_lora(engine)
        if self.aliases is not None:
            self.aliases["waiting"].set(engine.queue_depth)
            self.aliases["running"].set(engine.running)
            self.aliases["usage"].set(usage)
            self.aliases["config"].labels(**config).set(1)

    def _advance(self, counter: Counter, total: float, **labels: str) -> None:
        """Export an engine total as a counter (of one label set): add what it grew by since the last scrape."""
        key = counter._name + repr(sorted(labels.items()))  # noqa: SLF001  (prometheus_client's family name)
        grown = total - self._totals.get(key, 0.0)
        if grown > 0:
            (counter.labels(**labels) if labels else counter).inc(grown)
            self._totals[key] = total

    def _observe_lora(self, engine) -> None:
        """Exactly one live series: the label set of the moment, its value the time it last changed."""
        running, waiting = engine.variant_activity()
        labels = (str(engine.adapters.max_adapters), ",".join(running), ",".join(waiting))
        if labels == self._lora_labels:
            return
        gauges = [self.lora_info] + ([self.aliases["lora"]] if self.aliases is not None else [])
        for gauge in gauges:
            if self._lora_labels is not None:
                gauge.remove(*self._lora_labels)
            gauge.labels(*labels).set(time.time())
        self._lora_labels = labels

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


class LifecycleMetrics:
    """The lifecycle's reports (clef_cuda.lifecycle.Observer) as these metrics: clef_ready, the self-check's and
    the autotune's families, the start-up adapter loads."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def ready(self, ready: bool) -> None:
        self.metrics.ready.set(1 if ready else 0)

    def failed(self, kind: str) -> None:
        self.metrics.failed.labels(kind=kind).set(1)

    def selfcheck(self, report) -> None:
        self.metrics.observe_selfcheck(report)

    def autotune(self, report) -> None:
        self.metrics.observe_autotune(report)

    def adapters_loaded(self, count: int) -> None:
        self.metrics.adapter_loads.labels(result="ok").inc(count)


class RecentDecisions:
    """The decision requests of the last `window` seconds, for the status page (Prometheus keeps the history):
    how many by status, latency percentiles of the answered ones, their prefix-cache hits and cached input share."""

    def __init__(self, window: float = 600.0, clock=time.monotonic) -> None:
        self.window, self.clock = window, clock
        self._seen: deque[tuple[float, int, float, int, int]] = deque()  # (when, status, seconds, tokens, cached)
        self._lock = threading.Lock()

    def record(self, status: int, seconds: float, result: dict | None) -> None:
        tokens = result["usage"]["input_tokens"] if result is not None else 0
        cached = result.get("x_cached_tokens", 0) if result is not None else 0
        with self._lock:
            self._seen.append((self.clock(), status, seconds, tokens, cached))
            self._forget()

    def _forget(self) -> None:
        horizon = self.clock() - self.window
        while self._seen and self._seen[0][0] < horizon:
            self._seen.popleft()

    def summary(self) -> dict:
        with self._lock:
            self._forget()
            seen = list(self._seen)
        answered = [entry for entry in seen if entry[1] == 200]
        latencies = sorted(entry[2] * 1e3 for entry in answered)

        def percentile(q: float) -> float | None:  # nearest rank
            return latencies[min(len(latencies) - 1, math.ceil(q * len(latencies)) - 1)] if latencies else None

        by_status: dict[str, int] = {}
        for entry in seen:
            by_status[str(entry[1])] = by_status.get(str(entry[1]), 0) + 1
        tokens = sum(entry[3] for entry in answered)
        return {
            "window_seconds": self.window,
            "requests": len(seen),
            "per_minute": len(seen) * 60.0 / self.window,
            "by_status": dict(sorted(by_status.items())),
            "answered": len(answered),
            "latency_ms": {"p50": percentile(0.5), "p90": percentile(0.9), "p99": percentile(0.99)},
            "prefix_cache_hits": sum(entry[4] > 0 for entry in answered) if answered else None,
            "cached_token_share": sum(entry[4] for entry in answered) / tokens if tokens else None,
        }
