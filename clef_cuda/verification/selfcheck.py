"""The on-device self-check: before a server takes traffic, prove its kernels on the device it runs on.

Our CUDA kernels are verified without a GPU (CPU twins sharing their index math, a simulator, compilation
for every arch), so the first GPU of a kind to run them is a user's. The seed's incident (a conv that
zeroed the key channel band on V100s, answering well-formed, wrong decisions) is what happens when
nobody checks there. So, after the weights load and before /ready turns 200, every fast op the trunk
will call is run on the serving device and dtype, at the loaded model's shapes, next to
clef_cuda.kernels.reference on the same inputs:

- causal_conv1d_fwd, each channel band on its own (q, k, v: the key band by name) and the conv history it
  leaves; causal_conv1d_update;
- gated_delta_rule_chunk over a sequence longer than the reference's 64-token chunk, with initial states
  and Hv = r Hk as configured, and the states it leaves, on a GPU through each of its kernels the device runs
  (the token-serial one, and the chunked tensor-core one over 1, 2 and 3 chunks); gated_delta_rule_recurrent;
- reshape_and_cache, then paged_attention over a cached prefix plus a new chunk, a fresh prefill and a
  decode token, GQA at the model's head dim (on a GPU in f16, or bf16 from sm_80, at head dims 64/128/256
  this pack runs the tensor-core kernel), and a pack of decode tokens only (the SIMT kernel on a GPU);
- the fused glue between them (add_rms_norm, silu_mul, gated_rms_norm, rms_norm_rope, sigmoid_gate) at the
  model's widths, head dims and rotary dim, the q/k inputs as the strided views the trunk passes;
- with int8 weights (--quantize int8), dequantize_int8 on a real weight and on embedding rows (exact), and
  the fused small-step GEMM int8_linear on that weight;
- one real delta-net layer and one real attention layer of the loaded weights (their mixers, over two
  prefill steps so the second continues from the first's caches), through the ops vs the references;
  with int8 weights both sides dequantize them (ops vs reference) before the same GEMM.

Outputs and unused cache slots are NaN-poisoned: an element the op leaves unwritten, or a slot or block
outside the context that it reads, turns into NaN and fails the check. An op that raises fails its
check with the error. Cost: milliseconds of device work at clef-flash's shapes (the inputs are a few
hundred tokens); benchmarks/selfcheck_cost.py measures it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from clef_cuda.kernels import ops, reference
from clef_cuda.model.quantize import Int8Weight
from clef_cuda.model.trunk import ChunkBatch, SequenceChunk, Trunk, rms_norm
from clef_cuda.model.trunk_cache import TrunkCache
from clef_cuda.model.vocab_tables import VocabShard
from clef_cuda.verification.guarded_ops import as_kernel_fault

Tensor = torch.Tensor

# Tolerances. A check passes when max |fast - reference| <= rtol * max |reference| over the compared
# tensor (relative to its largest value, so a check means the same at any activation scale, and an
# output that comes back zero fails by 100%). Both sides compute the same function in fp32 and round the
# result to the serving dtype once, so in f16 and bf16 they differ by that rounding: an ulp of the
# largest value at most (f16 2^-10 = 9.8e-4, bf16 2^-7 = 7.8e-3); rtol allows 2 ulps, so a 1% error is
# caught in f16 and, in bf16 (whose own rounding is 0.8%), one of about 2%. In fp32 only the order of the
# sums differs (~1e-6 relative at these lengths); rtol allows 1e-5. The delta-rule states are fp32 in
# every serving dtype and leave 150 steps of the recurrence (the op) against the chunked form (the
# reference): STATE_RTOL. The chunked CUDA kernel's states are fp32 too but sum products of operands rounded
# once to the serving dtype (normalised keys, the decayed deltas): its states get the op's rtol. A layer check
# passes the op outputs through the layer's own roundings (norms, gates, the projections in the serving
# dtype): LAYER_FACTOR x the op's rtol. KV-cache writes are copies:
# exact.
OP_RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
STATE_RTOL = 1e-4
LAYER_FACTOR = 2.0

# Sequence lengths: one longer than the reference's 64-token delta-rule chunk, a single token (the
# smallest pack entry) and a short one; prefix, chunk and decode lengths for attention.
PACK_LENGTHS = (70, 1, 5)
# The delta rule's chunk op, every kernel and variant on one pack: 3 chunks (a tail), one token, 2 chunks (a tail).
CHUNKED_PACK_LENGTHS = (150, 1, 70)
ATTENTION_PREFIX, ATTENTION_CHUNK, ATTENTION_FRESH, ATTENTION_DECODE_CONTEXT = 300, 13, 20, 40
# The paged-attention kernels a GPU may run besides the dispatch rule's picks (the autotune chooses among them).
ATTENTION_KERNELS = ("simt", "wmma", "wmma2")
LAYER_STEPS = ((70, 5), (9, 1))  # two prefill steps of two sequences: the second continues the first
# The chunked delta rule's state-pass variant follows a pack's sequences (csrc/gated_delta_rule/gated_delta_rule.h
# gdr_state_variant): the self-check proves every variant the device picks for a pack of up to this many.
MAX_PACK_SEQUENCES = 256

# The delta rule's log gates, by (sequence, value head): real layers decay at -exp(A_log) softplus(a + dt_bias),
# from near 0 to a few units a token. Fast decays alone (-3 x rand) leave a 64-token chunk's later rows moved by
# their last few tokens only: a kernel that drops all but the first 16 rows of W, or the P tiles far from the
# diagonal, stays within tolerance there (5e-4 against 2e-3 in f16) and fails by 10-40% with slow ones. So each
# (sequence, head) gets one regime in turn: near 0 (the whole chunk and the state carried whole), slow, and fast;
# over CHUNKED_PACK_LENGTHS every head meets near 0 or slow in a sequence of more than one chunk. Betas mix 0-ish,
# 1-ish and uniform draws token by token.
DELTA_RULE_GATES = (1e-3, 0.05, 3.0)  # g = -scale x U(0, 1)


def delta_rule_gates(lengths: tuple[int, ...], heads: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """(g [N, heads], beta [N, heads]) fp32 on the CPU for a pack of `lengths`: sequence b's head h decays at
    DELTA_RULE_GATES[(b + h) % 3]; beta per token near 0, near 1 or uniform. The self-check's and the autotune's
    delta-rule cases (clef_cuda.tuning.autotune) draw from this."""
    n = sum(lengths)
    g = torch.empty(n, heads)
    start = 0
    for b, length in enumerate(lengths):
        for h in range(heads):
            scale = DELTA_RULE_GATES[(b + h) % len(DELTA_RULE_GATES)]
            g[start : start + length, h] = -scale * torch.rand(length, generator=generator)
        start += length
    kind = torch.randint(0, 3, (n, heads), generator=generator)
    u = torch.rand(n, heads, generator=generator)
    beta = torch.where(kind == 0, 0.02 * u, torch.where(kind == 1, 1.0 - 0.02 * u, u))
    return g, beta


@dataclass(frozen=True)
class Check:
    name: str
    max_abs_error: float  # inf when the op wrote NaN where the reference has a number, or raised
    tolerance: float
    error: str | None = None  # the exception, when the op raised

    @property
    def passed(self) -> bool:
        return self.error is None and self.max_abs_error <= self.tolerance  # NaN compares false: fails


@dataclass(frozen=True)
class SelfCheckReport:
    device: str
    dtype: str
    seconds: float
    checks: tuple[Check, ...]
    cpu_isa: str | None = None  # on the CPU: the kernel variant checked (clef_cuda.kernels.ops.cpu_isa)

    @property
    def where(self) -> str:
        return f"{self.device} {self.dtype}" + (f" ({self.cpu_isa} kernels)" if self.cpu_isa else "")

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def summary(self) -> str:
        """One line: 'passed (N checks)' or the failing checks with their errors."""
        if self.passed:
            return f"passed ({len(self.checks)} checks on {self.where}, {self.seconds:.2f} s)"
        return "FAILED on {}: {}".format(
            self.where,
            "; ".join(
                f"{c.name} ({c.error})"
                if c.error
                else f"{c.name} (max abs error {c.max_abs_error:.3g} > tolerance {c.tolerance:.3g})"
                for c in self.failures
            ),
        )

    def table(self) -> str:
        width = max(len(c.name) for c in self.checks)
        lines = [
            f"self-check on {self.where}: {'PASSED' if self.passed else 'FAILED'} ({self.seconds:.2f} s)",
            f"{'check':<{width}}  {'max abs error':>13}  {'tolerance':>9}  result",
        ]
        for c in self.checks:
            result = "ok" if c.passed else f"FAIL {c.error}" if c.error else "FAIL"
            lines.append(f"{c.name:<{width}}  {c.max_abs_error:>13.3e}  {c.tolerance:>9.2e}  {result}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """For /ready. JSON has no NaN or Infinity: a non-finite error is null (and the check failed)."""

        def number(x: float) -> float | None:
            return x if math.isfinite(x) else None

        checks = {}
        for c in self.checks:
            checks[c.name] = {"max_abs_error": number(c.max_abs_error), "tolerance": c.tolerance, "passed": c.passed}
            if c.error:
                checks[c.name]["error"] = c.error
        return {
            "passed": self.passed,
            "device": self.device,
            "dtype": self.dtype,
            "cpu_isa": self.cpu_isa,
            "seconds": round(self.seconds, 4),
            "checks": checks,
        }


def run_selfcheck(trunk: Trunk, *, block_size: int = 16, seed: int = 0, layers: bool = True) -> SelfCheckReport:
    """Every fast op `trunk` runs, and one real layer of each kind, against clef_cuda.kernels.reference on the
    trunk's device and dtype at its config's shapes. `block_size` is the serving KV block size. A tensor-parallel
    trunk's other ranks run theirs on their shards, their checks named "rank1.causal_conv1d_fwd.q", ...
    layers=False leaves the real layers out (scripts/gpu_sanitize_cases.py: their inputs come from cuBLAS)."""
    check = SelfCheckCases.of(trunk, block_size, seed)
    started = time.perf_counter()
    results: list[Check] = []
    with torch.inference_mode(), _exact_fp32():
        for name, group in check.groups():
            if layers or not name.startswith("layer"):
                results += check.guarded(name, group)
        if check.device.type == "cuda":
            torch.cuda.synchronize(check.device)
    if trunk.peers is not None:  # tensor parallel: every other rank checks its shard on its kernel decisions
        for rank, report in trunk.peers.selfcheck(trunk, block_size):
            results += [replace(c, name=f"rank{rank}.{c.name}") for c in report.checks]
    seconds = time.perf_counter() - started
    cpu_isa = None
    if check.device.type == "cpu":  # the CPU kernels come in variants (CLEF_CPU_ISA): say which one passed
        cpu_isa = ops.cpu_isa()
    dtype = str(trunk.dtype).removeprefix("torch.")
    return SelfCheckReport(str(check.device), dtype, seconds, tuple(results), cpu_isa)


@contextlib.contextmanager
def _exact_fp32() -> Iterator[None]:
    """The references must be fp32-exact: no TF32 in cuDNN convs or cuBLAS matmuls while they run (both
    are allowed by default for convs on Ampere and newer, which would make the arbiter the noisy side)."""
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def max_abs_error(actual: Tensor, expected: Tensor) -> float:
    """max |actual - expected|, where NaN on both sides (poison the op was meant to leave alone) counts as
    equal, and a NaN or infinity on one side only, or an infinity on both, is an infinite error."""
    actual, expected = actual.float(), expected.float()
    diff = (actual - expected).abs().masked_fill(torch.isnan(actual) & torch.isnan(expected), 0.0)
    if diff.numel() == 0:
        return 0.0
    worst = float(diff.max())
    return math.inf if math.isnan(worst) else worst


def reference_scale(expected: Tensor) -> float:
    """max |expected| over its numbers (poison left out): what a relative tolerance is relative to."""
    return float(expected.float().nan_to_num(0.0, posinf=0.0, neginf=0.0).abs().max()) if expected.numel() else 0.0


def within(actual: Tensor, expected: Tensor, rtol: float) -> bool:
    """The one closeness rule of the kernel checks (this self-check, the autotune's candidates, the GPU check's
    sanitizer cases): max_abs_error(actual, expected) <= rtol x reference_scale(expected)."""
    return max_abs_error(actual, expected) <= rtol * reference_scale(expected)


def op_trial_units(target, block_size: int, quantized: bool, seed: int = 0) -> list[tuple[str, Callable[[], list]]]:
    """The self-check's op checks one kernel at a time, named as failures name kernels ("rms_norm_rope:cuda"),
    on `target` (clef_cuda.tuning.autotune.TuneTarget: an op library, config, device, dtype; no weights):
    what a kernel trial process runs before the server does (clef_cuda.tuning.trials). paged_attention's
    kernels are the autotune's to try."""
    check = SelfCheckCases(target.ops, target.config, target.dtype, target.device, block_size, seed)
    where = "cuda" if target.device.type == "cuda" else "cpu"
    units = [
        ("causal_conv1d_fwd", check.conv_fwd),
        ("causal_conv1d_update", check.conv_update),
        ("gated_delta_rule_recurrent", check.gdr_recurrent),
        ("reshape_and_cache", lambda: [check.cache_write()[0]]),
        *check.glue_ops(),
    ]
    if quantized:
        units.append(("dequantize_int8", check.dequantize))
    # A chunked variant's trial is the chunked kernel's: one that fails steers the op off every variant.
    delta_rule = [
        (
            f"gated_delta_rule_chunk:{where if kernel == 'auto' else kernel.split(':')[0]}",
            functools.partial(check.gdr_chunk, kernel),
        )
        for kernel in check.delta_rule_kernels()
    ]
    return [(f"{op}:{where}", run) for op, run in units] + delta_rule


class SelfCheckCases:
    """The self-check's cases at a model's shapes and how each is judged: run_selfcheck runs them all; the autotune's
    correctness check (clef_cuda.tuning.tunes) and the kernel trials (clef_cuda.tuning.trials) run the same ones on
    their candidates, so what proves a kernel here is what proves it there."""

    def __init__(self, ops_, config, dtype, device, block_size: int, seed: int, trunk: Trunk | None = None) -> None:
        self.trunk, self.ops, self.config = trunk, ops_, config
        self.dtype, self.device, self.block_size = dtype, device, block_size
        self.rtol = OP_RTOL.get(self.dtype, OP_RTOL[torch.bfloat16])
        self.generator = torch.Generator().manual_seed(seed)
        self._delta_rule_case: dict | None = None

    @classmethod
    def of(cls, trunk: Trunk, block_size: int = 16, seed: int = 0) -> SelfCheckCases:
        """The checks of a loaded trunk: its op library, shapes, dtype and device, and its real layers."""
        return cls(trunk.ops, trunk.config, trunk.dtype, trunk.device, block_size, seed, trunk)

    # ---- helpers ---------------------------------------------------------------------------------
    def groups(self) -> list[tuple[str, Callable[[], list[Check]]]]:
        """(name, checks) for each op family and real layer; the name stands for the group if it raises."""
        c = self.config
        groups = [
            ("causal_conv1d_fwd", self.conv_fwd),
            ("causal_conv1d_update", self.conv_update),
            *(
                (self.gdr_chunk_name(kernel), functools.partial(self.gdr_chunk, kernel))
                for kernel in self.delta_rule_kernels()
            ),
            ("gated_delta_rule_recurrent", self.gdr_recurrent),
            ("paged_attention", self.paged_attention),
            ("glue", self.glue),
        ]
        if self.trunk.quantized:
            groups.append(("dequantize_int8", self.dequantize))
        failed = getattr(self.ops, "failed", {})  # a guarded library: what the kernel trials saw fail
        for kind, layers in (("delta_net", c.linear_layers), ("attention", c.attention_layers)):
            if layers:
                name = f"layer{layers[0]}.{kind}"
                crashed = failed.get(f"selfcheck:{kind}")
                if crashed is not None:  # it took its trial process down: it is not run here, and it fails
                    groups.append((name, functools.partial(self.untried, name, crashed)))
                else:
                    groups.append((name, functools.partial(self.layer_check, name, layers[0])))
        return groups

    def untried(self, name: str, why: str) -> list[Check]:
        return [Check(name, math.inf, 0.0, error=f"not run: in its kernel trial it {why}")]

    def guarded(self, name: str, group: Callable[[], list[Check]]) -> list[Check]:
        """Run one group of checks; an exception fails the group under its name, with the error."""
        try:
            return group()
        except Exception as error:  # a kernel that raises (no image for this arch, a bad launch) fails
            if as_kernel_fault(error, self.ops) is not None:  # ... but a lost CUDA context is the server's to handle
                raise
            return [Check(name, math.inf, 0.0, error=f"{type(error).__name__}: {error}".splitlines()[0][:300])]

    def randn(self, *shape: int, dtype: torch.dtype | None = None, scale: float = 1.0) -> Tensor:
        # Drawn on the CPU from a seeded generator: the same inputs on every device.
        t = torch.randn(*shape, generator=self.generator) * scale
        return t.to(device=self.device, dtype=dtype or self.dtype)

    def ints(self, values, dtype=torch.int32) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def cu_seqlens(self, lengths) -> Tensor:
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        return self.ints(cu)

    def compare(self, name: str, actual: Tensor, expected: Tensor, rtol: float) -> Check:
        return Check(name, max_abs_error(actual, expected), rtol * reference_scale(expected))

    def poisoned(self, t: Tensor, *slots: int) -> Tensor:
        t[list(slots)] = float("nan")
        return t

    # ---- causal conv1d -----------------------------------------------------------------------------
    def conv_fwd(self) -> list[Check]:
        c = self.config
        channels, width = c.conv_dim, c.linear_conv_kernel_dim
        n = sum(PACK_LENGTHS)
        # A strided view of a wider projection, as the trunk passes it.
        x = self.randn(n, channels + 64)[:, :channels]
        weight = self.randn(channels, width, dtype=torch.float32, scale=0.5)
        # Slots: 4 in the pool; sequence 1 starts fresh in slot 0 (its old contents must not be read),
        # slot 1 belongs to nobody (must stay untouched).
        states = self.poisoned(self.randn(4, channels, width - 1), 0, 1)
        expected_states = states.clone()
        cu, slots = self.cu_seqlens(PACK_LENGTHS), self.ints([2, 0, 3])
        initial = self.ints([True, False, True], torch.bool)
        out = torch.full(x.shape, float("nan"), dtype=self.dtype, device=self.device)
        self.ops.causal_conv1d_fwd(x, weight, None, states, cu, slots, initial, out=out)
        expected = reference.causal_conv1d_fwd(x, weight, None, expected_states, cu, slots, initial)
        bands = {"q": (0, c.key_dim), "k": (c.key_dim, 2 * c.key_dim), "v": (2 * c.key_dim, channels)}
        checks = [
            self.compare(f"causal_conv1d_fwd.{band}", out[:, lo:hi], expected[:, lo:hi], self.rtol)
            for band, (lo, hi) in bands.items()
        ]
        checks.append(self.compare("causal_conv1d_fwd.conv_states", states, expected_states, self.rtol))
        return checks

    def conv_update(self) -> list[Check]:
        c = self.config
        channels, width = c.conv_dim, c.linear_conv_kernel_dim
        x = self.randn(3, channels + 64)[:, :channels]
        weight = self.randn(channels, width, dtype=torch.float32, scale=0.5)
        states = self.poisoned(self.randn(4, channels, width - 1), 2)
        expected_states = states.clone()
        slots = self.ints([3, 1, 0])
        out = torch.full(x.shape, float("nan"), dtype=self.dtype, device=self.device)
        self.ops.causal_conv1d_update(x, weight, None, states, slots, out=out)
        expected = reference.causal_conv1d_update(x, weight, None, expected_states, slots)
        return [
            self.compare("causal_conv1d_update", out, expected, self.rtol),
            self.compare("causal_conv1d_update.conv_states", states, expected_states, self.rtol),
        ]

    # ---- gated delta rule ----------------------------------------------------------------------------
    def delta_rule_inputs(self, lengths: tuple[int, ...]) -> tuple[Tensor, ...]:
        """q, k, v, g, beta for a pack of `lengths` at the model's delta-net shapes, drawn so that every row, tile,
        chunk position, sequence and head of a kernel carries weight (delta_rule_gates)."""
        c = self.config
        hk, hv, dk, dv = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        )
        n = sum(lengths)
        mixed = self.randn(n, c.conv_dim)  # q | k | v bands of one conv output, viewed as the trunk does
        q = mixed[:, : c.key_dim].view(n, hk, dk)
        k = mixed[:, c.key_dim : 2 * c.key_dim].view(n, hk, dk)
        v = mixed[:, 2 * c.key_dim :].view(n, hv, dv)
        g, beta = delta_rule_gates(lengths, hv, self.generator)
        return q, k, v, g.to(self.device), beta.to(self.device)

    def gdr_states(self, *poisoned_slots: int) -> Tensor:
        c = self.config
        shape = (4, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        return self.poisoned(self.randn(*shape, dtype=torch.float32, scale=0.3), *poisoned_slots)

    def delta_rule_kernels(self) -> list[str]:
        """The chunk op's kernels to prove here: each CUDA kernel the op library runs for the model's shapes and
        dtype on this device that has not failed its trial: "serial", and the chunked kernel in each state-pass
        variant it picks for a pack of 1 to MAX_PACK_SEQUENCES sequences ("chunked:s64", "chunked:d128", ...:
        the variant follows the device's residency, so one card runs several; from sm_70 in f16, sm_80 in bf16);
        on the CPU, which has one implementation, "auto"."""
        c, failed = self.config, getattr(self.ops, "failed", {})
        q = torch.empty(64, c.linear_num_key_heads, c.linear_key_head_dim, dtype=self.dtype, device=self.device)
        v = torch.empty(64, c.linear_num_value_heads, c.linear_value_head_dim, dtype=self.dtype, device=self.device)
        cu = torch.zeros(MAX_PACK_SEQUENCES + 1, dtype=torch.int32, device=self.device)  # the rule never reads it
        kernels = []
        for kernel in ("serial", "chunked"):
            if f"gated_delta_rule_chunk:{kernel}" in failed:
                continue
            try:
                if kernel == "serial":
                    self.ops.gated_delta_rule_dispatch(q, v, cu[:2], kernel)
                    kernels.append(kernel)
                    continue
                for batch in range(1, MAX_PACK_SEQUENCES + 1):
                    variant = self.ops.gated_delta_rule_variant(q, v, cu[: batch + 1], kernel)
                    if variant not in kernels:
                        kernels.append(variant)
            except ValueError:  # the CPU, or a device or dtype without this kernel (Pascal, bf16 before sm_80)
                continue
        return kernels or ["auto"]

    @staticmethod
    def gdr_chunk_name(kernel: str) -> str:
        """'gated_delta_rule_chunk' for the serial kernel (or the CPU's), 'gated_delta_rule_chunk.chunked.s64'
        for a chunked variant."""
        if kernel in ("auto", "serial"):
            return "gated_delta_rule_chunk"
        return "gated_delta_rule_chunk." + kernel.replace(":", ".")

    def delta_rule_case(self) -> dict:
        """The chunk op's case, drawn once and shared by every kernel and variant checked (one reference run): a
        pack of CHUNKED_PACK_LENGTHS, slot 2 starting fresh (not read), slot 1 nobody's (not written)."""
        if self._delta_rule_case is None:
            lengths = CHUNKED_PACK_LENGTHS
            q, k, v, g, beta = self.delta_rule_inputs(lengths)
            states = self.gdr_states(1, 2)
            cu, slots = self.cu_seqlens(lengths), self.ints([3, 2, 0])
            initial = self.ints([True, False, True], torch.bool)
            args = (q, k, v, g, beta, states, cu, slots, initial)
            expected_states = states.clone()
            expected = reference.gated_delta_rule_chunk(q, k, v, g, beta, expected_states, cu, slots, initial)
            self._delta_rule_case = dict(args=args, expected=expected, expected_states=expected_states)
        return self._delta_rule_case

    def gdr_chunk(self, kernel: str = "auto") -> list[Check]:
        case = self.delta_rule_case()
        q, k, v, g, beta, states, cu, slots, initial = case["args"]
        states = states.clone()
        out = torch.full(v.shape, float("nan"), dtype=self.dtype, device=self.device)
        self.ops.gated_delta_rule_chunk(q, k, v, g, beta, states, cu, slots, initial, out=out, kernel=kernel)
        name = self.gdr_chunk_name(kernel)
        # The chunked kernel's states are fp32 too but sum products of operands rounded once to the serving dtype.
        state_rtol = self.rtol if kernel.startswith("chunked") else STATE_RTOL
        return [
            self.compare(name, out, case["expected"], self.rtol),
            self.compare(f"{name}.states", states, case["expected_states"], state_rtol),
        ]

    def gdr_recurrent(self) -> list[Check]:
        q, k, v, g, beta = self.delta_rule_inputs((1, 1, 1))
        states = self.gdr_states(2)
        expected_states = states.clone()
        slots = self.ints([1, 3, 0])
        out = torch.full(v.shape, float("nan"), dtype=self.dtype, device=self.device)
        self.ops.gated_delta_rule_recurrent(q, k, v, g, beta, states, slots, out=out)
        expected = reference.gated_delta_rule_recurrent(q, k, v, g, beta, expected_states, slots)
        return [
            self.compare("gated_delta_rule_recurrent", out, expected, self.rtol),
            self.compare("gated_delta_rule_recurrent.states", states, expected_states, STATE_RTOL),
        ]

    # ---- paged KV cache ----------------------------------------------------------------------------
    def cache_write(self) -> tuple[Check, dict]:
        """reshape_and_cache of every position of the three sequences of paged_attention's pack into a
        NaN pool with their blocks scattered (plus one token with slot -1, which must be skipped); exact.
        Also returns the caches and tables the attention checks read."""
        c, bs = self.config, self.block_size
        hkv, d = c.num_key_value_heads, c.head_dim
        contexts = (ATTENTION_PREFIX + ATTENTION_CHUNK, ATTENTION_FRESH, ATTENTION_DECODE_CONTEXT + 1)
        new_tokens = (ATTENTION_CHUNK, ATTENTION_FRESH, 1)
        needed = [-(-ctx // bs) for ctx in contexts]
        num_blocks = sum(needed) + 3  # spare blocks: never in a context
        order = torch.randperm(num_blocks, generator=self.generator).tolist()
        tables, cursor = [], 0
        for count in needed:
            tables.append(order[cursor : cursor + count])
            cursor += count
        spare = order[-1]
        width = max(needed)
        block_tables = self.ints([t + [spare] * (width - len(t)) for t in tables])

        # Every position of every sequence is written (the prefix as an earlier step would have), plus
        # one token with slot -1 that must be skipped.
        slot_mapping = [t[p // bs] * bs + p % bs for t, ctx in zip(tables, contexts, strict=True) for p in range(ctx)]
        slot_mapping.append(-1)
        keys, values = self.randn(len(slot_mapping), hkv, d), self.randn(len(slot_mapping), hkv, d)
        caches = [torch.full((num_blocks, bs, hkv, d), float("nan"), dtype=self.dtype, device=self.device)]
        caches = [caches[0], caches[0].clone(), caches[0].clone(), caches[0].clone()]
        key_cache, value_cache, expected_keys, expected_values = caches
        mapping = self.ints(slot_mapping)
        self.ops.reshape_and_cache(keys, values, key_cache, value_cache, mapping)
        reference.reshape_and_cache(keys, values, expected_keys, expected_values, mapping)
        written = max(
            max_abs_error(key_cache, expected_keys), max_abs_error(value_cache, expected_values)
        )  # copies: exact
        check = Check("reshape_and_cache", written, 0.0)
        return check, dict(
            key_cache=key_cache,
            value_cache=value_cache,
            expected_keys=expected_keys,
            expected_values=expected_values,
            block_tables=block_tables,
            contexts=contexts,
            new_tokens=new_tokens,
        )

    def attention_kernels(self, args: tuple) -> list[str]:
        """The paged-attention kernels to prove on this device for the mixed pack `args`: "auto" (the dispatch
        rule's picks, what a server without the autotune runs), then on a GPU each kernel the autotune may choose
        that can run them and has not failed its trial (the SIMT one; the tensor-core v1 and v2 from sm_70 in
        f16, sm_80 in bf16)."""
        if not hasattr(self.ops, "paged_attention_dispatch") or self.ops.paged_attention_dispatch(*args) == "cpu":
            return ["auto"]  # the CPU's one implementation (or the reference, a test's stand-in)
        failed = getattr(self.ops, "failed", {})
        kernels = ["auto"]
        for kernel in ATTENTION_KERNELS:
            if f"paged_attention:{kernel}" in failed:
                continue
            try:
                self.ops.paged_attention_dispatch(*args, kernel=kernel)
            except ValueError:  # the CPU, or a device or dtype without it (no tensor cores, bf16 before sm_80)
                continue
            kernels.append(kernel)
        return kernels

    def paged_attention(self) -> list[Check]:
        """Three sequences in one pack: a new chunk after a long cached prefix, a fresh prefill, one decode
        token; then the first and last again as a pack of one decode token each. Their blocks are scattered
        through a pool whose other blocks (and the unused tails of partly filled ones) are NaN: reading anything
        outside a context fails the check.

        On a GPU the pack runs through the dispatch rule ("auto"), as serving without the autotune does: it
        averages at least 16 query rows (tokens x query heads per KV head) per sequence at clef-flash's GQA 4, so
        in f16 (bf16 from sm_80) at head dims 64/128/256 the tensor-core kernel; the decode pack runs the SIMT
        kernel (ops.paged_attention_dispatch has the rule). Then through each kernel the autotune may choose,
        forced (attention_kernels), named "paged_attention.<kernel>.<case>": the 13-token chunk fills every warp's
        rows of a tensor-core tile at GQA 4 (v1's 4 warps, v2's 4 pairs), and the 300-token prefix makes v2 split
        its keys into parts and combine them on any device (few CTAs, a long context)."""
        written, cache = self.cache_write()
        checks = [written]
        key_cache, value_cache = cache["key_cache"], cache["value_cache"]
        expected_keys, expected_values = cache["expected_keys"], cache["expected_values"]
        block_tables, contexts, new_tokens = cache["block_tables"], cache["contexts"], cache["new_tokens"]
        hq, d = self.config.num_attention_heads, self.config.head_dim

        query = self.randn(sum(new_tokens), hq, d)
        cu, lengths = self.cu_seqlens(new_tokens), self.ints(list(contexts))
        args = (query, key_cache, value_cache, cu, lengths, block_tables)
        expected = reference.paged_attention(query, expected_keys, expected_values, cu, lengths, block_tables)
        for kernel in self.attention_kernels(args):
            out = torch.full(query.shape, float("nan"), dtype=self.dtype, device=self.device)
            self.ops.paged_attention(*args, out=out, max_query_len=max(new_tokens), kernel=kernel)
            prefix = "paged_attention." if kernel == "auto" else f"paged_attention.{kernel}."
            start = 0
            for case, count in zip(("prefix+chunk", "prefill", "decode"), new_tokens, strict=True):
                rows = slice(start, start + count)
                checks.append(self.compare(prefix + case, out[rows], expected[rows], self.rtol))
                start += count

        # The last position of sequences 0 and 2 as one-token sequences (their whole context is cached).
        decode_query = query[[ATTENTION_CHUNK - 1, sum(new_tokens) - 1]]
        decode_args = (self.cu_seqlens([1, 1]), lengths[[0, 2]], block_tables[[0, 2]])
        out = torch.full(decode_query.shape, float("nan"), dtype=self.dtype, device=self.device)
        self.ops.paged_attention(decode_query, key_cache, value_cache, *decode_args, out=out, max_query_len=1)
        expected = reference.paged_attention(decode_query, expected_keys, expected_values, *decode_args)
        checks.append(self.compare("paged_attention.decode_pack", out, expected, self.rtol))
        return checks

    # ---- the fused glue ------------------------------------------------------------------------------
    def glue(self) -> list[Check]:
        """Each glue op on a pack of PACK_LENGTHS tokens at the model's shapes, into NaN-poisoned outputs, next
        to its reference; add_rms_norm's residual update is compared too."""
        return [check for _, run in self.glue_ops() for check in run()]

    def glue_ops(self) -> list[tuple[str, Callable[[], list[Check]]]]:
        """(op, its checks) for each glue op, so a kernel trial can run them one at a time."""
        return [
            ("add_rms_norm", self.glue_add_rms_norm),
            ("silu_mul", self.glue_silu_mul),
            ("gated_rms_norm", self.glue_gated_rms_norm),
            ("rms_norm_rope", self.glue_rms_norm_rope),
            ("sigmoid_gate", self.glue_sigmoid_gate),
        ]

    def nan(self, *shape: int) -> Tensor:
        return torch.full(shape, float("nan"), dtype=self.dtype, device=self.device)

    def glue_add_rms_norm(self) -> list[Check]:
        c, n, eps = self.config, sum(PACK_LENGTHS), self.config.rms_norm_eps
        x = self.randn(n, c.hidden_size, dtype=torch.float32, scale=3.0)
        x_ref, delta, scale = x.clone(), self.randn(n, c.hidden_size), 1.0 + self.randn(c.hidden_size, scale=0.2)
        out = self.ops.add_rms_norm(x, delta, scale.float(), eps, out=self.nan(n, c.hidden_size))
        expected = reference.add_rms_norm(x_ref, delta, scale.float(), eps)
        return [
            self.compare("glue.add_rms_norm", out, expected, self.rtol),
            self.compare("glue.add_rms_norm.residual", x, x_ref, OP_RTOL[torch.float32]),
        ]

    def glue_silu_mul(self) -> list[Check]:
        c, n = self.config, sum(PACK_LENGTHS)
        gate_up = self.randn(n, 2 * c.intermediate_size, scale=3.0)
        out = self.ops.silu_mul(gate_up, out=self.nan(n, c.intermediate_size))
        return [self.compare("glue.silu_mul", out, reference.silu_mul(gate_up), self.rtol)]

    def glue_gated_rms_norm(self) -> list[Check]:
        c, n, eps = self.config, sum(PACK_LENGTHS), self.config.rms_norm_eps
        hv, dv = c.linear_num_value_heads, c.linear_value_head_dim
        core, z = self.randn(n, hv, dv), self.randn(n, hv * dv + 3)[:, 3:]  # z: a strided slice, as in_proj's
        weight = 1.0 + self.randn(dv, dtype=torch.float32, scale=0.2)
        out = self.ops.gated_rms_norm(core, z, weight, eps, out=self.nan(n, hv * dv))
        expected = reference.gated_rms_norm(core, z, weight, eps)
        return [self.compare("glue.gated_rms_norm", out, expected, self.rtol)]

    def query_gate(self) -> Tensor:
        """q and its gate interleaved per head [N, Hq, 2 D], as the fused qkv GEMM writes them."""
        c = self.config
        return self.randn(sum(PACK_LENGTHS), c.num_attention_heads, 2 * c.head_dim)

    def glue_rms_norm_rope(self) -> list[Check]:
        c, n, eps, d = self.config, sum(PACK_LENGTHS), self.config.rms_norm_eps, self.config.head_dim
        query_gate = self.query_gate()
        positions = torch.randint(0, 16384, (n, c.rotary_dim // 2), generator=self.generator).float()
        angles = positions * (1.0 / (c.rope_theta ** (torch.arange(c.rotary_dim // 2) * 2 / c.rotary_dim)))
        cos, sin = angles.cos().to(self.device), angles.sin().to(self.device)
        q_scale = 1.0 + self.randn(d, dtype=torch.float32, scale=0.2)
        out = self.ops.rms_norm_rope(
            query_gate[..., :d], q_scale, cos, sin, eps, out=self.nan(n, c.num_attention_heads, d)
        )
        expected = reference.rms_norm_rope(query_gate[..., :d], q_scale, cos, sin, eps)
        # In place too, as the op allows (out = x: each element read before it is written) for the k heads.
        keys = self.randn(n, c.num_key_value_heads, d)
        expected_keys = reference.rms_norm_rope(keys.clone(), q_scale, cos, sin, eps)
        self.ops.rms_norm_rope(keys, q_scale, cos, sin, eps, out=keys)
        return [
            self.compare("glue.rms_norm_rope", out, expected, self.rtol),
            self.compare("glue.rms_norm_rope.in_place", keys, expected_keys, self.rtol),
        ]

    def glue_sigmoid_gate(self) -> list[Check]:
        c, n, d = self.config, sum(PACK_LENGTHS), self.config.head_dim
        query_gate, attn = self.query_gate(), self.randn(n, c.num_attention_heads, d)
        out = self.ops.sigmoid_gate(attn, query_gate[..., d:], out=self.nan(n, c.num_attention_heads * d))
        expected = reference.sigmoid_gate(attn, query_gate[..., d:])
        return [self.compare("glue.sigmoid_gate", out, expected, self.rtol)]

    # ---- int8 weights ------------------------------------------------------------------------------
    def dequantize(self) -> list[Check]:
        """dequantize_int8 on a real int8 weight (the first layer's output projection, whole) and on rows
        of the int8 embedding table, into NaN-poisoned outputs; exact (one fp32 multiply, rounded once, on
        both sides). The layer checks below then run real int8 layers through the ops and the references."""
        if self.trunk is None:
            return self.dequantize_random()
        layer = self.trunk.layers[0]
        name, weight = (
            ("out_proj", layer.mixer.out_proj) if hasattr(layer.mixer, "out_proj") else ("o_proj", layer.mixer.o_proj)
        )
        checks = []
        if isinstance(weight, Int8Weight):
            out = torch.full(weight.qweight.shape, float("nan"), dtype=self.dtype, device=self.device)
            self.ops.dequantize_int8(weight.qweight, weight.scale, out=out)
            expected = reference.dequantize_int8(weight.qweight, weight.scale, dtype=self.dtype)
            checks.append(self.compare(f"dequantize_int8.layer0.{name}", out, expected, 0.0))
            checks.append(self.int8_linear(f"int8_linear.layer0.{name}", weight.qweight, weight.scale))
        embed = self.trunk.embed
        embed = embed.local if isinstance(embed, VocabShard) else embed  # a tensor-parallel rank's own rows
        if isinstance(embed, Int8Weight) and embed.shape[0] > 0:  # rank 0 may hold none (vocab_split)
            rows = torch.randint(0, embed.shape[0], (64,), generator=self.generator).to(self.device)
            checks.append(
                self.compare("dequantize_int8.embed_rows", embed.rows(rows, self.ops), embed.rows(rows, reference), 0.0)
            )
        return checks

    def dequantize_random(self) -> list[Check]:
        """dequantize_int8 at an out_proj's shape on random int8 values and scales (a kernel trial has no
        weights)."""
        c = self.config
        qweight = torch.randint(-127, 128, (c.hidden_size, c.value_dim), dtype=torch.int8, generator=self.generator)
        qweight, scale = qweight.to(self.device), self.randn(c.hidden_size, dtype=torch.float32).abs().add(1e-3)
        out = torch.full(qweight.shape, float("nan"), dtype=self.dtype, device=self.device)
        self.ops.dequantize_int8(qweight, scale, out=out)
        expected = reference.dequantize_int8(qweight, scale, dtype=self.dtype)
        return [
            self.compare("dequantize_int8.random", out, expected, 0.0),
            self.int8_linear("int8_linear.random", qweight, scale),
        ]

    def int8_linear(self, name: str, qweight: Tensor, scale: Tensor) -> Check:
        """The fused W8A16 GEMM on its most rows (64, a strided view) into a NaN-poisoned output: both sides
        sum the same fp32 products and round once (the op's rtol)."""
        x = self.randn(65, qweight.shape[1] + 8)[1:, 8:]
        out = torch.full((64, qweight.shape[0]), float("nan"), dtype=self.dtype, device=self.device)
        self.ops.int8_linear(x, qweight, scale, out=out)
        return self.compare(name, out, reference.int8_linear(x, qweight, scale), self.rtol)

    # ---- real layers ---------------------------------------------------------------------------------
    def layer_check(self, name: str, layer_index: int) -> list[Check]:
        """The layer's mixer on its loaded weights, two prefill steps, through the ops and the references;
        inputs are random hidden states normed by the layer's own input norm."""
        c, bs = self.config, self.block_size
        layer = self.trunk.layers[layer_index]
        twin = self.trunk.with_ops(reference)
        blocks_per_sequence = -(-sum(s[0] for s in LAYER_STEPS) // bs)
        caches = [
            TrunkCache.allocate(c, 2, 2 * blocks_per_sequence, bs, self.device, self.dtype, layers=(1, 1))
            for _ in range(2)
        ]
        blocks = [list(range(b * blocks_per_sequence, (b + 1) * blocks_per_sequence)) for b in range(2)]
        fast_out, ref_out, starts = [], [], [0, 0]
        for lengths in LAYER_STEPS:
            # Token ids are not used: the mixer takes hidden states.
            chunks = [SequenceChunk([0] * n, starts[b], b, blocks[b]) for b, n in enumerate(lengths)]
            batch = ChunkBatch.build(chunks, bs, self.device)
            hidden = self.randn(sum(lengths), c.hidden_size, dtype=torch.float32)
            h = rms_norm(hidden, layer.input_scale, c.rms_norm_eps).to(self.dtype)
            fast_out.append(self.trunk.mixer(layer_index, h, batch, caches[0], 0))
            ref_out.append(twin.mixer(layer_index, h, batch, caches[1], 0))
            starts = [s + n for s, n in zip(starts, lengths, strict=True)]
        return [self.compare(name, torch.cat(fast_out), torch.cat(ref_out), LAYER_FACTOR * self.rtol)]
