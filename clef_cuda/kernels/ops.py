"""Typed wrappers over the ``clef_cuda._C`` ops (``torch.ops.clef.*``).

The wrappers allocate outputs, bring convenience inputs to the kernels' contract (fp32 conv weights,
int32 metadata, a [C, 1, K] conv weight squeezed) and call the op; the C++ host entries check every
shape, dtype, device and layout and raise ValueError/TypeError/RuntimeError with an actionable message.
Each function has a pure-torch twin of the same name and signature in ``clef_cuda.kernels.reference``.

Conventions: tokens of several sequences are packed along dim 0 and delimited by ``cu_seqlens`` (int32
[B+1]); per-sequence caches live in slot pools indexed by ``state_indices`` (int32 [B], negative = no
slot: start from zeros, save nothing); ``has_initial_state`` (bool [B]) says whether a slot holds the
previous chunk's state. A batch must not give two sequences the same slot.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from clef_cuda.kernels import extension

_C = extension.load()  # registers torch.ops.clef; one line naming both torch versions if they differ

Tensor = torch.Tensor


def _int32(t: Tensor) -> Tensor:
    if not t.is_floating_point() and t.dtype not in (torch.int32, torch.bool):
        t = t.to(torch.int32)
    return t.contiguous()


def _bool(t: Tensor) -> Tensor:
    return (t.to(torch.bool) if t.dtype != torch.bool and not t.is_floating_point() else t).contiguous()


def _f32(t: Tensor | None) -> Tensor | None:
    if t is None:
        return None
    return t.to(torch.float32).contiguous() if t.dtype != torch.float32 else t.contiguous()


def _last_dim_contiguous(t: Tensor) -> Tensor:
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _conv_weight(weight: Tensor) -> Tensor:
    # Checkpoints store the depthwise conv as [C, 1, K]; the kernels take [C, K] fp32.
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight.squeeze(1)
    return _f32(weight)


class OpLibrary:
    """The wrappers, bound to one op namespace: ``clef`` (this package's extension) or, in tests only,
    ``clef_sim`` (the same CUDA kernels run on the CPU by the test-suite's simulator)."""

    def __init__(self, namespace: str = "clef") -> None:
        self._ops = getattr(torch.ops, namespace)

    # ---- causal conv1d ---------------------------------------------------------------------------
    def causal_conv1d_fwd(
        self,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        conv_states: Tensor,
        cu_seqlens: Tensor,
        state_indices: Tensor,
        has_initial_state: Tensor,
        *,
        silu: bool = True,
        out: Tensor | None = None,
    ) -> Tensor:
        """Causal depthwise conv1d (+ SiLU) over packed sequences, continuing from and updating their history.

        x [N, C] (token-major, last dim contiguous), weight [C, K] or [C, 1, K], bias [C] or None,
        conv_states [S, C, K-1] dtype of x (the last K-1 raw inputs per slot; read where has_initial_state,
        then overwritten), cu_seqlens [B+1], state_indices [B], has_initial_state [B] -> out [N, C].
        """
        x = _last_dim_contiguous(x)
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self._ops.causal_conv1d_fwd(
            x,
            _conv_weight(weight),
            _f32(bias),
            conv_states,
            _int32(cu_seqlens),
            _int32(state_indices),
            _bool(has_initial_state),
            silu,
            out,
        )
        return out

    def causal_conv1d_update(
        self,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        conv_states: Tensor,
        state_indices: Tensor,
        *,
        silu: bool = True,
        out: Tensor | None = None,
    ) -> Tensor:
        """Decode step: one new token per sequence. x [B, C] -> out [B, C]; conv_states updated in place."""
        x = _last_dim_contiguous(x)
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self._ops.causal_conv1d_update(
            x, _conv_weight(weight), _f32(bias), conv_states, _int32(state_indices), silu, out
        )
        return out

    # ---- gated delta rule ------------------------------------------------------------------------
    def gated_delta_rule_chunk(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        states: Tensor,
        cu_seqlens: Tensor,
        state_indices: Tensor,
        has_initial_state: Tensor,
        *,
        scale: float | None = None,
        use_qk_l2norm: bool = True,
        out: Tensor | None = None,
        kernel: str = "auto",
    ) -> Tensor:
        """Gated delta rule over packed sequences (prefill chunks), continuing from and updating fp32 states.

        q, k [N, Hk, Dk], v [N, Hv, Dv] (Hv a multiple of Hk; any token/head strides, last dim contiguous),
        g [N, Hv] log decay, beta [N, Hv], states [S, Hv, Dk, Dv] fp32, cu_seqlens [B+1], state_indices [B],
        has_initial_state [B]; scale defaults to Dk ** -0.5 -> out [N, Hv, Dv] (dtype of v).
        kernel: "auto" (the dispatch rule; see gated_delta_rule_dispatch), or on a GPU "chunked" (64-token
        chunks on tensor cores) or "serial" (token by token, fp32 SIMT) forced: the autotune, benchmarks, tests;
        "chunked:s32" and the like also force the chunked kernel's state-pass variant (gated_delta_rule_variant):
        the self-check proves each one a device may run.
        """
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        if out is None:
            out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        self._ops.gated_delta_rule_chunk(
            q,
            k,
            v,
            _f32(g),
            _f32(beta),
            states,
            _int32(cu_seqlens),
            _int32(state_indices),
            _bool(has_initial_state),
            float(q.shape[-1] ** -0.5 if scale is None else scale),
            use_qk_l2norm,
            out,
            kernel,
        )
        return out

    def gated_delta_rule_dispatch(self, q: Tensor, v: Tensor, cu_seqlens: Tensor, kernel: str = "auto") -> str:
        """Which kernel gated_delta_rule_chunk runs for a pack of these tensors: "chunked" (f16 from sm_70, bf16
        from sm_80, head dims 16..128, sequences of 32 tokens or more on average), "serial" or "cpu". A forced
        kernel that cannot run them raises ValueError saying why."""
        return self._ops.gated_delta_rule_dispatch(q, v, _int32(cu_seqlens), kernel)

    def gated_delta_rule_variant(self, q: Tensor, v: Tensor, cu_seqlens: Tensor, kernel: str = "auto") -> str:
        """gated_delta_rule_dispatch with the chunked kernel's state-pass variant named, as `kernel` forces it:
        "chunked:s64" (64 state columns a CTA, its tiles staged in shared memory), "chunked:d128" (128, read
        from the workspace), ...; the variant follows the device's residency (csrc/gated_delta_rule/
        gated_delta_rule.h gdr_state_variant), so a device runs different ones at different pack sizes."""
        return self._ops.gated_delta_rule_variant(q, v, _int32(cu_seqlens), kernel)

    def gated_delta_rule_recurrent(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        states: Tensor,
        state_indices: Tensor,
        *,
        scale: float | None = None,
        use_qk_l2norm: bool = True,
        out: Tensor | None = None,
    ) -> Tensor:
        """Decode step: one token per sequence. q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv] -> out [B, Hv, Dv]."""
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        if out is None:
            out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        self._ops.gated_delta_rule_recurrent(
            q,
            k,
            v,
            _f32(g),
            _f32(beta),
            states,
            _int32(state_indices),
            float(q.shape[-1] ** -0.5 if scale is None else scale),
            use_qk_l2norm,
            out,
        )
        return out

    # ---- paged KV cache --------------------------------------------------------------------------
    def reshape_and_cache(
        self, key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor
    ) -> None:
        """Write new tokens' keys/values into the paged caches.

        key, value [N, Hkv, D]; key_cache, value_cache [num_blocks, block_size, Hkv, D];
        slot_mapping [N]: block * block_size + offset of each token (negative: skip the token).
        """
        key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
        self._ops.reshape_and_cache(key, value, key_cache, value_cache, _int32(slot_mapping))

    def paged_attention(
        self,
        query: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        cu_seqlens_q: Tensor,
        context_lens: Tensor,
        block_tables: Tensor,
        *,
        scale: float | None = None,
        out: Tensor | None = None,
        kernel: str = "auto",
        max_query_len: int | None = None,
    ) -> Tensor:
        """Attention of packed new queries over each sequence's cached context (write it first).

        query [N, Hq, D] (Hq a multiple of Hkv), caches [num_blocks, block_size, Hkv, D],
        cu_seqlens_q [B+1], context_lens [B] (cached keys, new ones included), block_tables [B, max_blocks].
        Query i of a sequence with q_len queries attends keys [0, context_len - q_len + i]. -> out [N, Hq, D].
        kernel: "auto" (the dispatch rule; see paged_attention_dispatch), or "wmma" / "wmma2" / "simt" to
        force the tensor-core kernel (v1, or v2: warp pairs, register prefetch, a split-context pass for
        small grids) or the SIMT CUDA kernel (the start-up autotune, benchmarks, tests; CUDA tensors only).
        max_query_len: the most new queries of any one sequence (the host knows it; ChunkBatch.q_lens), from
        which a GPU launch sizes its grid; None: N, a safe bound that launches CTAs which exit at once. A
        value below a sequence's queries is a ValueError on CPU tensors and leaves rows unwritten on a GPU.
        """
        query = _last_dim_contiguous(query)
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        self._ops.paged_attention(
            query,
            key_cache,
            value_cache,
            _int32(cu_seqlens_q),
            _int32(context_lens),
            _int32(block_tables),
            float(query.shape[-1] ** -0.5 if scale is None else scale),
            out,
            kernel,
            0 if max_query_len is None else int(max_query_len),
        )
        return out

    def paged_attention_dispatch(
        self,
        query: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        cu_seqlens_q: Tensor,
        context_lens: Tensor,
        block_tables: Tensor,
        *,
        kernel: str = "auto",
    ) -> str:
        """Which kernel paged_attention runs for these arguments: "wmma" (tensor cores), "simt" or "cpu".

        On a GPU: "wmma" for f16 (sm_70+) or bf16 (sm_80+) caches, head dims 64/128/256, 16-byte aligned
        query rows and caches, when the pack averages at least 16 query rows (tokens x query heads per KV
        head) per sequence; "simt" otherwise (fp32, other head dims, decode packs). A forced kernel that
        cannot run the arguments raises ValueError saying why.
        """
        query = _last_dim_contiguous(query)
        return self._ops.paged_attention_dispatch(
            query,
            key_cache,
            value_cache,
            _int32(cu_seqlens_q),
            _int32(context_lens),
            _int32(block_tables),
            kernel,
        )

    def paged_attention_tiles(self, head_dim: int, compute_capability: int, smem_limit: int) -> str:
        """In words, the attention tiles a GPU of `compute_capability` (75 = sm_75) with `smem_limit` bytes of
        shared memory a block (cudaDevAttrMaxSharedMemoryPerBlockOptin) gets for `head_dim`: the launcher's
        own rule, e.g. "tensor cores: 16 keys a tile (55.0 KB); tensor cores v2: 16 keys a tile (61.25 KB); SIMT:
        16 keys a tile (49.3 KB)"."""
        return self._ops.paged_attention_tiles(head_dim, compute_capability, smem_limit)

    # ---- int8 weights ----------------------------------------------------------------------------
    def dequantize_int8(
        self, qweight: Tensor, scale: Tensor, *, dtype: torch.dtype | None = None, out: Tensor | None = None
    ) -> Tensor:
        """qweight [R, C] int8 (contiguous), scale [R] fp32 -> out [R, C] in `dtype` (or out's; default
        fp32): qweight[r, c] * scale[r], one fp32 multiply rounded once (bit-identical to the reference)."""
        if out is None:
            out = torch.empty(qweight.shape, dtype=dtype or torch.float32, device=qweight.device)
        self._ops.dequantize_int8(qweight.contiguous(), _f32(scale), out)
        return out

    def int8_linear(self, x: Tensor, qweight: Tensor, scale: Tensor, *, out: Tensor | None = None) -> Tensor:
        """The fused W8A16 GEMM for small steps: x [rows <= 64, in] (the serving dtype, last dim contiguous),
        qweight [out, in] int8, scale [out] fp32 -> out [rows, out] = (x @ qweight^T) * scale, in x's dtype:
        the int8 weights read once, no dequantized copy (dequantize_int8 + GEMM moves 5 bytes a weight)."""
        x = _last_dim_contiguous(x)
        if out is None:
            out = torch.empty(x.shape[0], qweight.shape[0], dtype=x.dtype, device=x.device)
        self._ops.int8_linear(x, qweight.contiguous(), _f32(scale), out)
        return out

    # ---- the trunk's glue, fused (csrc/glue/glue.h): fp32 math, each output rounded once ---------------
    def add_rms_norm(
        self,
        x: Tensor,
        delta: Tensor | None,
        scale: Tensor,
        eps: float,
        *,
        dtype: torch.dtype | None = None,
        out: Tensor | None = None,
    ) -> Tensor:
        """The residual add and the next RMSNorm in one pass. x [R, C] fp32 (contiguous: the residual
        stream, updated in place: x += delta), delta [R, C] in out's dtype or None, scale [C] fp32 (the
        effective gain) -> out [R, C] = x * rsqrt(mean(x^2) + eps) * scale, in `dtype` (default: delta's,
        else x's)."""
        if out is None:
            dtype = dtype or (delta.dtype if delta is not None else x.dtype)
            out = torch.empty(x.shape, dtype=dtype, device=x.device)
        delta = delta.contiguous() if delta is not None else None
        self._ops.add_rms_norm(x, delta, _f32(scale).contiguous(), eps, out)
        return out

    def silu_mul(self, gate_up: Tensor, *, out: Tensor | None = None) -> Tensor:
        """gate_up [R, 2 I] (gate | up, as the fused gate_up GEMM writes it) -> out [R, I] = silu(gate) * up."""
        gate_up = gate_up.contiguous()
        if out is None:
            out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype, device=gate_up.device)
        self._ops.silu_mul(gate_up, out)
        return out

    def gated_rms_norm(
        self, core: Tensor, z: Tensor, weight: Tensor, eps: float, *, out: Tensor | None = None
    ) -> Tensor:
        """The delta net's output norm and gate: core [N, H, D] (the delta rule's output), z [N, H * D] (its
        rows may be a strided slice of the in_proj output), weight [D] fp32 -> out [N, H * D] =
        rmsnorm(core per head) * weight * silu(z)."""
        core = core.contiguous()
        if out is None:
            out = torch.empty(core.shape[0], core.shape[1] * core.shape[2], dtype=core.dtype, device=core.device)
        self._ops.gated_rms_norm(core, _last_dim_contiguous(z), _f32(weight).contiguous(), eps, out)
        return out

    def rms_norm_rope(
        self, x: Tensor, scale: Tensor, cos: Tensor, sin: Tensor, eps: float, *, out: Tensor | None = None
    ) -> Tensor:
        """q or k norm + RoPE: x [N, H, D] (any token/head stride, last dim contiguous), scale [D] fp32, cos
        and sin [N, rotary_dim / 2] fp32 (per token: M-RoPE's axes are already folded in) -> out [N, H, D]
        contiguous = NeoX rotate-half of (rmsnorm(x per head) * scale) on the first rotary_dim dims."""
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self._ops.rms_norm_rope(
            _last_dim_contiguous(x), _f32(scale).contiguous(), _f32(cos).contiguous(), _f32(sin).contiguous(), eps, out
        )
        return out

    def sigmoid_gate(self, attn: Tensor, gate: Tensor, *, out: Tensor | None = None) -> Tensor:
        """The attention output's gate: attn [N, H, D], gate [N, H, D] (any token/head stride) -> out
        [N, H * D] = attn * sigmoid(gate)."""
        attn = attn.contiguous()
        if out is None:
            out = torch.empty(attn.shape[0], attn.shape[1] * attn.shape[2], dtype=attn.dtype, device=attn.device)
        self._ops.sigmoid_gate(attn, _last_dim_contiguous(gate), out)
        return out

    # ---- the CPU kernels' instruction set ------------------------------------------------------------
    def supported_cpu_isas(self) -> list[str]:
        """The CPU kernel variants this machine can run, best first: ["avx512", "avx2", "baseline"] on
        an AVX-512 x86-64, ["avx2", "baseline"] on an AVX2 one, ["baseline"] elsewhere."""
        return list(self._ops.supported_cpu_isas())

    def cpu_isa(self) -> str:
        """The variant the CPU kernels run now: the best supported unless set_cpu_isa or CLEF_CPU_ISA chose."""
        return self._ops.cpu_isa()

    def cpu_isa_calls(self) -> dict[str, int]:
        """Per variant, how many CPU kernel calls ran it since the library loaded (each op picks its variant
        once per call): which code really ran, not only what cpu_isa() says."""
        return dict(zip(("avx512", "avx2", "baseline"), self._ops.cpu_isa_calls(), strict=True))

    def set_cpu_isa(self, isa: str) -> str:
        """Run the CPU kernels' `isa` variant ("auto" = the best supported) from the next op on, for the
        whole process; returns the previous one. ValueError names an unknown or unsupported isa."""
        return self._ops.set_cpu_isa(isa)

    @contextlib.contextmanager
    def using_cpu_isa(self, isa: str) -> Iterator[None]:
        previous = self.set_cpu_isa(isa)
        try:
            yield
        finally:
            self.set_cpu_isa(previous)


# Every op that runs a kernel (the CUDA or the CPU one): what the fake kernels cover, and what the serving
# trunk's guarded library (clef_cuda.verification.guarded_ops) keeps from running once it failed on a device.
KERNEL_OPS = (
    "causal_conv1d_fwd",
    "causal_conv1d_update",
    "gated_delta_rule_chunk",
    "gated_delta_rule_recurrent",
    "reshape_and_cache",
    "paged_attention",
    "dequantize_int8",
    "int8_linear",
    "add_rms_norm",
    "silu_mul",
    "gated_rms_norm",
    "rms_norm_rope",
    "sigmoid_gate",
)


def _register_fake_kernels(namespace: str) -> None:
    """Fake (meta) kernels: every op only mutates arguments the caller allocated, so there is nothing to
    infer. torch.compile and torch.library.opcheck use them."""
    for name in KERNEL_OPS:
        torch.library.register_fake(f"{namespace}::{name}")(lambda *args, **kwargs: None)


_register_fake_kernels("clef")
_default = OpLibrary("clef")

causal_conv1d_fwd = _default.causal_conv1d_fwd
causal_conv1d_update = _default.causal_conv1d_update
gated_delta_rule_chunk = _default.gated_delta_rule_chunk
gated_delta_rule_dispatch = _default.gated_delta_rule_dispatch
gated_delta_rule_variant = _default.gated_delta_rule_variant
gated_delta_rule_recurrent = _default.gated_delta_rule_recurrent
reshape_and_cache = _default.reshape_and_cache
paged_attention = _default.paged_attention
paged_attention_dispatch = _default.paged_attention_dispatch
paged_attention_tiles = _default.paged_attention_tiles
dequantize_int8 = _default.dequantize_int8
int8_linear = _default.int8_linear
add_rms_norm = _default.add_rms_norm
silu_mul = _default.silu_mul
gated_rms_norm = _default.gated_rms_norm
rms_norm_rope = _default.rms_norm_rope
sigmoid_gate = _default.sigmoid_gate
supported_cpu_isas = _default.supported_cpu_isas
cpu_isa = _default.cpu_isa
cpu_isa_calls = _default.cpu_isa_calls
set_cpu_isa = _default.set_cpu_isa
using_cpu_isa = _default.using_cpu_isa

CPU_ISA_ENV = "CLEF_CPU_ISA"


def apply_cpu_isa_env() -> None:
    """CLEF_CPU_ISA=avx2 (or avx512, baseline, auto) pins the CPU kernels' variant for this process, e.g.
    to run the AVX2 code on an AVX-512 machine, and caps torch's GEMMs (oneDNN, MKL) at the same level where
    their own variables are not set (clef_cuda.kernels.cpu_features). ValueError, naming the variable, for a value
    this machine cannot run."""
    value = os.environ.get(CPU_ISA_ENV, "").strip().lower()
    if not value:
        return
    try:
        set_cpu_isa(value)
    except (ValueError, RuntimeError) as error:
        raise ValueError(f"{CPU_ISA_ENV}={value}: {error}") from None
    from clef_cuda.kernels.cpu_features import cap_library_gemms

    cap_library_gemms(value)


apply_cpu_isa_env()
