"""clef-tiny for training: the Qwen3.5 hybrid trunk and the joint schema head as one differentiable
module, built on the pure-torch references (clef_cuda.kernels.reference) and the serving head's own code, with
parameters named exactly as the release layout stores them.

Serving runs the same function through the fast kernels (clef_cuda.model.trunk); tests check the two agree.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from clef_cuda.kernels import reference
from clef_cuda.model.config import LINEAR_ATTENTION, HeadConfig, TrunkConfig
from clef_cuda.model.head import JointSchemaHead, RecordLayout
from clef_cuda.model.trunk import rms_norm, rotate_half
from clef_cuda.model.weights import head_shapes, trunk_shapes


def _init(name: str, shape: tuple[int, ...], generator: torch.Generator, head: bool) -> torch.Tensor:
    if name.endswith("A_log"):
        return torch.rand(shape, generator=generator).mul(15.0).add(1.0).log()
    if name.endswith("dt_bias"):
        # Mamba's init: softplus(dt_bias) log-uniform in [1e-3, 1e-1], so the decays exp(-A softplus(.))
        # span memories of a few to thousands of tokens from the start (dt_bias = 1 forgets within a token).
        dt = torch.exp(torch.rand(shape, generator=generator) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        return dt + torch.log(-torch.expm1(-dt))
    if name.endswith("linear_attn.norm.weight"):
        return torch.ones(shape)
    if "norm" in name:  # zero-centred RMSNorm gains in the trunk; LayerNorm gains in the head
        return torch.ones(shape) if head and name.endswith(".weight") else torch.zeros(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if name == "residual_gate":
        return torch.tensor(0.0)
    if name == "joint_logit_scale":
        return torch.tensor(1.0)
    if name == "prior_logit_scale":  # exp(2.3) = 10: random cosines are ~0.1, so the prior starts as a signal
        return torch.tensor(2.3)
    if name == "embed_tokens.weight":
        return torch.randn(shape, generator=generator)  # token identity dominates the residual stream at first
    fan_in = shape[-1] if len(shape) > 1 else 1
    std = 1.0 / math.sqrt(fan_in)
    if name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")) and not head:
        std /= 4.0  # residual branches start small, as GPT-2 scales them, so they do not drown the tokens
    return torch.randn(shape, generator=generator) * std


class TrainableClef(torch.nn.Module):
    def __init__(self, trunk: TrunkConfig, head: HeadConfig, seed: int) -> None:
        super().__init__()
        self.trunk_config, self.head_config = trunk, head
        generator = torch.Generator().manual_seed(seed)
        # ParameterDict keys cannot hold dots: store with "/" and translate at the boundary.
        self.trunk = torch.nn.ParameterDict(
            {
                k.replace(".", "/"): torch.nn.Parameter(_init(k, s, generator, False))
                for k, s in trunk_shapes(trunk).items()
            }
        )
        self.head = torch.nn.ParameterDict(
            {
                k.replace(".", "/"): torch.nn.Parameter(_init(k, s, generator, True))
                for k, s in head_shapes(head).items()
            }
        )
        half = trunk.rotary_dim // 2
        self.register_buffer(
            "inv_freq",
            1.0 / (trunk.rope_theta ** (torch.arange(0, half, dtype=torch.float32) * 2 / trunk.rotary_dim)),
            persistent=False,
        )

    @torch.no_grad()
    def silence_tokens(self, token_ids: list[int]) -> None:
        """Zero the embeddings of the given tokens (training/train.py: tokens training never shows)."""
        self._w("embed_tokens.weight")[token_ids] = 0.0

    @torch.no_grad()
    def silence_lexicon(self, token_ids: list[int]) -> None:
        """Zero the LM-head rows of the given tokens. The head reads LM-head rows only as the lexical mean
        of each option span (the prior and W_ol), so rows of the JSON scaffolding every option shares
        ({"option_id":" ... "}) only blur options together: with them at zero an option's lexical
        vector is its own words from the first step, and the prior is a clean cosine between the
        record's summary and the option's words instead of a near-constant."""
        self._w("lm_head.weight")[token_ids] = 0.0

    def named_release_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        trunk = {k.replace("/", "."): p.detach() for k, p in self.trunk.items()}
        head = {k.replace("/", "."): p.detach() for k, p in self.head.items()}
        return trunk, head

    def _w(self, name: str) -> torch.Tensor:
        return self.trunk[name.replace(".", "/")]

    # ---- trunk: a right-padded batch of records through the references ------------------------------
    def hidden_states(self, ids: torch.Tensor, lengths: list[int], zero_key_band: bool = False) -> torch.Tensor:
        """Final-normed hidden states [B, L, hidden] of right-padded records ids [B, L] (each from a fresh
        state). Right padding is harmless: every layer is causal, so real tokens never see the padding.

        The delta rule is the reference's chunked form with the batch folded into its head axis (records
        are independent); the conv is the reference's depthwise F.conv1d with zero history.
        `zero_key_band` reproduces the seed's bug (tests only)."""
        c = self.trunk_config
        batch, length = ids.shape
        positions = torch.arange(length)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]
        x = self._w("embed_tokens.weight")[ids]  # [B, L, H]
        for i, kind in enumerate(c.layer_types):
            p = f"layers.{i}."
            h = _rms(x, self._w(p + "input_layernorm.weight"), c.rms_norm_eps)
            if kind == LINEAR_ATTENTION:
                x = x + self._delta_net(p, h, zero_key_band)
            else:
                x = x + self._attention(p, h, cos, sin)
            h = _rms(x, self._w(p + "post_attention_layernorm.weight"), c.rms_norm_eps)
            up = F.silu(F.linear(h, self._w(p + "mlp.gate_proj.weight"))) * F.linear(
                h, self._w(p + "mlp.up_proj.weight")
            )
            x = x + F.linear(up, self._w(p + "mlp.down_proj.weight"))
        return _rms(x, self._w("norm.weight"), c.rms_norm_eps)

    def _delta_net(self, p: str, h: torch.Tensor, zero_key_band: bool) -> torch.Tensor:
        c = self.trunk_config
        batch, length, _ = h.shape
        mixed = F.linear(h, self._w(p + "linear_attn.in_proj_qkv.weight"))  # [B, L, conv_dim]
        weight = self._w(p + "linear_attn.conv1d.weight")  # [conv_dim, 1, K]
        padded = F.pad(mixed.transpose(1, 2), (c.linear_conv_kernel_dim - 1, 0))
        conv = F.silu(F.conv1d(padded, weight, groups=c.conv_dim)).transpose(1, 2)  # [B, L, conv_dim]
        if zero_key_band:
            conv = torch.cat(
                [
                    conv[..., : c.key_dim],
                    torch.zeros_like(conv[..., c.key_dim : 2 * c.key_dim]),
                    conv[..., 2 * c.key_dim :],
                ],
                dim=-1,
            )
        hk, hv, dk, dv = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        )
        q = conv[..., : c.key_dim].reshape(batch * length, hk, dk)
        k = conv[..., c.key_dim : 2 * c.key_dim].reshape(batch * length, hk, dk)
        v = conv[..., 2 * c.key_dim :].reshape(batch, length, hv, dv)
        beta = torch.sigmoid(F.linear(h, self._w(p + "linear_attn.in_proj_b.weight")))  # [B, L, Hv]
        a = F.linear(h, self._w(p + "linear_attn.in_proj_a.weight"))
        g = -self._w(p + "linear_attn.A_log").exp() * F.softplus(a + self._w(p + "linear_attn.dt_bias"))
        qh, kh = reference._prepare_qk(q, k, hv, dk**-0.5, True)  # [B L, Hv, Dk], normalised, q scaled

        def fold(t: torch.Tensor) -> torch.Tensor:  # [B, L, Hv, ...] -> [L, B Hv, ...]: records become heads
            return t.transpose(0, 1).reshape(length, batch * hv, *t.shape[3:])

        qh, kh = qh.view(batch, length, hv, dk), kh.view(batch, length, hv, dk)
        state = h.new_zeros(batch * hv, dk, dv)
        core, _ = reference._delta_rule_chunked(fold(qh), fold(kh), fold(v), fold(g), fold(beta), state)
        core = core.reshape(length, batch, hv, dv).transpose(0, 1)  # [B, L, Hv, Dv]
        z = F.linear(h, self._w(p + "linear_attn.in_proj_z.weight")).view_as(core)
        gated = rms_norm(core, self._w(p + "linear_attn.norm.weight"), c.rms_norm_eps) * F.silu(z)
        return F.linear(gated.reshape(batch, length, c.value_dim), self._w(p + "linear_attn.out_proj.weight"))

    def _attention(self, p: str, h: torch.Tensor, cos, sin) -> torch.Tensor:
        c = self.trunk_config
        batch, length, _ = h.shape
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qg = F.linear(h, self._w(p + "self_attn.q_proj.weight")).view(batch, length, hq, 2 * d)
        q = _rms(qg[..., :d], self._w(p + "self_attn.q_norm.weight"), c.rms_norm_eps)
        q = rotate_half(q, cos, sin, c.rotary_dim)
        k = F.linear(h, self._w(p + "self_attn.k_proj.weight")).view(batch, length, hkv, d)
        k = rotate_half(_rms(k, self._w(p + "self_attn.k_norm.weight"), c.rms_norm_eps), cos, sin, c.rotary_dim)
        v = F.linear(h, self._w(p + "self_attn.v_proj.weight")).view(batch, length, hkv, d)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        ).transpose(1, 2)
        gated = out * torch.sigmoid(qg[..., d:])
        return F.linear(gated.reshape(batch, length, hq * d), self._w(p + "self_attn.o_proj.weight"))

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits [..., vocab] from final-normed hidden states [..., hidden] (the LM head the
        release ships; the joint head reads its rows as the options' lexical vectors)."""
        return F.linear(hidden, self._w("lm_head.weight"))

    # ---- head ----------------------------------------------------------------------------------------
    def logits(self, hidden: torch.Tensor, layout: RecordLayout) -> torch.Tensor:
        """Option logits [O] of one record from its hidden states [L, hidden] (the serving head's code)."""
        weights = {k.replace("/", "."): p for k, p in self.head.items()}
        head = JointSchemaHead(self.head_config, weights, self._w("lm_head.weight"))
        inputs = head.start(layout, hidden.shape[0])
        head.consume(inputs, layout, hidden)
        return head.logits(inputs, layout)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(x, 1.0 + weight, eps)  # Qwen's zero-centred gains
