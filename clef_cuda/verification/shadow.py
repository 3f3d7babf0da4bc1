"""Shadow verification: a sample of the records a server answered is decided again, in the scheduler's idle
time, through the trunk on clef_cuda.kernels.reference (the pure-torch ops, fp32 inside; same weights, same device,
the same joint head), and compared with what was served: layer by layer, then the probabilities.

The start-up self-check proves the kernels at a handful of shapes; this catches what only serving shows: a
context past those shapes, a batch composition, a driver or firmware change under a running pod, a GPU that
starts corrupting data. A served response is never touched: the record is re-run after it was answered,
from a copy of what it was answered with.

Layer fingerprints (clef_cuda.model.fingerprint): a record is chosen for a sample when it is admitted, and its
served pass sketches every layer's mixer and MLP input and output at a few positions and keeps the norms' and
the MLP's rows whole there; the shadow run sketches the same on the reference ops and replays each norm and
MLP on the reference ops from the served rows. The served pass also sketches what the head read at every
position, and each question's, option's and the last token's mean as the head held it. A sample matches when
every layer's output drift is within fingerprint_tolerance (of its kind, the serving dtype and the drift of the
input it was handed), every norm and MLP replay's worst channel gain within replay_tolerance, every span mean
the head read within head_read_tolerance of the mean of its tokens' rows, and max |p_served - p_reference|
over every option within record_probability_tolerance (the dtype, the depth, in fp32 the drift measured). A
mismatch names the first layer (and its kind) that differs, or the head (the span it read wrong, or the
probabilities). Comparing only the final probabilities is the blunt end: a softmax near 0 or 1 hides most of
a wrong layer.

Sampling is deterministic: with rate r, record k (counting every admitted record) is sampled when floor(k r) >
floor((k - 1) r), so r = 0.01 checks every hundredth record and r = 1 every one. Up to SHADOW_QUEUE samples
wait; one runs at a time, a reference chunk (SHADOW_CHUNK_TOKENS) per idle turn of the scheduler, so a request
that arrives waits at most one chunk. Work arriving pauses the run (its reference state kept), and the next idle
turn resumes it. A sample is dropped (counted) only when the queue is full or it has waited SHADOW_MAX_AGE_S.
Under a load that leaves no idle turn, a floor: once no sample has finished for --shadow-min-interval, the
scheduler runs one shadow chunk after a step whenever the shadow's time since the floor engaged is within
SHADOW_FLOOR_SHARE (2%) of the steps' time. A run's memory: the engine's shadow state slot (the memory plan
reserves it: plan.shadow_run_bytes) and one record's KV blocks lent from the engine's pool while free
(Engine.lend_to_shadow); real work that needs them takes them back and the run starts over later.

Tolerances: derived from the serving dtype's unit roundoff, the roundings of each layer (of the head's reads)
and the depth, or in fp32's probabilities the drift each record was measured to carry, times a margin; floors
for fp32's layers and replays (below, where they are defined); checked against healthy records on AVX2 and
AVX-512 (benchmarks/shadow_tolerance.py). Enforcement is in proportion: see MARGINAL_FACTOR.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from clef_cuda.decider import DEFAULT_BLOCK_SIZE, record_chunk
from clef_cuda.kernels import reference
from clef_cuda.model.adapters import Adapter, AdapterBatch
from clef_cuda.model.config import LINEAR_ATTENTION
from clef_cuda.model.fingerprint import (
    SKETCH_WIDTH,
    CountSketch,
    Fingerprint,
    LayerProbe,
    channel_gain_error,
    fingerprint_drift,
    head_read_error,
    output_drift,
)
from clef_cuda.model.head import RecordLayout
from clef_cuda.model.trunk import ChunkBatch
from clef_cuda.request import answers
from clef_cuda.request.encoding import EncodedRecord
from clef_cuda.request.images import PreparedImage

log = logging.getLogger("clef_cuda.verification.shadow")

SHADOW_MODES = ("enforce", "warn", "off")
# Tokens of the record per reference step: bounds how long a new request can wait, and the reference attention's
# memory (at clef-flash's 16k in f16: the context's keys and values 64 MiB, one KV head's 4 query heads' fp32
# scores and probabilities 2 x 4 x 256 x 16k x 4 B = 128 MiB, its keys and values in fp32 32 MiB: 224 MiB).
SHADOW_CHUNK_TOKENS = 256
# ... and fewer where the context is long: a chunk's reference attention stays within this (one token's, at least).
SHADOW_SCORES_BYTES = 256 * 2**20
# The floor under load runs shorter chunks: each one delays the running requests by its time, so it is kept to a
# few percent of a step.
SHADOW_FLOOR_CHUNK_TOKENS = 32
# Samples waiting, in host memory: each its request, record and fingerprint (the fingerprint's kept rows are the
# most: 4,096 channels x 8 positions x 32 layers x 56 B, 14 MiB at clef-flash's shapes). At most SHADOW_QUEUE of
# them and SHADOW_QUEUE_BYTES of fingerprints (18 at clef-flash's shapes); a sample past either is dropped.
SHADOW_QUEUE = 32
SHADOW_QUEUE_BYTES = 256 * 2**20
SHADOW_MAX_AGE_S = 1800.0  # a sample that waited longer is dropped: the load never let it run
SHADOW_FLOOR_SHARE = 0.02  # of step time, at most, that the floor under load gives the shadow run
SHADOW_NO_ROOM_RETRY_S = 0.05  # the engine had not the KV blocks a run needs: ask again after this
# Enforcement in proportion. A layer whose drift or replay is past its tolerance is a mismatch: its tolerance has
# a margin over every healthy record measured, and a faulty kernel moves its layer by far more. So are
# probabilities more than MARGINAL_FACTOR times their tolerance away. Probabilities just past their tolerance
# with every layer's fingerprint matched are marginal: what a healthy record on another machine can show (its
# CPU or GPU sums in another order; the head amplifies a drift at positions the fingerprints do not sketch), a
# warning in the log and a count, not a mismatch, unless MARGINAL_LIMIT of the last MARGINAL_WINDOW verdicts are
# marginal: a pattern no healthy server shows, which counts as one mismatch.
MARGINAL_FACTOR = 10.0
MARGINAL_WINDOW = 20
MARGINAL_LIMIT = 3
# Tolerances, derived from the computation each bounds and checked against healthy records on AVX2 and AVX-512
# (benchmarks/shadow_tolerance.py; the figures below: tests/test_shadow.py's 200 records, text, images and a
# variant, 2026-12-03).
#
# In f16 and bf16 the fast ops and the references compute each op in fp32 and round its output to the serving
# dtype at the same places; they differ only where their fp32 values fall on different sides of a rounding, by a
# unit roundoff u of that dtype (f16 2^-11, bf16 2^-8) at most. A layer's output has ROUNDINGS such roundings on
# its way from its input (a delta net: in_proj, conv, delta rule, gated norm, out_proj; attention: qkv, the q/k
# norm and rope, attention, the gate, o_proj; the MLP: gate_up, SiLU x up, down), independent of each other, so
# its own drift is within sqrt(ROUNDINGS) x u (healthy worst, both ISAs: f16 delta net 2.0 u, attention 0.7 u, MLP
# 1.0 u; bf16 1.1 u, 0.5 u, 1.0 u). In fp32 only the order of sums differs (1e-7 relative per sum), which the
# model's conditioning amplifies (per-layer gains up to 15-20 at single positions of the random test releases: a
# drift of 5.6e-6 seen in a delta net on AVX-512): no tight bound follows from u there, so fp32 layers are held
# to FINGERPRINT_FLOOR, 18x the worst seen, and a fault worth finding moves a layer by more.
FINGERPRINT_KINDS = ("delta net", "attention", "MLP")
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
ROUNDINGS = {"delta net": 5, "attention": 5, "MLP": 3, "norm replay": 1, "MLP replay": 3}
# A layer's output drifts by what it was handed (its input's drift, carried on with depth) amplified by the layer,
# plus its own rounding. So a layer is judged against its own input: drift(output) <= FINGERPRINT_MARGIN x
# (FINGERPRINT_GAIN x drift(input) + sqrt(ROUNDINGS) x u), never below FINGERPRINT_FLOOR. A fault in a layer whose
# input still agrees (the first wrong layer) then stands out by itself, at any depth. GAIN: the healthy
# output/input ratios at the sketched positions reach 11 where the input's drift is tiny, 3 where it is not, so 3
# with the rest counted as the layer's own.
FINGERPRINT_MARGIN = 4.0
FINGERPRINT_GAIN = 3.0
FINGERPRINT_FLOOR = 1e-4


def unit_roundoff(dtype: torch.dtype) -> float:
    return UNIT_ROUNDOFF.get(dtype, UNIT_ROUNDOFF[torch.bfloat16])


def healthy_local_drift(dtype: torch.dtype, kind: str) -> float:
    """What a healthy layer (or replay) of `kind` adds by its own roundings: sqrt(ROUNDINGS[kind]) x u."""
    return math.sqrt(ROUNDINGS[kind]) * unit_roundoff(dtype)


def fingerprint_tolerance(dtype: torch.dtype, kind: str, handed: float | None) -> float:
    """A layer's drift tolerance, given its input's drift (`handed`; None: not sketched, taken as 0)."""
    handed = handed if handed is not None and math.isfinite(handed) else 0.0  # a non-finite input excuses nothing
    local = healthy_local_drift(dtype, kind)
    return max(FINGERPRINT_FLOOR, FINGERPRINT_MARGIN * (FINGERPRINT_GAIN * handed + local))


def local_drift(error: float, handed: float | None) -> float:
    """What a layer's drift adds to what it was handed (the quantity healthy_local_drift bounds)."""
    return max(0.0, error - FINGERPRINT_GAIN * (handed or 0.0))


# The replays of the norms and MLPs (clef_cuda.model.fingerprint.channel_gain_error) are layer-local: a norm
# rounds its output once, an MLP three times, so a channel's healthy gain is within sqrt(ROUNDINGS) x u (healthy
# worst: the norm replay f16 0.6 u, bf16 0.3 u; the MLP replay exact on the CPU, where both sides round the same
# products the same way), times the margin; fp32 at REPLAY_FLOOR (3e-7 seen).
REPLAY_FLOOR = 1e-4


def replay_tolerance(dtype: torch.dtype, test: str) -> float:
    return max(REPLAY_FLOOR, FINGERPRINT_MARGIN * healthy_local_drift(dtype, test))


# The head's inputs (clef_cuda.model.fingerprint: head_read_error, output_drift). The head reads each question
# and option through the mean of its span and the last token on its own: positions a fault can be confined to
# while every layer fingerprint (8 positions) matches, and through which the probabilities could not flag it
# (their tolerance at clef-flash's depth is 0.025 in f16, 0.20 in bf16). So the served pass keeps a count sketch
# of what the head read at every position (its LayerNorm's output) and of each span mean and the last row it
# held, and each question, option and the last token is checked: the head's mean against the mean of its
# tokens' rows, both from the served pass (a sketch is linear). They differ only by roundings, all in the head's
# dtype (fp32 by default) or fp32, relative to a row:
#   - the head's sum of the span's n rows, one rounding a token (each within u of its partial sum, itself within
#     k rows: sqrt(sum k^2) / n = sqrt(n / 3) rows' worth in quadrature, counted as n), and its division by n;
#   - the sketches: a bucket sums hidden / SKETCH_WIDTH coordinates, in the mean's sketch and in each token's
#     (whose errors average over the n), and the mean of the tokens' sketches adds n more.
# So head_read_error <= FINGERPRINT_MARGIN x sqrt(1 + 2 n + 2 hidden / SKETCH_WIDTH) x u,
# u the head dtype's unit roundoff, at least fp32's (head_read_tolerance; the margin as for every derived bound
# here). No measured constant, nothing that grows with depth, and no drift excused: the head is held to what the
# trunk computed, in any serving dtype. In numbers (fp32 head): a 70-token option at clef-tiny's hidden 64, 2.9e-6;
# the last row at clef-flash's 4,096, 3.8e-6; healthy records measured 2.3 u of fp32 at worst (1.4e-7; 200
# records of tests/test_shadow.py in f32, f16 and bf16, AVX2 and AVX-512: margins 10x or more). An option's row
# read x 1.02 reads as 4-5e-3 (its tokens' rows average to a quarter of a row's norm), 1,400x its tolerance; a
# question read a token early, 3e-2 to 1.3.
#
# What it cannot see: a fault in the trunk's output at those positions, read faithfully (a question's rows
# written one token off): the layer fingerprints' domain at the positions they sketch, else the probabilities'.
# Comparing the head's positions with the reference, against the drift at the record's other positions, was
# tried and is unsound: on the test mix's LoRA variant the last attention layer drifts 45 u of f16 (1.9e-3 in
# fp32) at some option tokens, against 6-20 u (f16) at every other position. A span the served pass restored
# from the prefix cache in part is not checked (its tokens' rows were not sketched).
def head_read_tolerance(head_dtype: torch.dtype, tokens: int, hidden: int) -> float:
    """head_read_error's tolerance for a span of `tokens` (the last row: 1)."""
    roundings = 1 + 2 * tokens + 2 * hidden / SKETCH_WIDTH
    return FINGERPRINT_MARGIN * math.sqrt(roundings) * max(unit_roundoff(head_dtype), UNIT_ROUNDOFF[torch.float32])


def accumulated_drift(dtype: torch.dtype, depth: int) -> float:
    """The drift the trunk's output can carry from the roundings of `depth` layers, each adding its own
    (sqrt(ROUNDINGS["delta net"]) x u at most, independent): sqrt(5 depth) x u."""
    return math.sqrt(max(1, depth)) * healthy_local_drift(dtype, "delta net")


# The probabilities: the head maps a relative drift of its inputs to at most as much in a probability (HEAD_GAIN 1;
# measured 0.03-0.2 of it in f16), plus its own roundings (its layers, each rounding like a trunk layer, in the
# head's dtype), times SHADOW_MARGIN. What it was handed:
#   - in f16 and bf16, the drift the trunk's roundings accumulate over its depth (accumulated_drift; the
#     tolerance: f16 at clef-tiny's depth 5, 9.8e-3, at clef-flash's 32, 2.5e-2; bf16 7.8e-2 and 2.0e-1), which
#     bounds every healthy record measured (1.8 u seen in f16, 0.7 u in bf16, at depth 5);
#   - in fp32, where the order of sums differs and the model's conditioning amplifies it (no bound from u is
#     tight; the floor this replaces, 5e-5, was the worst record seen, 1.1e-5, times 4.6), the drift the rows
#     the head read were measured to carry on this record, served against reference (output_drift, over every
#     position: the head's memory reads them all), but no more than the trunk's last layer was allowed to carry
#     (its MLP's fingerprint tolerance), and none where a layer is past its tolerance: a drift past that is the
#     layer's mismatch, not an excuse for the head.
# So a record's tolerance is SHADOW_MARGIN x HEAD_GAIN x (max(accumulated, min(measured, last layer's allowed)) +
# sqrt(5 head layers) x u_head): record_probability_tolerance. No floor. A record past it with every layer and
# head input matched is marginal (MARGINAL_FACTOR), not a mismatch.
SHADOW_MARGIN = 4.0
HEAD_GAIN = 1.0
HEAD_ROUNDINGS_PER_LAYER = 5


def probability_tolerance(dtype: torch.dtype, depth: int) -> float:
    """max |p_served - p_reference| from the trunk's accumulated roundings alone (the record's own tolerance,
    record_probability_tolerance, is at least this): SHADOW_MARGIN x HEAD_GAIN x sqrt(5 depth) x u."""
    return SHADOW_MARGIN * HEAD_GAIN * accumulated_drift(dtype, depth)


def record_probability_tolerance(
    dtype: torch.dtype,
    depth: int,
    measured: float | None = None,
    allowed: float | None = None,
    head_dtype: torch.dtype = torch.float32,
    head_layers: int = 0,
) -> float:
    """max |p_served - p_reference| for one record: what the head was handed (the trunk's accumulated roundings,
    or the drift its inputs were `measured` to carry, no more than the last layer was `allowed`) and the head's
    own roundings over `head_layers` layers."""
    handed = accumulated_drift(dtype, depth)
    if measured is not None and math.isfinite(measured):
        handed = max(handed, min(measured, allowed if allowed is not None else math.inf))
    own = math.sqrt(HEAD_ROUNDINGS_PER_LAYER * head_layers) * unit_roundoff(head_dtype)
    return SHADOW_MARGIN * HEAD_GAIN * (handed + own)


@dataclass(frozen=True)
class ShadowConfig:
    rate: float = 0.01  # of the admitted records, in [0, 1]
    mode: str = "enforce"  # enforce: after max_mismatches the server stops answering; warn: log loudly; off
    max_mismatches: int = 1
    # Under a load that leaves no idle time: once no sample has finished for this long, steps make room for the
    # shadow run (at most SHADOW_FLOOR_SHARE of their time). None: never.
    min_interval: float | None = 300.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"--shadow-rate must be in [0, 1], got {self.rate}")
        if self.mode not in SHADOW_MODES:
            raise ValueError(f"--shadow-mode must be one of {', '.join(SHADOW_MODES)}, got {self.mode!r}")
        if self.max_mismatches < 1:
            raise ValueError(f"--shadow-max-mismatches must be at least 1, got {self.max_mismatches}")
        if self.min_interval is not None and self.min_interval <= 0:
            raise ValueError(f"--shadow-min-interval must be positive, got {self.min_interval}")

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
    fingerprint: Fingerprint | None = None  # the served pass's layer sketches
    nbytes: int = 0  # the fingerprint's host memory (set when offered: SHADOW_QUEUE_BYTES)
    offered_at: float = field(default_factory=time.monotonic)
    # Told the verdict ("match", "marginal", "mismatch"), when its run started and ended (time.time_ns) and the
    # largest probability difference: the request's trace (clef_cuda.serving.timeline). None: nobody asked.
    on_verdict: Callable[[str, int, int, float], None] | None = None


@dataclass(frozen=True)
class LayerCheck:
    layer: int
    kind: str  # "delta net" | "attention" | "MLP"
    error: float  # drift: fingerprint_drift of the sketches; a replay: its worst channel gain
    tolerance: float
    test: str = "drift"  # "drift" | "norm replay" | "MLP replay"
    input_error: float | None = None  # drift: the same layer's input's drift (what it was handed)

    @property
    def passed(self) -> bool:
        return self.error <= self.tolerance  # NaN compares false: fails


@dataclass(frozen=True)
class HeadInputCheck:
    """One question, option or the last token: the mean the served head read against its tokens' rows as the
    served trunk computed them (head_read_error, head_read_tolerance)."""

    what: str  # "question 'q'", "option 'o' of 'q'", "the last token"
    error: float
    tolerance: float
    tokens: int  # of the span

    @property
    def passed(self) -> bool:
        return self.error <= self.tolerance  # NaN compares false: fails

    def describe(self) -> str:
        return f"{self.what}: the head's mean of its {self.tokens} token(s) is not the mean of their rows"


@dataclass
class ShadowResult:
    sample: ShadowSample
    probabilities: list[list[float]]
    max_abs_error: float
    worst_question: str
    layers: list[LayerCheck] = field(default_factory=list)  # in layer order, mixer before MLP
    head_inputs: list[HeadInputCheck] = field(default_factory=list)  # questions, options, the last token
    tolerance: float | None = None  # of the probabilities, for this record (None: the verifier's)
    head_drift: float | None = None  # the largest drift of a row the head read, served against reference
    last_layer_allowed: float | None = None  # the drift tolerance of the trunk's last layer (its MLP's)

    @property
    def first_bad_layer(self) -> LayerCheck | None:
        return next((check for check in self.layers if not check.passed), None)

    @property
    def first_bad_head_input(self) -> HeadInputCheck | None:
        return next((check for check in self.head_inputs if not check.passed), None)

    def where(self, tolerance: float) -> tuple[str, str]:
        """(layer, kind) of the first difference over its tolerance: a layer's, else the head's ("-", "head": an
        input it read, or the probabilities past `tolerance`, or this record's own)."""
        bad = self.first_bad_layer
        if bad is not None:
            return str(bad.layer), bad.kind
        if self.first_bad_head_input is not None:
            return "-", "head"
        tolerance = self.tolerance if self.tolerance is not None else tolerance
        return ("-", "head") if self.max_abs_error > tolerance else ("-", "-")

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


def shadow_chunk_tokens(trunk_config, context: int, tokens: int = SHADOW_CHUNK_TOKENS, dtype=torch.float16) -> int:
    """Tokens of the next reference chunk ending near `context`: at most `tokens`, and few enough that the
    reference attention's peak (clef_cuda.kernels.reference.paged_attention_peak_bytes: the context's keys and values
    gathered, one KV head's scores and probabilities in fp32) stays within SHADOW_SCORES_BYTES."""
    c = trunk_config

    def peak(chunk: int) -> int:
        return reference.paged_attention_peak_bytes(
            c.num_attention_heads, c.num_key_value_heads, c.head_dim, chunk, max(1, context), dtype
        )

    chunk = max(1, tokens)
    while chunk > 1 and peak(chunk) > SHADOW_SCORES_BYTES:
        chunk = max(1, min(chunk - 1, chunk * SHADOW_SCORES_BYTES // max(1, peak(chunk))))
    return chunk


def shadow_scores_bytes(trunk_config, max_model_len: int, dtype=torch.float16) -> int:
    """The most a chunk's reference attention holds at `max_model_len` (the memory plan reserves it)."""
    c = trunk_config
    chunk = shadow_chunk_tokens(c, max_model_len, dtype=dtype)
    return reference.paged_attention_peak_bytes(
        c.num_attention_heads, c.num_key_value_heads, c.head_dim, chunk, max_model_len, dtype
    )


class NoRoomYet(Exception):
    """The engine has not the KV blocks free a shadow run needs: the sample waits."""


class ShadowRun:
    """One sample through the reference trunk, a chunk at a time (step() until it returns True). Its memory:
    the engine's shadow state slot and KV blocks free in the engine's pool, lent for the run (`lender`:
    Engine.lend_to_shadow; NoRoomYet when there are not enough free), or without a lender a pool of its own."""

    def __init__(self, decider, sample: ShadowSample, lender=None) -> None:
        self.decider, self.sample, self.lender = decider, sample, lender
        self.started_ns = time.time_ns()  # the run's start (its first chunk may wait for idle time)
        record = sample.record
        self.trunk = decider.trunk.with_ops(reference)
        if lender is not None:
            block_size = lender.cache.block_size
            lent = lender.lend_to_shadow(-(-record.num_tokens // block_size))
            if lent is None:
                raise NoRoomYet
            self.cache, self.slot, self.blocks = lent
        else:
            blocks = -(-record.num_tokens // DEFAULT_BLOCK_SIZE)
            self.cache = self.trunk.allocate_cache(1, blocks, DEFAULT_BLOCK_SIZE, name="shadow")
            self.slot, self.blocks = 0, list(range(blocks))
        try:
            self._start(decider, sample, record)
        except BaseException:  # the head's buffers, the vision tower (an out-of-memory): the lent blocks go back
            self.give_back()
            raise

    def _start(self, decider, sample: ShadowSample, record: EncodedRecord) -> None:
        self.layout = RecordLayout.from_record(record, decider.device)
        self.inputs = sample.head.start(self.layout, record.num_tokens)
        self.positions = record.rope_positions()
        self.features = decider.image_features(sample.images) if sample.images else []
        self.position = 0
        served = sample.fingerprint
        self.fingerprint = Fingerprint(served.positions) if served is not None else None
        self.sketch = CountSketch(decider.config.trunk.hidden_size, decider.device) if served is not None else None

    @torch.inference_mode()
    def step(self, tokens: int = SHADOW_CHUNK_TOKENS) -> bool:
        """The next `tokens` of the record; True when the record is done."""
        record = self.sample.record
        size = min(tokens, record.num_tokens - self.position)
        size = shadow_chunk_tokens(self.trunk.config, self.position + size, size, self.trunk.dtype)
        chunk = record_chunk(record, self.position, size, self.slot, self.blocks, self.positions, self.features)
        lora = AdapterBatch([(0, size, self.sample.adapter)]) if self.sample.adapter is not None else None
        probe = None
        if self.fingerprint is not None:
            mine = [p for p in self.fingerprint.positions if self.position <= p < self.position + size]
            if mine:
                rows = torch.tensor([p - self.position for p in mine], dtype=torch.int64, device=self.decider.device)
                probe = LayerProbe(rows, [(self.fingerprint, mine)], self.sketch, keep_rows=False)
        hidden = self.trunk.forward(
            ChunkBatch.build([chunk], self.cache.block_size, self.decider.device), self.cache, lora, probe
        )
        if self.fingerprint is not None:
            self.fingerprint.record_output(self.position, hidden, self.sketch, self.sample.head)
        self.sample.head.consume(self.inputs, self.layout, hidden)
        self.position += size
        return self.position == record.num_tokens

    def layer_checks(self) -> list[LayerCheck]:
        """Every layer's mixer and MLP sketches, served against reference, in layer order."""
        served, reference_ = self.sample.fingerprint, self.fingerprint
        if served is None or reference_ is None:
            return []
        trunk_config, dtype = self.decider.config.trunk, self.decider.trunk.dtype
        checks = []
        for layer, layer_type in enumerate(trunk_config.layer_types):
            mixer = "delta net" if layer_type == LINEAR_ATTENTION else "attention"
            for part, kind in (("mixer", mixer), ("mlp", "MLP")):
                if (error := self.norm_replay(layer, part + "_in")) is not None:
                    checks.append(LayerCheck(layer, kind, error, replay_tolerance(dtype, "norm replay"), "norm replay"))
                if part == "mlp" and (error := self.mlp_replay(layer)) is not None:
                    checks.append(LayerCheck(layer, kind, error, replay_tolerance(dtype, "MLP replay"), "MLP replay"))
                drift = fingerprint_drift(served.sketch(layer, part), reference_.sketch(layer, part))
                handed = fingerprint_drift(served.sketch(layer, part + "_in"), reference_.sketch(layer, part + "_in"))
                if drift is not None:
                    tolerance = fingerprint_tolerance(dtype, kind, handed)
                    checks.append(LayerCheck(layer, kind, drift, tolerance, "drift", handed))
        return checks

    def head_input_checks(self) -> tuple[list[HeadInputCheck], float | None]:
        """Each question, option and the last token the served head read, against its tokens' rows
        (head_read_tolerance); and the largest drift of a row the head read, served against reference
        (output_drift). Empty and None when the served pass kept none."""
        served = self.sample.fingerprint
        if served is None or served.head_rows is None or self.fingerprint is None:
            return [], None
        record, head = self.sample.record, self.sample.head
        outputs, computed = served.output_sketches(record.num_tokens)
        reference_outputs, _ = self.fingerprint.output_sketches(record.num_tokens)
        errors = head_read_error(served.head_rows, outputs, computed, self.layout).tolist()
        names = [f"question {q.question_id!r}" for q in record.questions]
        names += [f"option {o!r} of {q.question_id!r}" for q in record.questions for o in q.option_ids]
        tokens = [int(n) for n in self.layout.span_lengths.tolist()] + [1]
        hidden = self.decider.config.trunk.hidden_size
        checks = [
            HeadInputCheck(what, error, head_read_tolerance(head.dtype, n, hidden), n)
            for what, error, n in zip([*names, "the last token"], errors, tokens, strict=True)
            if not math.isnan(error)  # restored from the prefix cache in part: its rows were not sketched
        ]
        return checks, output_drift(outputs, reference_outputs, computed)

    def give_back(self) -> None:
        """The lent KV blocks back to the engine's pool (once)."""
        if self.lender is not None and self.blocks:
            self.lender.take_back_from_shadow(self.blocks)
            self.blocks = []

    def _lora(self, rows: int) -> AdapterBatch | None:
        return AdapterBatch([(0, rows, self.sample.adapter)]) if self.sample.adapter is not None else None

    @torch.inference_mode()
    def norm_replay(self, layer: int, part: str) -> float | None:
        """Layer `layer`'s input norm (part "mixer_in") or post-mixer norm ("mlp_in") on the reference ops from
        the served pass's residual rows: the worst channel gain of the served norm's output against it."""
        kept = self.sample.fingerprint.replay_pair(layer, part.replace("_in", "_res"), part)
        if kept is None:
            return None
        residual, served = kept
        reference_ = self.trunk.norm(layer, part, residual.to(self.decider.device), served.dtype)
        return channel_gain_error(served.float(), reference_.float().cpu())

    @torch.inference_mode()
    def mlp_replay(self, layer: int) -> float | None:
        """Layer `layer`'s MLP on the reference ops from the served pass's input rows: the worst channel gain
        of the served output against it (None: the rows were not kept)."""
        kept = self.sample.fingerprint.replay_pair(layer, "mlp_in", "mlp")
        if kept is None:
            return None
        inputs, served = kept
        reference_ = self.trunk.mlp(layer, inputs.to(self.decider.device), self._lora(inputs.shape[0]), replay=True)
        return channel_gain_error(served.float(), reference_.float().cpu())

    @torch.inference_mode()
    def result(self) -> ShadowResult:
        self.give_back()
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
        layers, (inputs, measured) = self.layer_checks(), self.head_input_checks()
        config, dtype = self.decider.config, self.trunk.dtype
        # The most the trunk's last layer may carry (its MLP's drift tolerance); a drift past a layer's excuses
        # nothing, so a record with a layer past its tolerance is held to the depth's roundings alone.
        last = [c for c in layers if c.layer == config.trunk.num_layers - 1 and c.kind == "MLP" and c.test == "drift"]
        allowed = last[0].tolerance if last else None
        if any(not c.passed for c in layers):
            measured = None
        head_layers = config.head.routing_layers + config.head.layers + 2  # + the input stage and the scorer
        tolerance = record_probability_tolerance(
            dtype, config.trunk.num_layers, measured, allowed, head.dtype, head_layers
        )
        return ShadowResult(
            self.sample, probabilities, worst, worst_question, layers, inputs, tolerance, measured, allowed
        )


@dataclass
class ShadowStats:
    match: int = 0
    mismatch: int = 0  # counted toward --shadow-max-mismatches
    marginal: int = 0  # only the probabilities, within MARGINAL_FACTOR of their tolerance, every layer matched
    dropped: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=MARGINAL_WINDOW))  # the last verdicts, by kind
    max_abs_error: float = 0.0
    errors: list[float] = field(default_factory=list)  # the last 1,000 checked samples' max |dp|
    # Per kind of layer output, each checked sample's worst local drift, and per replay ("norm replay", "MLP
    # replay") its worst channel gain (the tolerance benchmark reads them): the last 1,000 samples' values.
    layer_errors: dict[str, list[float]] = field(default_factory=dict)
    # Each checked sample's worst head input (error, tolerance, tokens) and its probabilities' (max |dp|, their
    # tolerance): the last 1,000 (the tolerance benchmark reads them).
    head_inputs: list[tuple[float, float, int]] = field(default_factory=list)
    probabilities: list[tuple[float, float]] = field(default_factory=list)
    mismatches_by_layer: dict[tuple[str, str], int] = field(default_factory=dict)  # (layer, kind) -> count
    last_mismatch: dict | None = None  # for /ready: request, layer, kind, error, tolerance
    first_mismatch: dict | None = None
    resumed: int = 0  # runs paused by work arriving and resumed later
    restarted: int = 0  # runs that gave their KV blocks back to real work and started over later
    floor_chunks: int = 0  # chunks run under load by the --shadow-min-interval floor
    floor_step_seconds: float = 0.0  # step time while the floor was engaged, in all
    floor_shadow_seconds: float = 0.0  # shadow time the floor gave, in all


class ShadowVerifier:
    """The engine's shadow lane: sampling at admission, the waiting samples, the run in progress (paused while
    work runs, resumed when idle), the floor under load, the verdicts."""

    def __init__(self, config: ShadowConfig, dtype: torch.dtype, release, depth: int) -> None:
        self.config, self.release = config, release  # release(adapter): let go of a held variant
        self.tolerance = probability_tolerance(dtype, depth)  # of the probabilities (the layers': their checks)
        self.stats = ShadowStats()
        # Told each mismatch counted (how many so far, and why: the first difference of this one); the lifecycle's
        # (clef_cuda.lifecycle.Lifecycle.shadow_mismatch) applies --shadow-mode and --shadow-max-mismatches.
        self.on_mismatch: Callable[[int, str], None] | None = None
        self._admitted = 0
        self._lock = threading.Lock()
        self._waiting: deque[ShadowSample] = deque()
        self.lender = None  # the engine, which lends a run its shadow slot and free KV blocks
        self._retry_at = 0.0  # no room for the next run: not before then
        self._run: ShadowRun | None = None
        self._paused = False  # the run in progress was interrupted by work (counted once it resumes)
        self._last_finished = time.monotonic()
        self._floor_step_seconds = 0.0  # step time since the floor engaged
        self._floor_shadow_seconds = 0.0  # shadow time it gave the run

    def wants(self) -> bool:
        """Whether the record being admitted now is to be sampled (called once per admitted record): its served
        pass then keeps a fingerprint."""
        if not self.config.enabled:
            return False
        with self._lock:
            self._admitted += 1
            k, r = self._admitted, self.config.rate
            return math.floor(k * r) > math.floor((k - 1) * r)

    def offer(self, sample: ShadowSample) -> None:
        sample.nbytes = sample.fingerprint.nbytes() if sample.fingerprint is not None else 0
        with self._lock:
            waiting = sum(s.nbytes for s in self._waiting)
            if len(self._waiting) < SHADOW_QUEUE and waiting + sample.nbytes <= SHADOW_QUEUE_BYTES:
                self._waiting.append(sample)
                return
            self.stats.dropped += 1
        self.release(sample.adapter)

    @property
    def lent_blocks(self) -> int:
        """KV blocks of the engine's pool the run in progress holds."""
        run = self._run
        return len(run.blocks) if run is not None and run.lender is not None else 0

    @property
    def has_work(self) -> bool:
        if self._run is not None:
            return True
        return bool(self._waiting) and time.monotonic() >= self._retry_at

    def pause(self) -> None:
        """Real work arrived: the run in progress keeps its state and resumes at the next idle turn."""
        if self._run is not None:
            self._paused = True

    def abandon_run(self) -> None:
        """The run in progress failed (not a verdict on the kernels): it is dropped (counted), the queue kept."""
        run, self._run = self._run, None
        if run is not None:
            run.give_back()
            self.stats.dropped += 1
            self.release(run.sample.adapter)

    def yield_blocks(self) -> bool:
        """Real work needs KV blocks the run in progress holds: it gives them back and its sample goes back to
        the head of the queue, to start over when blocks are free again (counted in stats.restarted). False
        when no run holds any."""
        run = self._run
        if run is None or run.lender is None or not run.blocks:
            return False
        run.give_back()
        self._run, self._paused = None, False
        with self._lock:
            self._waiting.appendleft(run.sample)
        self.stats.restarted += 1
        return True

    def drop_in_progress(self) -> None:
        """The engine stops: every waiting sample and the run in progress are dropped (counted)."""
        with self._lock:
            dropped = list(self._waiting) + ([self._run.sample] if self._run is not None else [])
            self._waiting.clear()
            if self._run is not None:
                self._run.give_back()
            self._run = None
            self.stats.dropped += len(dropped)
        for sample in dropped:
            self.release(sample.adapter)

    def _drop_aged(self) -> None:
        now = time.monotonic()
        with self._lock:
            aged = [s for s in self._waiting if now - s.offered_at > SHADOW_MAX_AGE_S]
            for sample in aged:
                self._waiting.remove(sample)
            self.stats.dropped += len(aged)
        for sample in aged:
            self.release(sample.adapter)

    def step(self, decider, tokens: int = SHADOW_CHUNK_TOKENS) -> ShadowResult | None:
        """One reference chunk (`tokens` of the record) of the sample in hand (engine thread); its result when
        done."""
        self._drop_aged()
        with self._lock:
            sample = self._waiting.popleft() if self._run is None and self._waiting else None
        if sample is not None:
            try:
                self._run = ShadowRun(decider, sample, self.lender)
            except NoRoomYet:  # running records hold the blocks: wait at the head of the queue, a moment at least
                with self._lock:
                    self._waiting.appendleft(sample)
                self._retry_at = time.monotonic() + SHADOW_NO_ROOM_RETRY_S
                return None
            except BaseException:  # it could not start (it gave its blocks back): dropped, counted, its hold let go
                self.stats.dropped += 1
                self.release(sample.adapter)
                raise
        run = self._run
        if run is None:
            return None
        if self._paused:
            self._paused = False
            self.stats.resumed += 1
        if not run.step(tokens):
            return None
        self._run = None
        try:
            result = run.result()
        finally:
            self.release(run.sample.adapter)
        verdict = self._judge(result)
        if run.sample.on_verdict is not None:
            run.sample.on_verdict(verdict, run.started_ns, time.time_ns(), result.max_abs_error)
        self._last_finished = time.monotonic()
        self._floor_step_seconds = self._floor_shadow_seconds = 0.0
        return result

    def floor_due(self, step_seconds: float) -> bool:
        """After a step under load: whether the --shadow-min-interval floor gives the run a chunk now (no
        sample finished within the interval, and the shadow's share of step time stays within
        SHADOW_FLOOR_SHARE). The engine then runs step() and reports its time with floor_spent()."""
        interval = self.config.min_interval
        if interval is None or not self.has_work or time.monotonic() - self._last_finished < interval:
            return False
        self._floor_step_seconds += step_seconds
        self.stats.floor_step_seconds += step_seconds
        return self._floor_shadow_seconds <= SHADOW_FLOOR_SHARE * self._floor_step_seconds

    def floor_spent(self, seconds: float) -> None:
        self._floor_shadow_seconds += seconds
        self.stats.floor_shadow_seconds += seconds
        self.stats.floor_chunks += 1

    def _judge(self, result: ShadowResult) -> str:
        """Count the verdict on `result` ("match", "marginal" or "mismatch"), log it, and hand a mismatch to
        on_mismatch; returns the verdict."""
        s = self.stats
        s.max_abs_error = max(s.max_abs_error, result.max_abs_error)
        s.errors = (s.errors + [result.max_abs_error])[-1000:]
        for kind in FINGERPRINT_KINDS:  # local drift, as the tolerances are measured
            checks = [c for c in result.layers if c.kind == kind and c.test == "drift"]
            drifts = [local_drift(c.error, c.input_error) for c in checks]
            if drifts:
                s.layer_errors[kind] = (s.layer_errors.get(kind, []) + [max(drifts)])[-1000:]
        for test in ("norm replay", "MLP replay"):
            replays = [c.error for c in result.layers if c.test == test]
            if replays:
                s.layer_errors[test] = (s.layer_errors.get(test, []) + [max(replays)])[-1000:]
        if result.tolerance is not None:
            self.tolerance = result.tolerance  # this record's (clef_shadow_tolerance shows the last one)
        if result.head_inputs:
            worst = max(result.head_inputs, key=lambda c: c.error / c.tolerance)
            s.head_inputs = (s.head_inputs + [(worst.error, worst.tolerance, worst.tokens)])[-1000:]
        s.probabilities = (s.probabilities + [(result.max_abs_error, self.tolerance)])[-1000:]

        layer, kind = result.where(self.tolerance)
        if kind == "-":
            s.match += 1
            s.recent.append("match")
            return "match"
        escalated = ""
        bad_input = result.first_bad_head_input
        if kind == "head" and bad_input is None and result.max_abs_error <= MARGINAL_FACTOR * self.tolerance:
            s.marginal += 1
            s.recent.append("marginal")
            seen = s.recent.count("marginal")
            log.warning(
                "shadow verification: request %s's probabilities differ from the reference by %.3g, past their "
                "tolerance %.3g (x%.1f) with every layer's fingerprint matched: marginal (%d of the last %d verdicts; "
                "%d make a mismatch)",
                result.sample.request_id,
                result.max_abs_error,
                self.tolerance,
                result.max_abs_error / self.tolerance,
                seen,
                len(s.recent),
                MARGINAL_LIMIT,
                extra={"request_id": result.sample.request_id},
            )
            if seen < MARGINAL_LIMIT:
                return "marginal"
            s.recent.clear()  # the pattern is counted once
            escalated = f", the {seen}th marginal difference in the last {MARGINAL_WINDOW} verdicts"
        else:
            s.recent.append("mismatch")
        s.mismatch += 1
        s.mismatches_by_layer[(layer, kind)] = s.mismatches_by_layer.get((layer, kind), 0) + 1
        bad = result.first_bad_layer
        if bad is not None:
            error, tolerance, check = bad.error, bad.tolerance, bad.test
            where = f"layer {layer} ({kind}{f' {bad.test}' if bad.test != 'drift' else ''})"
        elif bad_input is not None:
            error, tolerance, check = bad_input.error, bad_input.tolerance, "head input"
            where = f"the head's input, {bad_input.describe()}; every layer's fingerprint matched"
        else:
            error, tolerance, check = result.max_abs_error, self.tolerance, "probabilities"
            where = "the head (every layer's fingerprint and head input matched)"
        where += escalated
        s.last_mismatch = {
            "request_id": result.sample.request_id,
            "layer": layer,
            "kind": kind,
            "error": error,
            "tolerance": tolerance,
            "check": check,
            "max_abs_dp": result.max_abs_error,
        }
        if s.first_mismatch is None:
            s.first_mismatch = s.last_mismatch
        banner = "!" * 100
        log.error(
            "%s\nshadow verification MISMATCH on request %s, first at %s: error %.3g > tolerance %.3g; max "
            "|p_served - p_reference| %.3g (probability tolerance %.3g, worst question %r, %d tokens)\n%s\n%s",
            banner,
            result.sample.request_id,
            where,
            error,
            tolerance,
            result.max_abs_error,
            self.tolerance,
            result.worst_question,
            result.sample.record.num_tokens,
            result.side_by_side(),
            banner,
            extra={"request_id": result.sample.request_id},
        )
        reason = (
            f"shadow verification failed: {s.mismatch} served record(s) differed from the reference ops "
            f"(request {result.sample.request_id}: first at {where}, error {error:.3g} > {tolerance:.3g}; max "
            f"|dp| {result.max_abs_error:.3g}, question {result.worst_question!r})"
        )
        if self.on_mismatch is not None:
            self.on_mismatch(s.mismatch, reason)
        return "mismatch"
