"""The tunes: for each op with more than one implementation, every candidate that passes its check on this device
is timed at the loaded model's shapes, and the fastest is chosen, per bucket of call shape (what a step runs is
the choice of its nearest bucket: the policies below). clef_cuda.tuning.autotune runs them (inline, or in the
kernel trial process: clef_cuda.tuning.trials), caches and installs the choices.

Which implementation is fastest depends on the device (our CPU attention against torch's SDPA differs
between AVX-512 and AVX2 machines; a GPU's tensor-core kernels against cuDNN's and flash attention), so the
device decides. Ops and candidates:

- paged_attention: ours (the trunk's own op library, the dispatch rule's kernel; on a GPU also the
  tensor-core kernels v1 and v2 and the SIMT kernel forced: a card where one cannot run raises and is left
  out) and torch's SDPA on the context gathered from the pages, one candidate per backend the build offers
  (clef_cuda.kernels.sdpa).
- int8_linear (with --quantize int8), per step size: the fused W8A16 kernel (up to 64 rows), dequantize + GEMM,
  and on the CPU torch._weight_int8pack_mm.
- gated_delta_rule_chunk on a GPU, per prefill step shape (records x tokens each): the token-serial kernel and the
  chunked tensor-core one (where the device and dtype have it), at the model's delta-net shapes.

Buckets (`fast`): a prefill chunk at 1k, 4k and 16k tokens of context with one record, the same 1k chunk with
--max-num-seqs records, a 64-token chunk after a 4k cached prefix, and a decode pack of --max-num-seqs
records; `full` adds every kind at every context with both record counts. A batch runs the choice of the
nearest bucket of its kind (decode, chunk after a prefix, prefill), by record count then context.

A candidate is checked before it is timed: against the reference on a small pack (a chunk after a cached
prefix, a fresh prefill, a decode token; GQA) within the self-check's tolerance, and at each bucket against
ours; one that raises or fails is never chosen.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from clef_cuda.kernels import reference
from clef_cuda.kernels.sdpa import SDPA_BACKENDS, paged_attention_sdpa
from clef_cuda.model.config import TrunkConfig
from clef_cuda.model.quantize import Int8Weight
from clef_cuda.model.trunk import DEFAULT_INT8_BY_ROWS, INT8_FUSED_MAX_ROWS, ChunkBatch, SequenceChunk, Trunk
from clef_cuda.verification.guarded_ops import GuardedOps
from clef_cuda.verification.selfcheck import OP_RTOL, delta_rule_gates, within

log = logging.getLogger("clef_cuda.tuning.tunes")

AUTOTUNE_MODES = ("fast", "full", "off")
# Where never-run GPU kernels are first tried: "child" (a trial process, clef_cuda.tuning.trials), "inline"
# (this process: the CPU's default, whose kernels CI runs) or "auto" (child on a GPU).
KERNEL_TRIALS = ("auto", "child", "inline")
REPEATS = {"fast": 3, "full": 7}
# Past this much tuning time the remaining buckets keep ours untimed (fast: 10 s on a GPU and 20 s on a
# CPU are the targets at clef-tiny's shapes, which take ~5 s).
BUDGET_SECONDS = {"fast": 20.0, "full": 120.0}
GIVE_UP_FACTOR = 3.0  # a candidate whose first timed run is this much slower than the best is not repeated
CPU_SDPA = ("sdpa-flash", "sdpa-math")  # what torch offers on the CPU


@dataclass(frozen=True)
class Bucket:
    name: str
    kind: str  # "prefill" | "chunk" (a short chunk after a cached prefix) | "decode"
    records: int
    q_len: int
    context: int


def call_kind(q_len: int, context: int) -> str:
    if q_len <= 1:
        return "decode"
    return "chunk" if q_len <= 128 and context - q_len >= 4 * q_len else "prefill"


def attention_buckets(mode: str, max_num_seqs: int, chunk: int, max_model_len: int) -> list[Bucket]:
    contexts = [c for c in (1024, 4096, 16384) if c <= max_model_len] or [max_model_len]
    many = max(1, max_num_seqs)
    buckets = [Bucket(f"prefill {c // 1024}k", "prefill", 1, min(chunk, c), c) for c in contexts]
    first = contexts[0]
    buckets.append(Bucket(f"prefill {first // 1024}k x{many}", "prefill", many, min(chunk, first), first))
    prefix = contexts[min(1, len(contexts) - 1)]
    buckets.append(Bucket(f"chunk 64 after {prefix // 1024}k", "chunk", 1, 64, prefix))
    buckets.append(Bucket(f"decode {contexts[0] // 1024}k x{many}", "decode", many, 1, contexts[0]))
    if mode == "full":
        for c in contexts:
            buckets += [
                Bucket(f"prefill {c // 1024}k x{many}", "prefill", many, min(chunk, c), c),
                Bucket(f"chunk 64 after {c // 1024}k", "chunk", 1, 64, c),
                Bucket(f"chunk 64 after {c // 1024}k x{many}", "chunk", many, 64, c),
                Bucket(f"decode {c // 1024}k", "decode", 1, 1, c),
                Bucket(f"decode {c // 1024}k x{many}", "decode", many, 1, c),
            ]
    unique = {b.name: b for b in buckets}
    return list(unique.values())


def nearest_bucket(buckets: list[Bucket], q_lens: tuple[int, ...], contexts: tuple[int, ...]) -> Bucket:
    records, context = len(q_lens), max(contexts)
    kind = call_kind(max(q_lens), context)
    same = [b for b in buckets if b.kind == kind] or buckets

    def distance(b: Bucket) -> tuple[float, float]:
        return (abs(math.log(b.records) - math.log(records)), abs(math.log(b.context) - math.log(max(context, 1))))

    return min(same, key=distance)


# ---- what is tuned ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TuneTarget:
    """What the tune needs of a trunk: its op library, device, dtype and shapes. The trial process builds
    one from the config alone, without weights."""

    ops: object
    config: TrunkConfig
    device: torch.device
    dtype: torch.dtype

    @classmethod
    def of(cls, trunk: Trunk) -> TuneTarget:
        ops_ = trunk.ops.base if isinstance(trunk.ops, GuardedOps) else trunk.ops
        return cls(ops_, trunk.config, trunk.device, trunk.dtype)


# A unit of work that runs a kernel: `with trial(unit): ...`. Inline it does nothing; in the trial process
# it announces the unit before it runs and checks the device is still sound after (clef_cuda.tuning.trials).
Trial = Callable[[str], contextlib.AbstractContextManager]


@contextlib.contextmanager
def no_trial(unit: str) -> Iterator[None]:
    yield


# ---- candidates ---------------------------------------------------------------------------------
AttentionImpl = Callable  # (query, key_cache, value_cache, batch: ChunkBatch) -> out


def _ours(library, kernel: str) -> AttentionImpl:
    def run(query, key_cache, value_cache, batch: ChunkBatch):
        return library.paged_attention(
            query,
            key_cache,
            value_cache,
            batch.cu_seqlens,
            batch.context_lens,
            batch.block_tables,
            kernel=kernel,
            max_query_len=max(batch.q_lens, default=0) or None,
        )

    return run


def _sdpa(backend: str) -> AttentionImpl:
    def run(query, key_cache, value_cache, batch: ChunkBatch):
        return paged_attention_sdpa(
            query, key_cache, value_cache, batch.block_tables, batch.q_lens, batch.context_lengths, backend=backend
        )

    return run


FORCED_KERNELS = {"ours-simt": "simt", "ours-wmma": "wmma", "ours-wmma2": "wmma2"}


def candidate_kernel(candidate: str) -> str:
    """The kernel a candidate runs, as failures name it ("paged_attention:wmma2"; ours: "paged_attention:auto")."""
    if candidate == "ours":
        return "paged_attention:auto"
    return f"paged_attention:{FORCED_KERNELS.get(candidate, candidate)}"


def runs_cuda_kernels(target: TuneTarget) -> bool:
    """Whether the target's op library runs our CUDA kernels (a GPU; or the test-suite's simulator, which runs them on
    CPU tensors): asked of the library itself, which answers "cpu" for its CPU implementation."""
    if target.device.type == "cuda":
        return True
    dispatch = getattr(target.ops, "gated_delta_rule_dispatch", None)
    if dispatch is None:
        return False
    c = target.config
    q = torch.empty(1, c.linear_num_key_heads, c.linear_key_head_dim, dtype=target.dtype)
    v = torch.empty(1, c.linear_num_value_heads, c.linear_value_head_dim, dtype=target.dtype)
    try:
        return dispatch(q, v, torch.tensor([0, 1], dtype=torch.int32)) != "cpu"
    except (ValueError, TypeError, RuntimeError):  # a head dim the CUDA kernels do not take: the CPU's
        return False


def attention_candidates(target: TuneTarget | Trunk) -> dict[str, AttentionImpl]:
    """Name -> implementation; the forced kernels first, so that a kernel which fails its trial is known
    before ours (the dispatch rule) would pick it. Ours runs on the target's own op library."""
    if isinstance(target, Trunk):
        target = TuneTarget(target.ops, target.config, target.device, target.dtype)
    library = target.ops
    candidates: dict[str, AttentionImpl] = {}
    if runs_cuda_kernels(target):
        candidates |= {name: _ours(library, kernel) for name, kernel in FORCED_KERNELS.items()}
        candidates["ours"] = _ours(library, "auto")
        sdpa = SDPA_BACKENDS if target.device.type == "cuda" else CPU_SDPA
        candidates |= {name: _sdpa(name) for name in sdpa}
    else:
        candidates["ours"] = _ours(library, "auto")
        candidates |= {name: _sdpa(name) for name in CPU_SDPA}
    return candidates


# ---- the report ---------------------------------------------------------------------------------
@dataclass
class Row:
    op: str
    bucket: str
    candidate: str
    ms: float | None  # median; None: not timed
    status: str  # "chosen", "ok", "failed its check: ...", "raised: ...", "chosen untimed: past the ... budget"


@dataclass
class AutotuneReport:
    mode: str
    key: dict
    rows: list[Row] = field(default_factory=list)
    choices: dict[str, dict[str, str]] = field(default_factory=dict)  # op -> bucket -> candidate
    seconds: float = 0.0
    cached: bool = False
    # "op:kernel" -> why it must never run here (crashed or hung its trial, left a CUDA error, could not
    # launch, faulted while serving): GuardedOps routes around every one.
    failures: dict[str, str] = field(default_factory=dict)
    # Where the kernels were first tried: "inline", "child", or "unavailable: why" (no trial process could start:
    # the untried kernels are kept from running in `failures` for this process only; nothing is cached)
    trials: str = "inline"

    @property
    def cacheable(self) -> bool:
        return not self.trials.startswith("unavailable")

    def table(self) -> str:
        lines = [
            f"autotune ({self.mode}{', from the cache' if self.cached else ''}, {self.seconds:.1f} s):",
            f"{'op':16s} {'bucket':24s} {'candidate':16s} {'ms':>9s}  result",
        ]
        for r in self.rows:
            ms = f"{r.ms:9.3f}" if r.ms is not None else f"{'-':>9s}"
            lines.append(f"{r.op:16s} {r.bucket:24s} {r.candidate:16s} {ms}  {r.status}")
        for kernel, why in self.failures.items():
            lines.append(f"FAILED KERNEL {kernel}: {why} (never run again on this device; its op runs the reference)")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "mode": self.mode,
            "cached": self.cached,
            "seconds": round(self.seconds, 3),
            "choices": self.choices,
            "rows": [asdict(r) for r in self.rows],
            "failures": self.failures,
            "trials": self.trials,
        }

    @classmethod
    def from_json(cls, data: dict, key: dict, cached: bool = True) -> AutotuneReport:
        rows = [Row(**r) for r in data["rows"]]
        failures = dict(data.get("failures", {}))
        return cls(
            data["mode"], key, rows, data["choices"], data["seconds"], cached, failures, data.get("trials", "inline")
        )


class AttentionPolicy:
    """trunk.attention_choice: the candidate chosen for the batch's nearest bucket."""

    def __init__(self, buckets: list[Bucket], choices: dict[str, str], candidates: dict[str, AttentionImpl]):
        self.buckets = [b for b in buckets if choices.get(b.name) in candidates]
        self.impl = {b.name: candidates[choices[b.name]] for b in self.buckets}
        self.fallback = candidates["ours"]  # on a GuardedOps library: steered around any failed kernel

    def __call__(self, batch: ChunkBatch) -> AttentionImpl:
        if not self.buckets or not batch.q_lens:
            return self.fallback
        return self.impl[nearest_bucket(self.buckets, batch.q_lens, batch.context_lengths).name]


# ---- measuring ----------------------------------------------------------------------------------
def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(
    fn: Callable[[], object], repeats: int, device: torch.device, candidate: str = "", give_up_ms: float = math.inf
) -> float:
    """Median wall time of fn() over `repeats` runs after a warm-up, synchronised on a GPU. A candidate whose
    warm-up alone takes longer than `give_up_ms` (several times the fastest so far) is not repeated: its
    warm-up time stands (an SDPA math backend at 16k takes seconds a call on a CPU). `candidate` names what
    is timed, for tests that inject timings."""
    started = time.perf_counter()
    fn()  # warm-up (first-use set-up, caches)
    _synchronize(device)
    warm_up_ms = 1e3 * (time.perf_counter() - started)
    if warm_up_ms > give_up_ms:
        return warm_up_ms
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def _raised(error: BaseException) -> str:
    return f"raised: {str(error).splitlines()[0][:80] if str(error) else type(error).__name__}"


class _AttentionCase:
    """A pack of sequences, (new tokens, context) each, their caches filled with random keys and values,
    every sequence's blocks scattered through the pool."""

    def __init__(self, target: TuneTarget, shape: list[tuple[int, int]], block_size: int, generator) -> None:
        c, device, dtype = target.config, target.device, target.dtype
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        needed = [-(-context // block_size) for _, context in shape]
        order = torch.randperm(sum(needed), generator=generator).tolist()
        chunks, cursor = [], 0
        for (q_len, context), count in zip(shape, needed, strict=True):
            chunks.append(SequenceChunk([0] * q_len, context - q_len, -1, order[cursor : cursor + count]))
            cursor += count
        self.batch = ChunkBatch.build(chunks, block_size, device)

        def randn(*size):
            return torch.randn(*size, generator=generator).to(device=device, dtype=dtype)

        self.key_cache = randn(sum(needed), block_size, hkv, d)
        self.value_cache = randn(sum(needed), block_size, hkv, d)
        self.query = randn(sum(q for q, _ in shape), hq, d)

    @classmethod
    def of(cls, target: TuneTarget, bucket: Bucket, block_size: int, generator) -> _AttentionCase:
        return cls(target, [(bucket.q_len, bucket.context)] * bucket.records, block_size, generator)

    def run(self, impl: AttentionImpl) -> torch.Tensor:
        return impl(self.query, self.key_cache, self.value_cache, self.batch)

    def reference(self) -> torch.Tensor:
        b = self.batch
        return reference.paged_attention(
            self.query, self.key_cache, self.value_cache, b.cu_seqlens, b.context_lens, b.block_tables
        )


# The check every candidate passes first: a chunk after a cached prefix, a fresh prefill, a decode token.
VERIFICATION_PACK = [(24, 90), (17, 17), (1, 41)]


def tune_attention(
    target: TuneTarget,
    buckets: list[Bucket],
    mode: str,
    block_size: int,
    report: AutotuneReport,
    trial: Trial = no_trial,
) -> None:
    """Verify every candidate whose kernel has not failed (report.failures), then time the eligible ones per
    bucket. Each run of a candidate is a trial unit named by its kernel (candidate_kernel)."""
    device, rtol = target.device, OP_RTOL.get(target.dtype, OP_RTOL[torch.bfloat16])
    generator = torch.Generator().manual_seed(0)
    candidates = {
        name: impl
        for name, impl in attention_candidates(target).items()
        if candidate_kernel(name) not in report.failures
    }
    eligible = {}
    verify = _AttentionCase(target, VERIFICATION_PACK, block_size, generator)
    expected = verify.reference()
    for name, impl in candidates.items():
        try:
            with trial(candidate_kernel(name)):
                out = verify.run(impl)
            if within(out, expected, 2 * rtol):
                eligible[name] = impl
            else:
                report.rows.append(Row("paged_attention", "verify", name, None, "failed its check: the reference"))
        except Exception as error:  # a backend this build or device lacks
            report.rows.append(Row("paged_attention", "verify", name, None, _raised(error)))
    if "ours" not in eligible:  # the self-check judges it next; the library steers around failed kernels
        report.rows.append(Row("paged_attention", "verify", "ours", None, "kept: the self-check judges it"))
        eligible["ours"] = candidates.get("ours") or attention_candidates(target)["ours"]
    started = time.monotonic()
    choices = report.choices.setdefault("paged_attention", {})
    for bucket in buckets:
        if time.monotonic() - started > BUDGET_SECONDS[mode]:  # start-up stays bounded on a slow device
            choices[bucket.name] = "ours"
            why = f"chosen untimed: past the {mode} budget ({BUDGET_SECONDS[mode]:.0f} s)"
            report.rows.append(Row("paged_attention", bucket.name, "ours", None, why))
            continue
        case = _AttentionCase.of(target, bucket, block_size, generator)
        try:
            with trial(candidate_kernel("ours")):
                ours = case.run(eligible["ours"])
        except Exception as error:  # ours cannot run this bucket's shape: nothing to check the others against
            choices[bucket.name] = "ours"
            report.rows.append(Row("paged_attention", bucket.name, "ours", None, _raised(error)))
            continue
        timings: dict[str, float] = {}
        for name, impl in eligible.items():
            try:
                with trial(candidate_kernel(name)):
                    if name != "ours" and not within(case.run(impl), ours, 2 * rtol):
                        report.rows.append(Row("paged_attention", bucket.name, name, None, "failed its check: ours"))
                        continue
                    give_up = GIVE_UP_FACTOR * min(timings.values(), default=math.inf)
                    run = functools.partial(case.run, impl)
                    timings[name] = _median_ms(run, REPEATS[mode], device, name, give_up_ms=give_up)
            except Exception as error:
                report.rows.append(Row("paged_attention", bucket.name, name, None, _raised(error)))
        chosen = min(timings, key=timings.get)
        choices[bucket.name] = chosen
        for name, ms in timings.items():
            report.rows.append(Row("paged_attention", bucket.name, name, ms, "chosen" if name == chosen else "ok"))


# ---- the delta rule ------------------------------------------------------------------------------------
DELTA_RULE_KERNELS = ("serial", "chunked")


@dataclass(frozen=True)
class DeltaRuleBucket:
    name: str
    records: int
    tokens: int  # each record's


def delta_rule_buckets(config) -> list[DeltaRuleBucket]:
    """Prefill steps of the delta rule: one record of 64 tokens and of a whole prefill chunk, --max-num-seqs
    records sharing a chunk, and --max-num-seqs short chunks (16 tokens each: prefix-cache hits, chunk tails)."""
    chunk, many = max(1, config.prefill_chunk_size), max(1, config.max_num_seqs)
    shapes = [(1, min(64, chunk)), (1, chunk), (many, max(1, chunk // many)), (many, 16)]
    unique = {
        f"{tokens} x{records}": DeltaRuleBucket(f"{tokens} x{records}", records, tokens) for records, tokens in shapes
    }
    return list(unique.values())


def nearest_delta_rule_bucket(buckets: list[DeltaRuleBucket], q_lens: tuple[int, ...]) -> DeltaRuleBucket:
    records, tokens = max(1, len(q_lens)), max(1.0, sum(q_lens) / max(1, len(q_lens)))

    def distance(b: DeltaRuleBucket) -> tuple[float, float]:
        return (abs(math.log(b.records) - math.log(records)), abs(math.log(b.tokens) - math.log(tokens)))

    return min(buckets, key=distance)


class DeltaRulePolicy:
    """trunk.delta_rule_choice: the kernel chosen for the batch's nearest bucket; "auto" where none was, or where
    the chosen one has failed since (`failed`: the guarded library's, which steers "auto" around it)."""

    def __init__(self, buckets: list[DeltaRuleBucket], choices: dict[str, str], failed: dict[str, str] | None = None):
        self.buckets = [b for b in buckets if b.name in choices]
        self.choices = choices
        self.failed = failed if failed is not None else {}

    def __call__(self, batch: ChunkBatch) -> str:
        if not self.buckets or not batch.q_lens:
            return "auto"
        kernel = self.choices[nearest_delta_rule_bucket(self.buckets, batch.q_lens).name]
        return "auto" if f"gated_delta_rule_chunk:{kernel}" in self.failed else kernel


def _delta_rule_inputs(target: TuneTarget, records: int, tokens: int, generator) -> tuple:
    """A pack of `records` sequences of `tokens` each at the model's delta-net shapes, with initial states."""
    c, device, dtype = target.config, target.device, target.dtype
    n = records * tokens
    hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    mixed = torch.randn(n, 2 * hk * dk + hv * dv, generator=generator).to(device, dtype)
    q = mixed[:, : hk * dk].view(n, hk, dk)
    k = mixed[:, hk * dk : 2 * hk * dk].view(n, hk, dk)
    v = mixed[:, 2 * hk * dk :].view(n, hv, dv)
    g, beta = delta_rule_gates((tokens,) * records, hv, generator)  # the self-check's: every row carries weight
    g, beta = g.to(device), beta.to(device)
    states = (0.3 * torch.randn(records, hv, dk, dv, generator=generator)).to(device)
    cu = torch.arange(0, n + 1, tokens, dtype=torch.int32, device=device)
    slots = torch.arange(records, dtype=torch.int32, device=device)
    initial = torch.ones(records, dtype=torch.bool, device=device)
    return q, k, v, g, beta, states, cu, slots, initial


def tune_delta_rule(target: TuneTarget, config, mode: str, report: AutotuneReport, trial: Trial = no_trial) -> None:
    """On a GPU: each delta rule kernel the device has (the self-check's delta_rule_kernels: not failed, runnable
    at the model's shapes and dtype) is checked against the reference (the self-check's packs, at its
    tolerances), then the ones that pass are timed per bucket (delta_rule_buckets), each run a trial unit named
    by its kernel; a bucket runs the fastest. The CPU has one implementation: nothing to tune."""
    from clef_cuda.verification.selfcheck import SelfCheckCases

    op = "gated_delta_rule_chunk"
    check = SelfCheckCases(target.ops, target.config, target.dtype, target.device, 16, 0)
    failures = getattr(target.ops, "failed", {}) | report.failures
    # The kernels, not the chunked one's variants (the self-check proves each): "chunked" runs the rule's.
    kernels = {k.split(":")[0] for k in check.delta_rule_kernels()}
    candidates = [k for k in DELTA_RULE_KERNELS if k in kernels and f"{op}:{k}" not in failures]
    if len(candidates) < 2:  # nothing to choose between
        return
    eligible = []
    for kernel in candidates:
        try:
            with trial(f"{op}:{kernel}"):
                checks = check.gdr_chunk(kernel)
            if all(check.passed for check in checks):
                eligible.append(kernel)
            else:
                report.rows.append(Row(op, "verify", kernel, None, "failed its check: the reference"))
        except Exception as error:  # a kernel this device or dtype lacks (Pascal, bf16 before sm_80) says so
            report.rows.append(Row(op, "verify", kernel, None, _raised(error)))
    if not eligible:
        return
    generator = torch.Generator().manual_seed(4)
    rtol = OP_RTOL.get(target.dtype, OP_RTOL[torch.bfloat16])
    choices = report.choices.setdefault(op, {})
    started = time.monotonic()
    for bucket in delta_rule_buckets(config):
        if time.monotonic() - started > BUDGET_SECONDS[mode]:
            report.rows.append(Row(op, bucket.name, "auto", None, f"untimed: past the {mode} budget"))
            continue
        inputs = _delta_rule_inputs(target, bucket.records, bucket.tokens, generator)
        timings: dict[str, float] = {}
        first_out = None
        for kernel in eligible:
            # each kernel its own states (the rule is contractive: repeated runs stay bounded)
            args = (*inputs[:5], inputs[5].clone(), *inputs[6:])
            run = functools.partial(target.ops.gated_delta_rule_chunk, *args, kernel=kernel)
            try:
                with trial(f"{op}:{kernel}"):
                    out = run()
                    if first_out is not None and not within(out, first_out, 2 * rtol):
                        report.rows.append(Row(op, bucket.name, kernel, None, f"failed its check: {eligible[0]}"))
                        continue
                    first_out = out if first_out is None else first_out
                    timings[kernel] = _median_ms(run, REPEATS[mode], target.device, kernel)
            except Exception as error:
                report.rows.append(Row(op, bucket.name, kernel, None, _raised(error)))
        if not timings:
            continue
        chosen = min(timings, key=timings.get)
        choices[bucket.name] = chosen
        for kernel, ms in timings.items():
            report.rows.append(Row(op, bucket.name, kernel, ms, "chosen" if kernel == chosen else "ok"))


def int8_buckets(config) -> list[tuple[str, int]]:
    """(bucket, rows a step): a decode token, a short chunk, the fused kernel's most rows, a prefill step."""
    prefill = min(config.max_num_seqs * config.prefill_chunk_size, 4096)
    return [("rows 1", 1), ("rows 16", 16), (f"rows {INT8_FUSED_MAX_ROWS}", INT8_FUSED_MAX_ROWS), ("prefill", prefill)]


def int8_tuning_weight(trunk: Trunk) -> Int8Weight | None:
    """The trunk's largest int8 weight without a dense tail: what the int8 tune times (None: not quantized)."""
    weights = [w for layer in trunk.layers for w in trunk._linear_weights(layer) if isinstance(w, Int8Weight)]
    plain = [w for w in weights if w.dense_tail is None]
    return max(plain, key=lambda w: w.qweight.numel()) if plain else None


def random_int8_weight(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> Int8Weight:
    """An int8 weight of `shape` with random values and row scales: what a trial process, which has no weights,
    tunes at the model's shape."""
    generator = torch.Generator().manual_seed(2)
    qweight = torch.randint(-127, 128, shape, dtype=torch.int8, generator=generator).to(device)
    scale = (torch.rand(shape[0], generator=generator) * 1e-3 + 1e-4).to(device)
    return Int8Weight(qweight, scale, dtype)


def tune_int8_linear(
    target: TuneTarget, weight: Int8Weight, config, mode: str, report: AutotuneReport, trial: Trial = no_trial
) -> None:
    """With int8 weights: per step size (int8_buckets), the fused W8A16 kernel (ops.int8_linear: at most 64 rows),
    dequantize + GEMM, and on the CPU in fp32 and bf16 torch._weight_int8pack_mm, on `weight` (int8_tuning_weight, or a
    random one of its shape in a trial process); each checked against dequantize + GEMM first, each run a trial
    unit named by its kernel. The chosen ones become the trunk's int8_by_rows: where the fused kernel stops
    winning is measured on each device."""
    device, dtype, library = target.device, target.dtype, target.ops
    generator = torch.Generator().manual_seed(1)
    choices = report.choices.setdefault("int8_linear", {})
    where = "cuda" if device.type == "cuda" else "cpu"
    with trial(f"dequantize_int8:{where}"):
        dense = weight.dequantize(library)
    scratch = torch.empty_like(dense)
    fused_ok = f"int8_linear:{where}" not in report.failures
    kernels = {"dequantize+gemm": f"dequantize_int8:{where}", "fused": f"int8_linear:{where}"}
    for name, rows in int8_buckets(config):
        x = torch.randn(rows, weight.shape[1], generator=generator).to(device, dtype)
        expected = torch.nn.functional.linear(x, dense)
        candidates = {
            "dequantize+gemm": lambda x=x: torch.nn.functional.linear(
                x, library.dequantize_int8(weight.qweight, weight.scale, out=scratch)
            )
        }
        if rows <= INT8_FUSED_MAX_ROWS and fused_ok:
            candidates["fused"] = lambda x=x: library.int8_linear(x, weight.qweight, weight.scale)
        if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
            candidates["int8pack_mm"] = lambda x=x: torch._weight_int8pack_mm(x, weight.qweight, weight.scale)
        rtol = max(1e-4, 2 * OP_RTOL.get(dtype, OP_RTOL[torch.bfloat16]))
        timings = {}
        for candidate, fn in candidates.items():
            try:
                with trial(kernels.get(candidate, f"int8_linear:{candidate}")):
                    if not within(fn(), expected, rtol):
                        report.rows.append(Row("int8_linear", name, candidate, None, "failed its check"))
                        continue
                    timings[candidate] = _median_ms(fn, REPEATS[mode], device, candidate)
            except Exception as error:
                report.rows.append(Row("int8_linear", name, candidate, None, _raised(error)))
        chosen = min(timings, key=timings.get) if timings else "dequantize+gemm"
        choices[name] = chosen
        for candidate, ms in timings.items():
            report.rows.append(Row("int8_linear", name, candidate, ms, "chosen" if candidate == chosen else "ok"))


def int8_policy(choices: dict[str, str], config) -> list[tuple[int, str]]:
    """The trunk's int8_by_rows from the int8 buckets' choices: a step of n rows runs the choice of the first
    bucket with at least n rows (the last bucket's beyond it); the fused kernel never above its 64 rows."""
    policy = []
    for name, rows in int8_buckets(config):
        if name in choices:
            policy.append((rows, choices[name]))
    if not policy:
        return list(DEFAULT_INT8_BY_ROWS)
    limit, impl = policy[-1]
    policy[-1] = (sys.maxsize, "dequantize+gemm" if impl == "fused" else impl)
    return policy
