"""causal_conv1d_fwd / causal_conv1d_update: fast ops vs reference, reference vs transformers' fallbacks."""

from __future__ import annotations

import pytest
import torch
from conftest import TOLERANCE, qwen35_module, rel_err
from packing import cu_seqlens_of, nan_like, slot_plan, strided

from clef_cuda.kernels import reference

WIDTH = 4
PACKS = {
    # Lengths around the CUDA tile (64 tokens), a single token, and a sequence shorter than the window.
    "cpu": ([1, 63, 64, 65, 129, 1000, 2], [37, 200, 1000, 4099]),
    "cuda": ([1, 63, 64, 65, 129, 1000, 2], [37, 200, 1000, 4099]),
    "sim": ([1, 2, 64, 65, 7], [37, 130]),
}


def make_inputs(lengths, channels, dtype, device, num_slots=None):
    batch = len(lengths)
    num_slots = num_slots or batch + 2
    x = torch.randn(sum(lengths), channels, dtype=dtype, device=device)
    weight = torch.randn(channels, WIDTH, device=device) * 0.5
    bias = torch.randn(channels, device=device)
    conv_states = torch.randn(num_slots, channels, WIDTH - 1, dtype=dtype, device=device)
    slots = slot_plan(batch, num_slots, device, no_slot=(1,) if batch > 2 else ())
    has_initial = torch.tensor([b % 2 == 0 for b in range(batch)], device=device)
    return x, weight, bias, conv_states, cu_seqlens_of(lengths, device), slots, has_initial


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fwd_matches_reference(backend, dtype):
    lengths, channel_counts = PACKS[backend.kind]
    for channels in channel_counts:
        x, weight, bias, states, cu, slots, has_initial = make_inputs(lengths, channels, dtype, backend.device)
        x_view = strided(x)  # token stride != channels: the kernels must honour it
        expected_states = states.clone()
        used = set(slots.tolist())
        out = backend.ops.causal_conv1d_fwd(x_view, weight, bias, states, cu, slots, has_initial, out=nan_like(x))
        expected = reference.causal_conv1d_fwd(x, weight, bias, expected_states, cu, slots, has_initial)
        assert torch.isfinite(out).all(), "some output element was never written"
        assert rel_err(out, expected) < TOLERANCE[dtype], channels
        assert torch.equal(states, expected_states), "the saved history must be the exact raw inputs"
        for s in range(states.shape[0]):
            if s not in used:
                assert torch.equal(states[s], expected_states[s])


def test_fwd_without_bias_or_activation(backend):
    lengths, channel_counts = PACKS[backend.kind]
    x, weight, _, states, cu, slots, has_initial = make_inputs(
        lengths, channel_counts[0], torch.float32, backend.device
    )
    expected_states = states.clone()
    out = backend.ops.causal_conv1d_fwd(x, weight, None, states, cu, slots, has_initial, silu=False)
    expected = reference.causal_conv1d_fwd(x, weight, None, expected_states, cu, slots, has_initial, silu=False)
    assert rel_err(out, expected) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_update_matches_reference(backend, dtype):
    batch, channels = 5, 130
    x = torch.randn(batch, channels, dtype=dtype, device=backend.device)
    weight = torch.randn(channels, 1, WIDTH, device=backend.device)  # checkpoint layout, squeezed by ops
    states = torch.randn(batch + 3, channels, WIDTH - 1, dtype=dtype, device=backend.device)
    slots = slot_plan(batch, batch + 3, backend.device)
    expected_states = states.clone()
    out = backend.ops.causal_conv1d_update(x, weight, None, states, slots, out=nan_like(x))
    expected = reference.causal_conv1d_update(x, weight, None, expected_states, slots)
    assert rel_err(out, expected) < TOLERANCE[dtype]
    assert torch.equal(states, expected_states)


def test_chunked_prefill_then_decode_equals_one_pass(backend):
    """Prefill split at odd boundaries, then token-by-token decode == one conv over the whole sequence."""
    channels = 96
    total = 150 if backend.kind != "sim" else 80
    x = torch.randn(total, channels, device=backend.device)
    weight, bias = torch.randn(channels, WIDTH, device=backend.device), torch.randn(channels, device=backend.device)
    states = torch.zeros(3, channels, WIDTH - 1, device=backend.device)
    one = torch.tensor([0], dtype=torch.int32, device=backend.device)
    full = backend.ops.causal_conv1d_fwd(
        x,
        weight,
        bias,
        states.clone(),
        cu_seqlens_of([total], backend.device),
        one,
        torch.tensor([False], device=backend.device),
    )
    slot = torch.tensor([2], dtype=torch.int32, device=backend.device)
    pieces, start = [], 0
    for n in (1, 2, 66, 5):  # shorter than the window, then across a tile boundary
        first = start == 0
        pieces.append(
            backend.ops.causal_conv1d_fwd(
                x[start : start + n],
                weight,
                bias,
                states,
                cu_seqlens_of([n], backend.device),
                slot,
                torch.tensor([not first], device=backend.device),
            )
        )
        start += n
    while start < total:
        pieces.append(backend.ops.causal_conv1d_update(x[start : start + 1], weight, bias, states, slot))
        start += 1
    assert rel_err(torch.cat(pieces), full) < 1e-6


def test_reference_matches_transformers_fallbacks():
    """reference.causal_conv1d_fwd == transformers' causal_conv1d_fn (prefill) and causal_conv1d_update (decode)."""
    qwen = qwen35_module()
    channels, length = 200, 77
    x = torch.randn(length, channels)
    weight = torch.randn(channels, WIDTH)
    bias = torch.randn(channels)
    states = torch.zeros(1, channels, WIDTH - 1)
    ours = reference.causal_conv1d_fwd(
        x, weight, bias, states, cu_seqlens_of([length]), torch.tensor([0]), torch.tensor([False])
    )
    theirs = qwen.causal_conv1d_fn(x.t().unsqueeze(0), weight, bias, activation="silu")[0].t()
    assert rel_err(ours, theirs) < 1e-6
    # Decode: transformers keeps the window as [B, C, K] (the current token included) and shifts it.
    window = torch.zeros(1, channels, WIDTH)
    window[..., 1:] = states[0]
    for _ in range(3):
        token = torch.randn(1, channels)
        theirs = qwen.causal_conv1d_update(token.t().unsqueeze(0), window, weight, bias, activation="silu")[0, :, 0]
        ours = reference.causal_conv1d_update(token, weight, bias, states, torch.tensor([0]))[0]
        assert rel_err(ours, theirs) < 1e-6
        assert torch.allclose(window[0, :, 1:], states[0])


# ---- bad arguments ------------------------------------------------------------------------------
def _good_args(device="cpu"):
    x, weight, bias, states, cu, slots, has_initial = make_inputs([3, 4], 16, torch.float32, device)
    return dict(
        x=x,
        weight=weight,
        bias=bias,
        conv_states=states,
        cu_seqlens=cu,
        state_indices=slots,
        has_initial_state=has_initial,
    )


@pytest.mark.parametrize(
    "change, error, words",
    [
        (dict(x=torch.zeros(7, 16, dtype=torch.int32)), TypeError, "x must be float32"),
        (dict(x=torch.zeros(7, 16, 1)), ValueError, "x must be [num_tokens, channels]"),
        (dict(weight=torch.zeros(15, 4)), ValueError, "weight must have shape"),
        (dict(weight=torch.zeros(16, 9)), ValueError, "conv width must be in [2, 8]"),
        (dict(conv_states=torch.zeros(4, 16, 2)), ValueError, "conv_states must have shape"),
        (dict(conv_states=torch.zeros(4, 16, 3, dtype=torch.float16)), TypeError, "conv_states must be Float"),
        (dict(conv_states=torch.zeros(4, 3, 16).transpose(1, 2)), ValueError, "conv_states must be contiguous"),
        (dict(cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32)), ValueError, "must equal the number of tokens"),
        (dict(cu_seqlens=torch.tensor([0, 5, 3], dtype=torch.int32)), ValueError, "non-decreasing"),
        (dict(cu_seqlens=torch.tensor([0, 7], dtype=torch.int32)), ValueError, "cu_seqlens must have shape"),
        (dict(state_indices=torch.tensor([0, 9], dtype=torch.int32)), ValueError, "out of range"),
        (dict(state_indices=torch.tensor([1, 1], dtype=torch.int32)), ValueError, "share state slot 1"),
        (dict(has_initial_state=torch.tensor([True])), ValueError, "has_initial_state must have shape"),
    ],
)
def test_bad_arguments_raise_clear_errors(change, error, words):
    from clef_cuda.kernels import ops

    args = _good_args() | change
    with pytest.raises(error) as info:
        ops.causal_conv1d_fwd(**args)
    assert words in str(info.value)
    assert "causal_conv1d_fwd" in str(info.value)


def test_bad_out_and_mixed_devices():
    from clef_cuda.kernels import ops

    args = _good_args()
    with pytest.raises(TypeError, match="out must be Float"):
        ops.causal_conv1d_fwd(**args, out=torch.empty(7, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="out must have shape"):
        ops.causal_conv1d_fwd(**args, out=torch.empty(7, 15))
    if torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="is on cuda"):
            ops.causal_conv1d_fwd(**(args | dict(weight=args["weight"].cuda())))
