"""The batching engine: one scheduler thread owns the model and the device.

Requests are validated and encoded by the caller, then wait in a bounded queue. Each scheduler step
packs up to max_num_seqs running sequences, at most prefill_chunk_size new tokens each (chunked prefill:
a 16k-token record does not stall short ones), runs the trunk once over the pack, feeds each sequence's
rows to the joint head, and answers a sequence as soon as its last chunk is done.

Memory: after the weights load, kv_fraction of the free device memory becomes state slots (one per
running sequence, plus prefix snapshots) and KV blocks. A record is admitted when a slot and all the
blocks it will need are free (it waits otherwise; one that could never fit is rejected at submit).

Prefix caching: a record's prefill stops at block-aligned reuse points (the end of its state, the end
of its schema). There the engine snapshots every delta net's conv and recurrent state into a spare slot,
keeps the KV blocks, and keeps what the head has taken from those tokens (memory rows, span sums). A
later record with the same tokens up to that point starts from the snapshot. Entries are evicted least
recently used when blocks or snapshot slots run short.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from clef_cuda.decider import Decider, record_chunk
from clef_cuda.errors import ClefError, RequestTooLongError
from clef_cuda.model.adapters import Adapter, AdapterBatch, AdapterRegistry
from clef_cuda.model.config import context_length, past_training
from clef_cuda.model.fingerprint import CountSketch, Fingerprint, LayerProbe, sketch_positions
from clef_cuda.model.head import HeadInputs, RecordLayout
from clef_cuda.model.trunk import ChunkBatch
from clef_cuda.model.trunk_cache import TrunkCache
from clef_cuda.request import answers
from clef_cuda.request.encoding import EncodedRecord, encode_request, validate_request
from clef_cuda.request.images import PreparedImage, request_images
from clef_cuda.request.videos import request_videos
from clef_cuda.serving.cache import BlockPool, FreeList, PrefixCache, PrefixEntry, VisionCache
from clef_cuda.serving.plan import CachePlan, plan_cache, shadow_run_bytes, step_activation_bytes
from clef_cuda.serving.timeline import Timeline
from clef_cuda.verification.guarded_ops import KernelFault, as_kernel_fault
from clef_cuda.verification.selfcheck import SelfCheckReport, run_selfcheck
from clef_cuda.verification.shadow import SHADOW_FLOOR_CHUNK_TOKENS, ShadowConfig, ShadowSample, ShadowVerifier

log = logging.getLogger("clef_cuda.serving.engine")

# The idle lane (a shadow chunk, a timed self-check) waits until the engine has been idle this long: a client
# that sends its next request as its last one is answered (a thread pool, a load test) does so within a
# millisecond or two, so a saturating load never meets an idle-lane chunk it would have to wait behind.
IDLE_GRACE_S = 0.02


class QueueFullError(ClefError):
    """The bounded queue is full (HTTP 503 with Retry-After)."""


class EngineStoppedError(ClefError):
    """The engine is draining or stopped and takes no new requests (HTTP 503)."""


class RequestCancelledError(ClefError):
    """The request was cancelled (its client went away) before it finished."""


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 4
    prefill_chunk_size: int = 1024
    # Token budget of one record; None: the decider's (clef_cuda.model.config.context_length: the reference's
    # 16384, or the release's max_position_embeddings when fewer). Past the release's only with allow_long_context.
    max_model_len: int | None = None
    allow_long_context: bool = False
    block_size: int = 16
    kv_fraction: float = 0.30
    prefix_cache: bool = True
    max_queue: int = 256
    state_overflow: str = "reject"
    confidence: str = "clef"
    snapshot_fraction: float = 0.25  # of the cache budget, for prefix snapshots (state slots + head rows)
    max_snapshots: int = 256
    # A reuse point costs an extra trunk step (prefill must stop there to snapshot the state), so one is
    # planned only when it saves at least this many tokens over the previous one; shorter prefixes are
    # cheaper to recompute.
    min_snapshot_tokens: int = 256
    vision_cache_bytes: int = 256 * 2**20  # vision-tower outputs kept by image digest
    # Re-deciding a sample of answered records on the reference ops, when idle (clef_cuda.verification.shadow).
    shadow: ShadowConfig = ShadowConfig()
    # The start-up self-check again every this many seconds, when idle (None: only at start-up); a failure is
    # handed to on_timed_selfcheck_failed (the lifecycle's, which applies --selfcheck).
    selfcheck_interval: float | None = None


class Admission:
    """A place in the engine's queue, taken before a request's images and videos are decoded (Engine.admit), so a
    request the queue would refuse gets its 503 before any decoding; submit() spends it, and leaving the `with`
    block without a submit gives it back."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.held = True

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc) -> None:
        self._engine._give_back(self)


@dataclass
class Ticket:
    """A submitted request: `future` resolves to the response body (or raises)."""

    id: int
    future: concurrent.futures.Future
    record: EncodedRecord
    images: list[PreparedImage] = field(default_factory=list)  # the record's images, prepared (request order)
    adapter: Adapter | None = None  # the variant it asked for (held until the request settles), None: base
    request_id: str = ""  # the HTTP layer's X-Request-Id (logs name it)
    confidence: str | None = None  # answers.CONFIDENCE_MODES, for this request (None: the engine's)
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    timeline: Timeline | None = None  # what happens to it here, when: kept only when the caller asked (traces)


@dataclass
class _Sequence:
    ticket: Ticket
    request: dict[str, Any]
    layout: RecordLayout
    inputs: HeadInputs
    slot: int
    blocks: list[int]
    position: int
    reuse_points: list[int]  # block-aligned positions where a snapshot is taken (ascending, > position)
    cached_tokens: int
    started: float
    base_head: Any = None  # the base model's joint head (used when the ticket has no variant)
    rope_positions: torch.Tensor | None = None  # [3, N] (None: text only)
    features: list[torch.Tensor | None] = field(default_factory=list)  # per image (None: its tokens are cached)
    fingerprint: Fingerprint | None = None  # sampled for shadow verification: its layers' sketches

    @property
    def record(self) -> EncodedRecord:
        return self.ticket.record

    @property
    def head(self):
        """The joint head that decides it: its variant's, or the base model's."""
        return self.ticket.adapter.head if self.ticket.adapter is not None else self.base_head

    @property
    def variant(self) -> bytes:
        """The variant's content digest (b"" for the base model): every cache keys on it."""
        return self.ticket.adapter.digest if self.ticket.adapter is not None else b""


def _on_host(rows: torch.Tensor) -> torch.Tensor:
    """A host copy of device rows (pinned, so a step's copy back is asynchronous); host rows as they are."""
    return rows if rows.device.type == "cpu" else rows.to("cpu").pin_memory()


def plan_memory(decider: Decider, config: EngineConfig, reserved_bytes: int = 0) -> CachePlan:
    """Split kv_fraction of the free device memory (after `reserved_bytes`: the adapter pool) into state
    slots, prefix snapshots and KV blocks (clef_cuda.serving.plan.plan_cache)."""
    device = decider.device
    if device.type == "cuda":
        torch.cuda.empty_cache()  # what loading cached and freed is free, not used
        free, _ = torch.cuda.mem_get_info(device)
    else:
        import psutil

        free = psutil.virtual_memory().available
    # The trunk's own config: on a tensor-parallel rank its shard's heads, whose slots and blocks it holds.
    return plan_cache(decider.trunk.config, decider.trunk.dtype, config, free - reserved_bytes, device.type)


class Engine:
    def __init__(
        self, decider: Decider, config: EngineConfig = EngineConfig(), adapters: AdapterRegistry | None = None
    ) -> None:
        if config.max_num_seqs < 1 or config.prefill_chunk_size < 1 or config.block_size < 1:
            raise ValueError("max_num_seqs, prefill_chunk_size and block_size must be positive")
        trunk = decider.config.trunk
        if config.max_model_len is None:
            config = replace(config, max_model_len=decider.options.max_length)
        else:
            length = context_length(trunk, config.max_model_len, config.allow_long_context)
            if (warning := past_training(trunk, length)) and length > decider.options.max_length:
                log.warning(warning)  # the decider warned of its own budget already
        self.decider, self.config, self.adapters = decider, config, adapters
        reserved = 0
        if adapters is not None:  # room for the variants still to come; the loaded ones hold theirs already
            reserved = max(0, adapters.pool_bytes() - adapters.bytes())
            log.info(
                "adapters: a pool of %.0f MiB for %d variants at rank <= %d (%d loaded, %.0f MiB), reserved "
                "before the cache budget",
                adapters.pool_bytes() / 2**20,
                adapters.max_adapters,
                adapters.max_rank,
                len(adapters.names()),
                adapters.bytes() / 2**20,
            )
        self.weight_bytes = decider.weight_bytes()  # by part, for the log and clef_weight_bytes
        log.info(
            "weights: %.1f MiB (%s)%s",
            sum(self.weight_bytes.values()) / 2**20,
            ", ".join(f"{part} {n / 2**20:.1f} MiB" for part, n in self.weight_bytes.items()),
            "; int8 (W8A16), dequantize scratch %.1f MiB" % (decider.trunk.scratch.nbytes() / 2**20)
            if decider.trunk.quantized
            else "",
        )
        if config.shadow.enabled:  # a shadow run's own slot and scores (its KV blocks are lent from the pool)
            trunk, dtype = decider.trunk.config, decider.trunk.dtype
            step = step_activation_bytes(
                trunk, dtype, config.max_num_seqs * config.prefill_chunk_size, config.max_num_seqs
            )
            reserved += shadow_run_bytes(trunk, dtype, config.max_model_len, step)
        self.plan = plan_memory(decider, config, reserved)
        # Slots [0, running) hold running sequences; [running, running + snapshots) prefix snapshots; one more the
        # shadow run's (its KV blocks are lent from the pool when free: lend_to_shadow).
        self.shadow_slot = self.plan.running_slots + self.plan.snapshot_slots if config.shadow.enabled else None
        self.cache = decider.trunk.allocate_cache(
            self.plan.running_slots + self.plan.snapshot_slots + (1 if config.shadow.enabled else 0),
            self.plan.num_blocks,
            config.block_size,
        )
        self.running_slots = FreeList(self.plan.running_slots)
        self.snapshot_slots = FreeList(self.plan.snapshot_slots, first=self.plan.running_slots)
        self.blocks = BlockPool(self.plan.num_blocks)
        self.prefix_cache = PrefixCache()
        self.prefix_cache_bytes = 0
        self.vision_cache = VisionCache(config.vision_cache_bytes)
        log.info(self.plan.describe(config.block_size, config.max_model_len))

        self._lock = threading.Condition()
        self._queue: deque[tuple[Ticket, dict[str, Any]]] = deque()
        self._admitted = 0  # places held by admissions not yet submitted (Engine.admit): they count as queued
        self._running: list[_Sequence] = []
        self._ids = itertools.count(1)
        self._accepting = True
        self._stop = False
        self._forget: list[bytes] = []  # variants whose prefix entries are to go
        self._thread: threading.Thread | None = None
        # The joint head of finished records runs here, beside the scheduler's next trunk step.
        self._head_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="clef-head")
        # Counters read by the HTTP layer's /metrics.
        self.completed = 0
        self.failed = 0
        self.steps = 0
        self.images = 0  # images of admitted records
        self.image_tokens = 0
        self.vision_seconds = 0.0  # time in the vision tower
        # Videos as they are decoded (by the callers' threads, in encode): clips, their seconds, the decoding time.
        self.videos = 0
        self.video_seconds = 0.0
        self.video_decode_seconds = 0.0
        self._video_lock = threading.Lock()
        # Verification while serving: shadow runs of answered records, and the self-check on a timer.
        self.shadow = ShadowVerifier(config.shadow, decider.trunk.dtype, self._release, decider.config.trunk.num_layers)
        self.shadow.lender = self
        self.sketch = CountSketch(decider.config.trunk.hidden_size, decider.device) if config.shadow.enabled else None
        self.selfcheck_report: SelfCheckReport | None = None  # the last timed run's (None: none yet)
        self.on_timed_selfcheck_failed: Callable[[SelfCheckReport], None] | None = None
        self._next_selfcheck: float | None = None
        self._last_busy = 0.0  # when the scheduler last did real work (IDLE_GRACE_S)
        # A sticky CUDA error (clef_cuda.verification.guarded_ops): the device is unusable for the rest of this
        # process. The server's handler records the kernel and exits; without one the engine refuses work.
        self.kernel_fault: KernelFault | None = None
        self.on_kernel_fault: Callable[[KernelFault], None] | None = None

    # ---- submission (any thread) ------------------------------------------------------------------
    def encode(
        self,
        request: dict[str, Any],
        images: list[bytes] = (),
        videos: list[tuple[bytes, str | None]] = (),
        timeline: Timeline | None = None,
    ) -> tuple[EncodedRecord, list[PreparedImage]]:
        """Validate, prepare the images and videos (decode, preprocess: on the caller's thread, not the scheduler's)
        and encode: RequestError / ImageError / VideoError / RequestTooLongError; also checks the record can ever
        fit. Returns the record and the tower's inputs of its media spans, in order: the images, then each video's
        frame groups. `timeline`, when given, records the videos' decoding ("videos")."""
        validate_request(request)
        prepared = self.decider.prepare_images(list(images))
        decoding_ns = time.time_ns()
        clips = self.decider.prepare_videos(list(videos))
        if clips:
            with self._video_lock:
                self.videos += len(clips)
                self.video_seconds += sum(clip.seconds for clip in clips)
                self.video_decode_seconds += sum(clip.decode_seconds for clip in clips)
            if timeline is not None:
                timeline.add(
                    "videos",
                    decoding_ns,
                    videos=len(clips),
                    seconds=sum(clip.seconds for clip in clips),
                    frame_groups=sum(len(clip.groups) for clip in clips),
                )
        record = encode_request(
            self.decider.tokenizer,
            request,
            self.config.max_model_len,
            self.config.state_overflow,
            images=prepared,
            media_tokens=self.decider.config.media_tokens,
            videos=clips,
        )
        prepared = prepared + [group for clip in clips for group in clip.groups]
        needed = -(-record.num_tokens // self.config.block_size)
        if needed > self.plan.num_blocks:
            raise RequestTooLongError(
                f"the record needs {record.num_tokens} tokens, over this server's maximum context length: its KV "
                f"cache holds {self.plan.num_blocks * self.config.block_size} tokens",
                input_tokens=record.num_tokens,
                max_tokens=self.plan.num_blocks * self.config.block_size,
                fixed_tokens=record.num_tokens - record.state_tokens,
            )
        return record, prepared

    def admit(self) -> Admission:
        """A place in the queue for a request about to be encoded (its media decoded): QueueFullError or
        EngineStoppedError now, before that work, if submit would refuse it. Use as `with engine.admit() as
        admission: ... engine.submit(..., admission=admission)`."""
        with self._lock:
            refusal = self._refusal(self._admitted)
            if refusal is not None:
                raise refusal
            self._admitted += 1
            return Admission(self)

    def _give_back(self, admission: Admission) -> None:
        with self._lock:
            if admission.held:
                admission.held = False
                self._admitted -= 1

    def _refusal(self, held_elsewhere: int) -> EngineStoppedError | QueueFullError | None:
        """Why a new request cannot be queued now (under the lock): the GPU faulted, the engine stops, or the queue
        with the places admissions hold (`held_elsewhere`) is full."""
        if self.kernel_fault is not None:
            return EngineStoppedError(f"the GPU faulted ({self.kernel_fault}); the server must restart")
        if not self._accepting:
            return EngineStoppedError("the server is shutting down")
        if len(self._queue) + held_elsewhere >= self.config.max_queue:
            return QueueFullError(f"the queue is full ({self.config.max_queue} waiting requests)")
        return None

    def submit(
        self,
        request: dict[str, Any],
        record: EncodedRecord | None = None,
        images: list[PreparedImage] = (),
        adapter: Adapter | None = None,
        request_id: str = "",
        confidence: str | None = None,
        timeline: Timeline | None = None,
        admission: Admission | None = None,
    ) -> Ticket:
        """Queue a record. `adapter`: a variant the caller acquired from self.adapters (the engine releases
        it when the request settles). Without a record, the request is encoded here and its `model` may
        name a variant. `request_id` is what the logs call it; `confidence` this request's confidence mode
        (answers.CONFIDENCE_MODES; None: config.confidence); `timeline`, when given, records its queue wait,
        images, prefill chunks, head and shadow re-decision (clef_cuda.serving.timeline); `admission`, the queue place
        admit() gave it (spent here, queued or refused)."""
        if record is None:
            if adapter is None and self.adapters is not None:
                adapter = self.adapters.acquire(request.get("model"))
            try:
                options = self.decider.options
                record, images = self.encode(
                    request,
                    request_images(request, options.image_limits),
                    request_videos(request, options.video_limits),
                )
            except BaseException:
                self._release(adapter)
                raise
        if confidence is not None and confidence not in answers.CONFIDENCE_MODES:
            self._release(adapter)
            raise ValueError(f"confidence must be one of {answers.CONFIDENCE_MODES}, got {confidence!r}")
        if timeline is not None:
            timeline.submitted_ns = time.time_ns()  # its wait in the queue starts now
        ticket = Ticket(
            next(self._ids),
            concurrent.futures.Future(),
            record,
            list(images),
            adapter,
            request_id,
            confidence=confidence,
            timeline=timeline,
        )
        with self._lock:
            spent = admission is not None and admission.held
            if spent:  # its place, counted since admit(): the queue and the places held never pass max_queue
                admission.held = False
                self._admitted -= 1
            refusal = self._refusal(0 if spent else self._admitted)
            if refusal is None:
                self._queue.append((ticket, request))
                self._lock.notify()
                return ticket
        self._release(adapter)  # a refused request lets go of its variant, whatever refused it
        raise refusal

    def _release(self, adapter: Adapter | None) -> None:
        if adapter is not None and self.adapters is not None:
            self.adapters.release(adapter)

    def _settle(self, ticket: Ticket, result: dict[str, Any] | None = None, error: BaseException | None = None) -> None:
        """Resolve a request's future (once) and let go of its variant."""
        if not ticket.future.done():
            if error is not None:
                ticket.future.set_exception(error)
            else:
                ticket.future.set_result(result)
        self._release(ticket.adapter)
        ticket.adapter = None

    def forget_variant(self, digest: bytes) -> None:
        """An unloaded variant's prefix entries go (at the scheduler's next turn: it owns the cache)."""
        with self._lock:
            self._forget.append(digest)
            self._lock.notify()

    def cancel(self, ticket: Ticket) -> None:
        """Drop the request (its client went away): its slot and blocks are freed at the next step."""
        ticket.cancelled.set()
        with self._lock:
            self._lock.notify()

    def decide(self, request: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Submit and wait (for callers without an event loop)."""
        return self.submit(request).future.result(timeout)

    # ---- introspection (any thread) ---------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._running)

    def prefills(self) -> list[dict[str, Any]]:
        """The running records' progress, oldest first: the request id, tokens prefilled of the record's total (those
        taken from the prefix cache count as prefilled), and seconds since admission (what /status shows: a
        262,144-token prefill takes minutes)."""
        now = time.perf_counter()
        return [
            {
                "request_id": seq.ticket.request_id,
                "tokens_prefilled": seq.position,
                "tokens_total": seq.record.num_tokens,
                "cached_tokens": seq.cached_tokens,
                "seconds": round(now - seq.started, 3),
            }
            for seq in list(self._running)
        ]

    def cache_usage(self) -> float:
        """0..1, what inference routers balance on: max(KV blocks live sequences hold / all blocks, running
        state slots in use / running slots). Blocks only the prefix cache holds count as free (evictable)."""
        live = {block for seq in list(self._running) for block in seq.blocks}
        blocks = len(live) / max(1, self.blocks.capacity)
        slots = (self.plan.running_slots - self.running_slots.available) / max(1, self.plan.running_slots)
        return min(1.0, max(blocks, slots))

    def variant_activity(self) -> tuple[list[str], list[str]]:
        """(variants with running records, variants with queued ones), sorted names."""
        running = {seq.ticket.adapter.name for seq in list(self._running) if seq.ticket.adapter is not None}
        with self._lock:
            waiting = {ticket.adapter.name for ticket, _ in self._queue if ticket.adapter is not None}
        return sorted(running), sorted(waiting)

    def state_slots_in_use(self) -> int:
        return (self.plan.running_slots - self.running_slots.available) + (
            self.plan.snapshot_slots - self.snapshot_slots.available
        )

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the scheduler thread; a second call is a no-op (one thread owns the model: two would step the
        same sequences; an ASGI client that runs the app's lifespan again calls this again). Under the lock, so a
        stop() from another thread (a shutdown while the lifecycle starts the engine) sees no thread or a started
        one."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            if self.config.selfcheck_interval:
                self._next_selfcheck = time.monotonic() + self.config.selfcheck_interval
            self._thread = threading.Thread(target=self._loop, name="clef-engine", daemon=True)
            self._thread.start()  # it waits for the lock, released below

    def drain(self) -> None:
        """Stop taking new requests; queued and running ones still finish."""
        with self._lock:
            self._accepting = False

    def stop(self, timeout: float | None = None) -> None:
        """Drain, wait for the work in hand to finish, then stop the thread."""
        self.drain()
        with self._lock:
            self._stop = True
            self._lock.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        self._head_thread.shutdown(wait=True)
        peers = self.decider.trunk.peers
        if peers is not None:  # the tensor-parallel workers go once the last step is done
            peers.stop()

    # ---- the scheduler (engine thread) -------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._running and not self._stop and not self._forget:
                    if self._idle_work():
                        # Idle for IDLE_GRACE_S first: a busy client's next request is usually on its way.
                        remaining = self._last_busy + IDLE_GRACE_S - time.monotonic()
                        if remaining <= 0:
                            break
                        self._lock.wait(timeout=remaining)
                        continue
                    self._lock.wait(timeout=self._idle_wait())
                if self._stop and not self._queue and not self._running:
                    self.shadow.drop_in_progress()
                    return
                busy = bool(self._queue or self._running)
            try:
                if not busy:  # the idle lane: a timed self-check, else one chunk of a shadow run
                    self._idle_turn()
                    continue
                self.shadow.pause()  # a sample never delays real work: it resumes at the next idle turn
                self._drop_forgotten()
                self._drop_cancelled()
                self._admit()
                if self._running:
                    self._step()
                else:
                    with self._lock:  # queued work that cannot be admitted yet: wait for a change
                        self._lock.wait(timeout=0.05)
                self._last_busy = time.monotonic()
            except Exception as error:  # a server fault (e.g. an f16 overflow): fail the pack, keep serving
                fault = self._kernel_fault(error)
                log.exception("engine step failed")
                for seq in list(self._running):
                    self._finish(seq, error=error)
                # Nothing can run on the device (or the tensor-parallel group) again: fail what waits, and stop.
                if fault is not None or getattr(error, "fatal", False):
                    with self._lock:
                        waiting, self._queue = list(self._queue), deque()
                        self._accepting = False
                    for ticket, _ in waiting:
                        self._release(ticket.adapter)
                        self._settle(ticket, error=error)
                    return

    def _kernel_fault(self, error: BaseException) -> KernelFault | None:
        """The KernelFault `error` is (a sticky CUDA error that surfaced outside our ops is pinned on the last of
        our kernels launched), handed to on_kernel_fault once; None for any other error."""
        fault = as_kernel_fault(error, self.decider.trunk.ops)
        if fault is None:
            return None
        with self._lock:
            first = self.kernel_fault is None
            if first:
                self.kernel_fault = fault
        if first and self.on_kernel_fault is not None:
            self.on_kernel_fault(fault)
        return fault

    # ---- the idle lane (engine thread) ----------------------------------------------------------------
    def _selfcheck_due(self) -> bool:
        return self._next_selfcheck is not None and time.monotonic() >= self._next_selfcheck

    def _idle_work(self) -> bool:
        return self.shadow.has_work or self._selfcheck_due()

    def _idle_wait(self) -> float:
        if self._next_selfcheck is None:
            return 1.0
        return max(0.0, min(1.0, self._next_selfcheck - time.monotonic()))

    def _idle_turn(self) -> None:
        if self._selfcheck_due():
            self._timed_selfcheck()
            return
        try:
            self.shadow.step(self.decider)
        except Exception as error:  # the reference run itself failed: not a verdict on the kernels; drop it
            self._kernel_fault(error)
            log.exception("a shadow run failed")
            self.shadow.abandon_run()

    def _timed_selfcheck(self) -> None:
        report = run_selfcheck(self.decider.trunk, block_size=self.config.block_size)
        self.selfcheck_report = report
        self._next_selfcheck = time.monotonic() + self.config.selfcheck_interval
        if report.passed:
            log.info("timed on-device kernel self-check %s", report.summary())
            return
        banner = "!" * 100
        log.error("%s\ntimed on-device kernel self-check %s\n%s\n%s", banner, report.summary(), report.table(), banner)
        if self.on_timed_selfcheck_failed is not None:
            self.on_timed_selfcheck_failed(report)

    def _drop_forgotten(self) -> None:
        with self._lock:
            forget, self._forget = set(self._forget), []
        for entry in self.prefix_cache.pop_where(lambda e: e.digests[:1] and e.digests[0] in forget) if forget else []:
            self._free_entry(entry)

    def _free_entry(self, entry: PrefixEntry) -> None:
        self.blocks.release(entry.blocks)
        self.snapshot_slots.give_back([entry.snapshot_slot])
        self.prefix_cache_bytes -= entry.bytes

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._running if s.ticket.cancelled.is_set()]:
            self._finish(seq, error=RequestCancelledError("cancelled"))
        with self._lock:
            kept = deque()
            for ticket, request in self._queue:
                if ticket.cancelled.is_set():
                    self._settle(ticket, error=RequestCancelledError("cancelled"))
                    self.failed += 1
                else:
                    kept.append((ticket, request))
            self._queue = kept

    def _reuse_points(self, record: EncodedRecord) -> list[int]:
        """Block-aligned ends of the state and of the schema, where worth a snapshot (ascending)."""
        if not self.config.prefix_cache or self.plan.snapshot_slots == 0:
            return []
        bs = self.config.block_size
        points, previous = [], 0
        for end in (record.prefix_tokens + record.state_tokens, record.num_tokens - record.suffix_tokens):
            point = end // bs * bs
            if record.inside_media(point):  # an image's tokens are restored whole or not at all
                continue
            if point - previous >= self.config.min_snapshot_tokens and point < record.num_tokens:
                points.append(point)
                previous = point
        return points

    def _lookup(
        self, record: EncodedRecord, layout_spans: list[tuple[int, int]], variant: bytes
    ) -> tuple[PrefixEntry | None, bytes]:
        for point in reversed(self._reuse_points(record)):
            tokens, digests = record.input_ids[:point], (variant, *record.media_digests(point))
            key = PrefixCache.key(tokens, digests)
            entry = self.prefix_cache.get(key, tokens, digests)
            if entry is not None and all((s, min(e, point)) in entry.span_sums for s, e in layout_spans if s < point):
                return entry, key
        return None, b""

    def _cached(self, record: EncodedRecord, point: int, variant: bytes) -> bool:
        return PrefixCache.key(record.input_ids[:point], (variant, *record.media_digests(point))) in self.prefix_cache

    def _evict_for(self, blocks_needed: int) -> bool:
        while self.blocks.available < blocks_needed:
            if not self._evict_one() and not self.shadow.yield_blocks():
                return False
        return True

    # ---- what the shadow run borrows (engine thread) --------------------------------------------------
    def lend_to_shadow(self, blocks_needed: int) -> tuple[TrunkCache, int, list[int]] | None:
        """The engine's pools for a shadow run: its own state slot and `blocks_needed` KV blocks, free ones or
        prefix snapshots' (evicted: a verified record is worth more than a prefix hit), never a running
        record's; None when there are not that many. Real work takes them back (shadow.yield_blocks: the run
        starts over later)."""
        if self.shadow_slot is None:
            return None
        while self.blocks.available < blocks_needed and self._evict_one():
            pass
        if self.blocks.available < blocks_needed:
            return None
        return self.cache, self.shadow_slot, self.blocks.take(blocks_needed)

    def take_back_from_shadow(self, blocks: list[int]) -> None:
        self.blocks.release(blocks)

    def _evict_one(self) -> bool:
        entry = self.prefix_cache.pop_oldest()
        if entry is None:
            return False
        self._free_entry(entry)
        return True

    def _admit(self) -> None:
        admitted: list[_Sequence] = []
        try:
            self._admit_into(admitted)
        finally:  # the tower runs once for every image the newly admitted records still need
            self._attach_features(admitted)

    def _admit_into(self, admitted: list[_Sequence]) -> None:
        while len(self._running) < self.config.max_num_seqs:
            with self._lock:
                if not self._queue:
                    return
                ticket, request = self._queue[0]
            record = ticket.record
            layout = RecordLayout.from_record(record, self.decider.device)
            spans = [q.span for q in record.questions] + [s for q in record.questions for s in q.option_spans]
            variant = ticket.adapter.digest if ticket.adapter is not None else b""
            entry, _ = self._lookup(record, spans, variant)
            reused = entry.length if entry is not None else 0
            needed = -(-record.num_tokens // self.config.block_size) - reused // self.config.block_size
            if entry is not None:
                self.blocks.share(entry.blocks)  # pin them before evicting for the rest
            if not self._evict_for(needed):
                if entry is not None:
                    self.blocks.release(entry.blocks)
                return  # wait until running sequences free blocks
            slot = self.running_slots.take(1)
            if slot is None:
                if entry is not None:
                    self.blocks.release(entry.blocks)
                return
            with self._lock:
                self._queue.popleft()
            new_blocks = self.blocks.take(needed)
            assert new_blocks is not None
            head = ticket.adapter.head if ticket.adapter is not None else self.decider.head
            inputs = head.start(layout, record.num_tokens)
            if entry is not None:
                self.prefix_cache.hits += 1
                self._restore(entry, slot[0], inputs, layout, spans)
            elif self._reuse_points(record):
                self.prefix_cache.misses += 1
            seq = _Sequence(
                ticket=ticket,
                request=request,
                layout=layout,
                inputs=inputs,
                slot=slot[0],
                blocks=(entry.blocks if entry is not None else []) + new_blocks,
                position=reused,
                reuse_points=[
                    p for p in self._reuse_points(record) if p > reused and not self._cached(record, p, variant)
                ],
                cached_tokens=reused,
                started=time.perf_counter(),
                base_head=self.decider.head,
                rope_positions=record.rope_positions(),
                fingerprint=Fingerprint(sketch_positions(record.num_tokens)) if self.shadow.wants() else None,
            )
            self._running.append(seq)
            admitted.append(seq)
            if ticket.timeline is not None:
                ticket.timeline.add("queue", ticket.timeline.submitted_ns, cached_tokens=reused)

    def _attach_features(self, admitted: list[_Sequence]) -> None:
        """Tower outputs for the images whose tokens the admitted records will prefill: from the vision
        cache, else the tower, one image at a time (its peak bounded by the largest image, as the memory plan
        counts it), each distinct image once. The records hold host copies until their prefill reaches them
        (a step copies its own rows over), so waiting features never crowd the device."""
        features: dict[bytes, torch.Tensor] = {}
        needed: dict[bytes, PreparedImage] = {}
        for seq in admitted:
            self.images += sum(not span.video for span in seq.record.media)
            self.image_tokens += sum(span.length for span in seq.record.media if not span.video)
            for span, image in zip(seq.record.media, seq.ticket.images, strict=True):
                if span.end <= seq.position or span.digest in features or span.digest in needed:
                    continue  # restored from the prefix cache, or already found
                rows = self.vision_cache.get(span.digest)
                if rows is None:
                    needed[span.digest] = image
                else:
                    features[span.digest] = rows
        started, started_ns = time.perf_counter(), time.time_ns()
        if needed:
            # Small inputs (a clip's frame pairs, thumbnails) share a tower call, up to the patches of the largest
            # input the plan sizes the tower's step for: one call, not one a pair, and no more memory.
            for batch in _tower_batches(list(needed.items()), self.decider.tower_patches):
                for (digest, _), rows in zip(batch, self.decider.image_features([i for _, i in batch]), strict=True):
                    self.vision_cache.put(digest, rows)
                    features[digest] = rows
            self.vision_seconds += time.perf_counter() - started
        held = {digest: _on_host(rows) for digest, rows in features.items()}
        for seq in admitted:
            seq.features = [None if span.end <= seq.position else held[span.digest] for span in seq.record.media]
            if seq.ticket.timeline is not None and seq.ticket.images:
                tower = sum(span.digest in needed for span in seq.record.media)
                seq.ticket.timeline.add("images", started_ns, inputs=len(seq.ticket.images), through_tower=tower)

    def _restore(self, entry: PrefixEntry, slot: int, inputs: HeadInputs, layout: RecordLayout, spans) -> None:
        self.decider.trunk.copy_slot(self.cache, slot, entry.snapshot_slot)
        inputs.memory[: entry.length].copy_(entry.memory)
        for index, (start, end) in enumerate(spans):
            if start < entry.length:
                inputs.span_sums[index].copy_(entry.span_sums[(start, min(end, entry.length))])
        inputs.filled = entry.length

    def _snapshot(self, seq: _Sequence, point: int) -> None:
        tokens, digests = seq.record.input_ids[:point], (seq.variant, *seq.record.media_digests(point))
        key = PrefixCache.key(tokens, digests)
        if key in self.prefix_cache:
            return
        memory = seq.inputs.memory[:point].clone()
        spans = [q.span for q in seq.record.questions] + [s for q in seq.record.questions for s in q.option_spans]
        span_sums = {
            (start, min(end, point)): seq.inputs.span_sums[index].clone()
            for index, (start, end) in enumerate(spans)
            if start < point
        }
        size = (
            self.plan.slot_bytes
            + memory.numel() * memory.element_size()
            + sum(t.numel() * t.element_size() for t in span_sums.values())
        )
        while self.prefix_cache_bytes + size > self.plan.snapshot_budget_bytes or self.snapshot_slots.available == 0:
            if not self._evict_one():
                return  # cannot make room: skip this snapshot
        (snap,) = self.snapshot_slots.take(1)
        self.decider.trunk.copy_slot(self.cache, snap, seq.slot)
        blocks = seq.blocks[: point // self.config.block_size]
        self.blocks.share(blocks)
        self.prefix_cache.put(key, PrefixEntry(tokens, digests, blocks, snap, memory, span_sums, size))
        self.prefix_cache_bytes += size

    @torch.inference_mode()
    def _step(self) -> None:
        chunks, packed, segments = [], [], []
        # The base model's rows first, then each variant's together: one contiguous run of rows per variant.
        offset = 0
        for seq in sorted(self._running, key=lambda s: s.variant):
            limit = seq.record.num_tokens
            if seq.reuse_points:
                limit = min(limit, seq.reuse_points[0])
            size = min(self.config.prefill_chunk_size, limit - seq.position)
            chunks.append(
                record_chunk(seq.record, seq.position, size, seq.slot, seq.blocks, seq.rope_positions, seq.features)
            )
            packed.append((seq, size))
            adapter = seq.ticket.adapter
            if adapter is not None:
                if segments and segments[-1][2] is adapter and segments[-1][1] == offset:
                    segments[-1] = (segments[-1][0], offset + size, adapter)
                else:
                    segments.append((offset, offset + size, adapter))
            offset += size
        batch = ChunkBatch.build(chunks, self.config.block_size, self.decider.device)
        started, started_ns = time.perf_counter(), time.time_ns()
        probe = self._probe(packed)
        hidden = self.decider.trunk.forward(batch, self.cache, AdapterBatch(segments) if segments else None, probe)
        self.steps += 1
        if self.decider.device.type == "cuda" and any(seq.ticket.timeline is not None for seq, _ in packed):
            torch.cuda.synchronize(self.decider.device)  # a traced step's end is its kernels', not their launch
        offset = 0
        for seq, size in packed:
            if seq.ticket.timeline is not None:  # the step's time: the chunk ran with the others packed beside it
                seq.ticket.timeline.add(
                    "prefill",
                    started_ns,
                    tokens=size,
                    position=seq.position,
                    tokens_total=seq.record.num_tokens,  # with position: how far along the record is
                    records=len(packed),
                    step=self.steps,
                )
            if seq.fingerprint is not None:  # what the head reads of each row, for the shadow's head check
                seq.fingerprint.record_output(seq.position, hidden[offset : offset + size], self.sketch, seq.head)
            seq.head.consume(seq.inputs, seq.layout, hidden[offset : offset + size])
            offset += size
            seq.position += size
            if seq.reuse_points and seq.position == seq.reuse_points[0]:
                seq.reuse_points.pop(0)
                self._snapshot(seq, seq.position)
            if seq.position == seq.record.num_tokens:
                self._finish(seq)
        if self.shadow.floor_due(time.perf_counter() - started):  # under load: the shadow's floor
            shadow_started = time.perf_counter()
            try:
                self.shadow.step(self.decider, SHADOW_FLOOR_CHUNK_TOKENS)
            except Exception as error:
                self._kernel_fault(error)
                log.exception("a shadow run failed")
                self.shadow.abandon_run()
            self.shadow.floor_spent(time.perf_counter() - shadow_started)

    def _probe(self, packed: list[tuple[_Sequence, int]]) -> LayerProbe | None:
        """The step's rows to sketch: the fingerprinted records' sketch positions this chunk computes."""
        rows, groups, offset = [], [], 0
        for seq, size in packed:
            if seq.fingerprint is not None:
                mine = [p for p in seq.fingerprint.positions if seq.position <= p < seq.position + size]
                if mine:
                    rows += [offset + p - seq.position for p in mine]
                    groups.append((seq.fingerprint, mine))
            offset += size
        if not rows:
            return None
        return LayerProbe(torch.tensor(rows, dtype=torch.int64, device=self.decider.device), groups, self.sketch)

    def _finish(self, seq: _Sequence, error: BaseException | None = None) -> None:
        """Release the sequence's slot and blocks (the head needs neither), then answer it on the head
        thread, so the next trunk step does not wait for this record's head."""
        self._running.remove(seq)
        self.blocks.release(seq.blocks)
        self.running_slots.give_back([seq.slot])
        if error is not None:
            self.failed += 1
            self._settle(seq.ticket, error=error)
            return
        self._head_thread.submit(self._answer_into_future, seq)

    def _answer_into_future(self, seq: _Sequence) -> None:
        timeline, started_ns = seq.ticket.timeline, time.time_ns()
        try:
            with torch.inference_mode():
                body, probabilities = self._answer(seq)
            if timeline is not None:
                timeline.add("head", started_ns, questions=len(seq.record.questions))
        except Exception as error:  # a server fault: the request fails, the server goes on
            self._kernel_fault(error)
            log.exception("answering a record failed")
            self.failed += 1
            self._settle(seq.ticket, error=error)
            return
        ticket = seq.ticket
        sample = None
        if seq.fingerprint is not None:  # copied before the answer goes out; the answer is never touched again
            if ticket.adapter is not None:
                self.adapters.hold(ticket.adapter)  # the sample's own hold: _settle lets go of the request's
            seq.fingerprint.keep_head_inputs(seq.inputs, seq.layout, self.sketch)  # the span means, last row it read
            sample = ShadowSample(
                ticket.request_id or f"#{ticket.id}",
                seq.request,
                ticket.record,
                list(ticket.images),
                ticket.adapter,
                seq.head,
                probabilities,
                seq.fingerprint,
                on_verdict=timeline.shadow if timeline is not None else None,
            )
        self.completed += 1
        self._settle(ticket, body)
        if sample is not None:
            self.shadow.offer(sample)
            with self._lock:
                self._lock.notify()  # the scheduler may be idle: it runs the sample

    def _answer(self, seq: _Sequence) -> tuple[dict[str, Any], list[list[float]]]:
        """The response body, and per question the probabilities it was answered from (encoded order)."""
        head = seq.head
        flat = head.probabilities(head.logits(seq.inputs, seq.layout), seq.layout).tolist()
        result, probabilities, cursor = {}, [], 0
        for question in seq.record.questions:
            n = len(question.option_ids)
            probabilities.append(flat[cursor : cursor + n])
            result[question.question_id] = answers.answer(
                seq.request["questions"][question.question_id],
                dict(zip(question.option_ids, probabilities[-1], strict=True)),
                seq.ticket.confidence or self.config.confidence,
            )
            cursor += n
        body = answers.response(seq.request["model"], result, seq.record.num_tokens)
        now = time.perf_counter()
        body["x_cached_tokens"] = seq.cached_tokens
        body["x_timing_ms"] = {
            "queue": round((seq.started - seq.ticket.submitted) * 1e3, 3),
            "prefill": round((now - seq.started) * 1e3, 3),
            "total": round((now - seq.ticket.submitted) * 1e3, 3),
        }
        body.update(seq.record.truncation_fields())
        return body, probabilities


def _tower_batches(images: list[tuple[bytes, PreparedImage]], patches: int) -> list[list[tuple[bytes, PreparedImage]]]:
    """`images` in order, cut into runs of at most `patches` patches each (an input larger than that alone)."""
    batches: list[list[tuple[bytes, PreparedImage]]] = []
    total = 0
    for item in images:
        size = item[1].num_patches
        if not batches or total + size > patches:
            batches.append([])
            total = 0
        batches[-1].append(item)
        total += size
    return batches
