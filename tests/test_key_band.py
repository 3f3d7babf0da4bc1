"""The seed's failure, pinned: a conv that loses the key channel band must never pass.

candle-vllm's causal_conv1d_fwd zeroed channels [key_dim, 2*key_dim); k became 0, the delta-rule state
never moved, every linear-attention layer returned exactly 0 and the server answered well-formed, wrong
decisions. These tests check every band of the conv output against the reference for clef-flash's real
channel split and odd ones, check a whole Gated DeltaNet layer built from our ops against transformers'
Qwen3_5GatedDeltaNet, and prove both checks fail against a deliberately broken conv (a test-only wrapper
below, not a code path of the package).
"""

from __future__ import annotations

import pytest
import torch
from conftest import qwen35_module, rel_err
from packing import cu_seqlens_of

from clef_cuda.kernels import reference

# (key_dim, value_dim): clef-flash's 2048 | 2048 | 4096 = 8192, and odd splits that straddle thread blocks.
SPLITS = {
    "cpu": [(2048, 4096), (48, 96), (100, 37)],
    "cuda": [(2048, 4096), (48, 96), (100, 37)],
    "sim": [(2048, 4096), (100, 37)],
}


def key_band_zeroed(conv_fwd):
    """Test-only fault injection: the seed's bug, a conv whose key band comes out as zeros."""

    def broken(x, weight, bias, conv_states, cu_seqlens, state_indices, has_initial_state, *, key_dim, **kwargs):
        out = conv_fwd(x, weight, bias, conv_states, cu_seqlens, state_indices, has_initial_state, **kwargs)
        out[:, key_dim : 2 * key_dim] = 0
        return out

    return broken


def with_key_dim(conv_fwd):
    def call(*args, key_dim, **kwargs):
        return conv_fwd(*args, **kwargs)

    return call


def check_conv_bands(conv_fwd, key_dim: int, value_dim: int, device, lengths=(5, 70)) -> None:
    """Every band (q, k, v) of the conv output is non-zero and equals the reference. Raises AssertionError."""
    channels = 2 * key_dim + value_dim
    n = sum(lengths)
    x = torch.randn(n, channels, device=device)
    weight = torch.randn(channels, 4, device=device)
    states = torch.randn(len(lengths), channels, 3, device=device)
    expected_states = states.clone()
    cu = cu_seqlens_of(list(lengths), device)
    slots = torch.arange(len(lengths), dtype=torch.int32, device=device)
    has_initial = torch.ones(len(lengths), dtype=torch.bool, device=device)
    out = conv_fwd(x, weight, None, states, cu, slots, has_initial, key_dim=key_dim)
    expected = reference.causal_conv1d_fwd(x, weight, None, expected_states, cu, slots, has_initial)
    bands = {"q": (0, key_dim), "k": (key_dim, 2 * key_dim), "v": (2 * key_dim, channels)}
    for name, (lo, hi) in bands.items():
        band = out[:, lo:hi]
        assert band.abs().amax(dim=0).gt(0).all(), f"{name} band [{lo}, {hi}) has all-zero channels"
        assert rel_err(band, expected[:, lo:hi]) < 1e-5, f"{name} band [{lo}, {hi}) differs from the reference"


def test_every_conv_band_matches_reference(backend):
    for key_dim, value_dim in SPLITS[backend.kind]:
        check_conv_bands(with_key_dim(backend.ops.causal_conv1d_fwd), key_dim, value_dim, backend.device)


def test_band_check_catches_a_zeroed_key_band(backend):
    key_dim, value_dim = SPLITS[backend.kind][0]
    with pytest.raises(AssertionError, match="k band"):
        check_conv_bands(key_band_zeroed(backend.ops.causal_conv1d_fwd), key_dim, value_dim, backend.device)


# ---- a whole Gated DeltaNet layer ---------------------------------------------------------------
# A layer in f16 against transformers' in fp32: every op's output and the projections rounded to f16. Measured
# 1.6e-3 through either delta rule kernel (serial 1.59e-3, chunked 1.55e-3); W without its decay measures 2.3e-2.
F16_LAYER_TOLERANCE = 5e-3


def tiny_linear_attention_config(hk=2, hv=4, dk=32, dv=32, hidden=96):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=hk,
        linear_num_value_heads=hv,
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
        linear_conv_kernel_dim=4,
        vocab_size=64,
    )


def gdn_layer_from_ops(layer, hidden: torch.Tensor, cu_seqlens: torch.Tensor, conv_fwd, gdr_chunk) -> torch.Tensor:
    """Qwen3.5 Gated DeltaNet forward on packed tokens [N, hidden] built from our conv and delta-rule ops
    (fresh sequences: zero conv history and state). Runs on the device of `hidden` and `layer`."""
    key_dim, device = layer.key_dim, hidden.device
    n, batch = hidden.shape[0], cu_seqlens.numel() - 1
    cu_seqlens = cu_seqlens.to(device)
    slots = torch.arange(batch, dtype=torch.int32, device=device)
    fresh = torch.zeros(batch, dtype=torch.bool, device=device)
    mixed = layer.in_proj_qkv(hidden)
    conv_states = torch.zeros(batch, layer.conv_dim, layer.conv_kernel_size - 1, dtype=hidden.dtype, device=device)
    mixed = conv_fwd(mixed, layer.conv1d.weight, None, conv_states, cu_seqlens, slots, fresh, key_dim=key_dim)
    q = mixed[:, :key_dim].view(n, layer.num_k_heads, layer.head_k_dim)
    k = mixed[:, key_dim : 2 * key_dim].view(n, layer.num_k_heads, layer.head_k_dim)
    v = mixed[:, 2 * key_dim :].view(n, layer.num_v_heads, layer.head_v_dim)
    beta = layer.in_proj_b(hidden).sigmoid()
    g = -layer.A_log.float().exp() * torch.nn.functional.softplus(layer.in_proj_a(hidden).float() + layer.dt_bias)
    states = torch.zeros(batch, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, device=device)
    core = gdr_chunk(q, k, v, g, beta, states, cu_seqlens, slots, fresh)
    z = layer.in_proj_z(hidden).view(n, layer.num_v_heads, layer.head_v_dim)
    normed = layer.norm(core.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return layer.out_proj(normed.view(n, -1))


def check_gdn_layer(
    conv_fwd, gdr_chunk, lengths=(9, 70), device="cpu", dtype=torch.float32, tolerance=1e-4, **shape
) -> torch.Tensor:
    """Our layer (on `device`, in `dtype`) == transformers' Qwen3_5GatedDeltaNet (on the CPU, fp32) per sequence
    within `tolerance`, and non-zero."""
    import copy

    qwen = qwen35_module()
    config = tiny_linear_attention_config(**shape)
    layer = qwen.Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
        layer.A_log.copy_(torch.rand_like(layer.A_log))  # decays exp(-e^A softplus(.)) in a realistic range
        layer.norm.weight.copy_(1 + 0.1 * torch.randn_like(layer.norm.weight))
        hidden = torch.randn(sum(lengths), config.hidden_size)
        ours = gdn_layer_from_ops(
            copy.deepcopy(layer).to(device, dtype),
            hidden.to(device, dtype),
            cu_seqlens_of(list(lengths)),
            conv_fwd,
            gdr_chunk,
        ).cpu()
        start = 0
        for n in lengths:
            theirs = layer(hidden[start : start + n].unsqueeze(0))[0]
            assert theirs.abs().max() > 0
            assert ours[start : start + n].abs().max() > 0, "the layer returned exactly zero"
            err = rel_err(ours[start : start + n], theirs)
            assert err < tolerance, f"layer output differs from Qwen3_5GatedDeltaNet ({err:.2e})"
            start += n
    return ours


@pytest.mark.parametrize("shape", [dict(hk=2, hv=4, dk=32, dv=32), dict(hk=2, hv=2, dk=16, dv=16)])
def test_gdn_layer_from_ops_matches_transformers(backend, shape):
    lengths = (3, 10) if backend.kind == "sim" else (9, 70)
    ops = backend.ops
    check_gdn_layer(with_key_dim(ops.causal_conv1d_fwd), ops.gated_delta_rule_chunk, lengths, backend.device, **shape)


@pytest.mark.parametrize("zeroed", [False, True])
def test_the_key_band_through_the_chunked_kernel(sim_ops, zeroed):
    """The layer through the tensor-core delta rule (forced, the simulator running it) in f16 == transformers'
    layer in fp32 within the f16 layer bound; with the seed's zeroed key band the layer is exactly zero, and
    caught, through this path too."""
    import functools

    conv = key_band_zeroed(sim_ops.causal_conv1d_fwd) if zeroed else with_key_dim(sim_ops.causal_conv1d_fwd)
    chunked = functools.partial(sim_ops.gated_delta_rule_chunk, kernel="chunked")
    check = functools.partial(check_gdn_layer, conv, chunked, (70, 9), "cpu", torch.float16, F16_LAYER_TOLERANCE)
    if zeroed:
        with pytest.raises(AssertionError, match="exactly zero"):
            check()
    else:
        check()


def test_layer_check_catches_a_zeroed_key_band():
    from clef_cuda.kernels import ops

    with pytest.raises(AssertionError, match="exactly zero"):
        check_gdn_layer(key_band_zeroed(ops.causal_conv1d_fwd), ops.gated_delta_rule_chunk)


def test_zeroed_key_band_makes_the_layer_return_exactly_zero():
    """Why the seed's bug was silent: k = 0 leaves the state at zero, so the layer adds nothing."""
    from clef_cuda.kernels import ops

    qwen = qwen35_module()
    layer = qwen.Qwen3_5GatedDeltaNet(tiny_linear_attention_config(), layer_idx=0).eval()
    with torch.no_grad():
        out = gdn_layer_from_ops(
            layer,
            torch.randn(20, 96),
            cu_seqlens_of([20]),
            key_band_zeroed(ops.causal_conv1d_fwd),
            ops.gated_delta_rule_chunk,
        )
    assert torch.count_nonzero(out) == 0
