"""Shadow verification: a sample of the records a server answered is decided again, in the scheduler's idle
time, through the trunk on clef_cuda.reference (the pure-torch ops, fp32 inside; same weights, same device,
the same joint head), and its probabilities compared with what was served.

The start-up self-check proves the kernels at a handful of shapes; this catches what only serving shows: a
context past those shapes, a batch composition, a driver or firmware change under a running pod, a GPU that
starts corrupting data. A served response is never touched: the record is re-run after it was answered,
from a copy of what it was answered with.

Sampling is deterministic: with rate r, record k (counting every answered record) is sampled when
floor(k r) > floor((k - 1) r), so r = 0.01 checks every hundredth record and r = 1 every one. At most one
sample waits; another that comes meanwhile is dropped and counted. A sample runs only while the engine has
no queued or running record, one reference chunk (SHADOW_CHUNK_TOKENS) per idle turn of the scheduler, so a
request that arrives waits at most one chunk; the sample is then dropped (counted), never resumed. Its
memory is its own: one state slot and the record's KV blocks, allocated for the run and freed after; the
engine's pools are not touched.

A sample matches when max |p_served - p_reference| over every option of every question is within
SHADOW_TOLERANCE for the serving dtype: the worst healthy difference measured on the test releases and
clef-tiny (benchmarks/shadow_tolerance.py; README, "Shadow verification") times SHADOW_MARGIN: fp32 1e-5
(the floor), f16 3.5e-3, bf16 1.1e-2.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from clef_cuda import reference
from clef_cuda.decider import DEFAULT_BLOCK_SIZE, record_chunk
from clef_cuda.model.adapters import Adapter, AdapterBatch
from clef_cuda.model.head import RecordLayout
from clef_cuda.model.trunk import ChunkBatch
from clef_cuda.model.trunk_cache import TrunkCache
from clef_cuda.request import answers
from clef_cuda.request.encoding import EncodedRecord
from clef_cuda.request.images import PreparedImage

log = logging.getLogger("clef_cuda.serving.shadow")

SHADOW_MODES = ("enforce", "warn", "off")
# Tokens of the record per reference step: bounds the reference attention's [heads, chunk, context] fp32
# scores (16 x 256 x 16k x 4 B = 256 MiB at clef-flash's worst) and how long a new request can wait.
SHADOW_CHUNK_TOKENS = 256
# Worst healthy max |p_served - p_reference| measured (benchmarks/shadow_tolerance.py --records 60, CPU,
# 2026-12-02, after the fused glue and the retrained clef-tiny: 180 records per dtype over the upstream tiny
# release, the mid test release and clef-tiny; f16's worst is clef-tiny's, bf16's the mid release's), times
# the margin, and never below the fp32 parity bound with the upstream reference (tests/parity.py). Not yet
# measured on a GPU (scripts/gpu_check.sh runs the benchmark there).
SHADOW_MARGIN = 4.0
SHADOW_FLOOR = 1e-5
SHADOW_WORST_HEALTHY = {torch.float32: 7.8e-7, torch.float16: 8.7e-4, torch.bfloat16: 2.8e-3}
SHADOW_TOLERANCE = {dtype: max(SHADOW_FLOOR, SHADOW_MARGIN * worst) for dtype, worst in SHADOW_WORST_HEALTHY.items()}


@dataclass(frozen=True)
class ShadowConfig:
    rate: float = 0.01  # of the answered records, in [0, 1]
    mode: str = "enforce"  # enforce: after max_mismatches the server stops answering; warn: log loudly; off
    max_mismatches: int = 1

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"--shadow-rate must be in [0, 1], got {self.rate}")
        if self.mode not in SHADOW_MODES:
            raise ValueError(f"--shadow-mode must be one of {', '.join(SHADOW_MODES)}, got {self.mode!r}")
        if self.max_mismatches < 1:
            raise ValueError(f"--shadow-max-mismatches must be at least 1, got {self.max_mismatches}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off" and self.rate > 0


@dataclass
class ShadowSample:
    """What a record was answered with, copied when it was answered."""

    request_id: str
    request: dict[str, Any]  # the body as the engine answered it (questions, model)
    record: EncodedRecord
    images: list[PreparedImage]
    adapter: Adapter | None  # held (AdapterRegistry.hold) until the sample is done; None: the base model
    head: Any  # the joint head that decided it
    served: list[list[float]]  # per question, the served probabilities in encoded order


@dataclass
class ShadowResult:
    sample: ShadowSample
    probabilities: list[list[float]]
    max_abs_error: float
    worst_question: str

    def side_by_side(self, confidence: str = "clef") -> str:
        rows = []
        for question, served, shadow in zip(
            self.sample.record.questions, self.sample.served, self.probabilities, strict=True
        ):
            spec = self.sample.request["questions"][question.question_id]
            a = answers.answer(spec, dict(zip(question.option_ids, served, strict=True)), confidence)
            b = answers.answer(spec, dict(zip(question.option_ids, shadow, strict=True)), confidence)
            rows.append(f"{question.question_id}: served {a} | reference {b}")
        return "; ".join(rows)


class ShadowRun:
    """One sample through the reference trunk, a chunk at a time (step() until it returns True)."""

    def __init__(self, decider, sample: ShadowSample) -> None:
        self.decider, self.sample = decider, sample
        record = sample.record
        self.trunk = decider.trunk.with_ops(reference)
        blocks = -(-record.num_tokens // DEFAULT_BLOCK_SIZE)
        # Its own memory, one record's: a state slot and the record's KV blocks (never the engine's pools).
        self.cache = TrunkCache.allocate(
            decider.config.trunk, 1, blocks, DEFAULT_BLOCK_SIZE, decider.device, decider.trunk.dtype
        )
        self.blocks = list(range(blocks))
        self.layout = RecordLayout.from_record(record, decider.device)
        self.inputs = sample.head.start(self.layout, record.num_tokens)
        self.positions = record.rope_positions()
        self.features = decider.image_features(sample.images) if sample.images else []
        self.position = 0

    @torch.inference_mode()
    def step(self) -> bool:
        record = self.sample.record
        size = min(SHADOW_CHUNK_TOKENS, record.num_tokens - self.position)
        chunk = record_chunk(record, self.position, size, 0, self.blocks, self.positions, self.features)
        lora = AdapterBatch([(0, size, self.sample.adapter)]) if self.sample.adapter is not None else None
        hidden = self.trunk.forward(
            ChunkBatch.build([chunk], DEFAULT_BLOCK_SIZE, self.decider.device), self.cache, lora
        )
        self.sample.head.consume(self.inputs, self.layout, hidden)
        self.position += size
        return self.position == record.num_tokens

    @torch.inference_mode()
    def result(self) -> ShadowResult:
        head = self.sample.head
        flat = head.probabilities(head.logits(self.inputs, self.layout), self.layout).tolist()
        probabilities, cursor = [], 0
        for question in self.sample.record.questions:
            probabilities.append(flat[cursor : cursor + len(question.option_ids)])
            cursor += len(question.option_ids)
        worst, worst_question = 0.0, ""
        for question, served, shadow in zip(
            self.sample.record.questions, self.sample.served, probabilities, strict=True
        ):
            error = max(abs(a - b) if math.isfinite(b) else math.inf for a, b in zip(served, shadow, strict=True))
            if error > worst or not worst_question:
                worst, worst_question = error, question.question_id
        return ShadowResult(self.sample, probabilities, worst, worst_question)


@dataclass
class ShadowStats:
    match: int = 0
    mismatch: int = 0
    dropped: int = 0
    max_abs_error: float = 0.0
    errors: list[float] = field(default_factory=list)  # the last 1,000 checked samples' max |dp|


class ShadowVerifier:
    """The engine's shadow lane: sampling, the one waiting sample, the run in progress, the verdicts."""

    def __init__(self, config: ShadowConfig, dtype: torch.dtype, release) -> None:
        self.config, self.release = config, release  # release(adapter): let go of a held variant
        self.tolerance = SHADOW_TOLERANCE.get(dtype, SHADOW_TOLERANCE[torch.bfloat16])
        self.stats = ShadowStats()
        self.failure: str | None = None  # set once enforce mode has seen max_mismatches mismatches
        self._answered = 0
        self._lock = threading.Lock()
        self._waiting: ShadowSample | None = None
        self._run: ShadowRun | None = None

    def wants(self) -> bool:
        """Whether the record being answered now is to be sampled (called once per answered record)."""
        if not self.config.enabled:
            return False
        with self._lock:
            self._answered += 1
            k, r = self._answered, self.config.rate
            return math.floor(k * r) > math.floor((k - 1) * r)

    def offer(self, sample: ShadowSample) -> None:
        with self._lock:
            if self._waiting is None and self._run is None:
                self._waiting = sample
                return
            self.stats.dropped += 1
        self.release(sample.adapter)

    @property
    def has_work(self) -> bool:
        return self._waiting is not None or self._run is not None

    def drop_in_progress(self) -> None:
        """Real work arrived: the waiting sample or the run in progress is dropped (counted), never resumed."""
        with self._lock:
            dropped = self._run.sample if self._run is not None else self._waiting
            self._run = self._waiting = None
            if dropped is not None:
                self.stats.dropped += 1
        if dropped is not None:
            self.release(dropped.adapter)

    def step(self, decider) -> ShadowResult | None:
        """One reference chunk of the sample in hand (engine thread, idle only); its result when done."""
        with self._lock:
            if self._run is None and self._waiting is not None:
                sample, self._waiting = self._waiting, None
            else:
                sample = None
        if sample is not None:
            self._run = ShadowRun(decider, sample)
        run = self._run
        if run is None or not run.step():
            return None
        self._run = None
        try:
            result = run.result()
        finally:
            self.release(run.sample.adapter)
        self._judge(result)
        return result

    def _judge(self, result: ShadowResult) -> None:
        s = self.stats
        s.max_abs_error = max(s.max_abs_error, result.max_abs_error)
        s.errors = (s.errors + [result.max_abs_error])[-1000:]
        if result.max_abs_error <= self.tolerance:
            s.match += 1
            return
        s.mismatch += 1
        banner = "!" * 100
        log.error(
            "%s\nshadow verification MISMATCH on request %s: max |p_served - p_reference| %.3g > tolerance %.3g "
            "(worst question %r, %d tokens)\n%s\n%s",
            banner,
            result.sample.request_id,
            result.max_abs_error,
            self.tolerance,
            result.worst_question,
            result.sample.record.num_tokens,
            result.side_by_side(),
            banner,
        )
        if self.config.mode == "enforce" and s.mismatch >= self.config.max_mismatches and self.failure is None:
            self.failure = (
                f"shadow verification failed: {s.mismatch} served record(s) differed from the reference ops "
                f"(request {result.sample.request_id}: max |dp| {result.max_abs_error:.3g} > {self.tolerance:.3g}, "
                f"question {result.worst_question!r})"
            )
            log.error("%s; decisions are refused until an operator restarts the server", self.failure)
        elif self.config.mode == "warn":
            log.error("--shadow-mode warn: SERVING ANYWAY on kernels whose answers differed from the reference")
