"""gated_delta_rule_chunk / _recurrent: fast ops vs reference; reference vs transformers and FLA's naive.py."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    TOLERANCE,
    Backend,
    _make_backend,
    cuda_available,
    load_fla_naive,
    qwen35_module,
    rel_err,
    simulated,
    simulated_cards,
)
from packing import cu_seqlens_of, nan_like, slot_plan

from clef_cuda.kernels import reference
from clef_cuda.verification.selfcheck import MAX_PACK_SEQUENCES

# (lengths, [(Hk, Hv, Dk, Dv), ...]) per backend; the CUDA kernels take Dk == Dv in {16, 32, 64, 128}.
# (key heads, value heads, dk, dv): clef-flash's 2 value heads a key head, clef 27B's 3 (16 / 48 x 128).
CASES = {
    "cpu": (
        [1, 63, 64, 65, 129, 1000],
        [(2, 2, 32, 32), (2, 4, 64, 64), (1, 2, 128, 128), (2, 4, 24, 40), (2, 6, 128, 128)],
    ),
    "cuda": (
        [1, 63, 64, 65, 129, 1000],
        [(2, 2, 32, 32), (2, 4, 64, 64), (1, 2, 128, 128), (2, 4, 16, 16), (4, 12, 128, 128)],
    ),
    "sim": ([1, 9, 3], [(1, 2, 16, 16), (1, 1, 128, 128), (1, 3, 16, 16)]),
}


def make_inputs(lengths, hk, hv, dk, dv, dtype, device, num_slots=None):
    n, batch = sum(lengths), len(lengths)
    num_slots = num_slots or batch + 2
    # q, k, v as views of one token-major buffer, like the conv output's q | k | v bands.
    mixed = torch.randn(n, 2 * hk * dk + hv * dv, dtype=dtype, device=device)
    q = mixed[:, : hk * dk].view(n, hk, dk)
    k = mixed[:, hk * dk : 2 * hk * dk].view(n, hk, dk)
    v = mixed[:, 2 * hk * dk :].view(n, hv, dv)
    g = -torch.rand(n, hv, device=device) * 2.0  # log decay <= 0
    beta = torch.rand(n, hv, device=device)
    states = torch.randn(num_slots, hv, dk, dv, device=device) * 0.3
    slots = slot_plan(batch, num_slots, device, no_slot=(1,) if batch > 2 else ())
    has_initial = torch.tensor([b % 2 == 0 for b in range(batch)], device=device)
    return q, k, v, g, beta, states, cu_seqlens_of(lengths, device), slots, has_initial


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_chunk_matches_reference(backend, dtype):
    lengths, shapes = CASES[backend.kind]
    for hk, hv, dk, dv in shapes:
        q, k, v, g, beta, states, cu, slots, has_initial = make_inputs(lengths, hk, hv, dk, dv, dtype, backend.device)
        expected_states = states.clone()
        used = set(slots.tolist())
        out = backend.ops.gated_delta_rule_chunk(
            q, k, v, g, beta, states, cu, slots, has_initial, out=nan_like(v.contiguous())
        )
        expected = reference.gated_delta_rule_chunk(q, k, v, g, beta, expected_states, cu, slots, has_initial)
        assert torch.isfinite(out).all(), "some output element was never written"
        # The fast ops scan token by token, the reference in 64-token WY chunks: agreement to fp32 rounding.
        assert rel_err(out, expected) < TOLERANCE[dtype], (hk, hv, dk, dv)
        assert rel_err(states, expected_states) < 1e-5, (hk, hv, dk, dv)
        for s in range(states.shape[0]):
            if s not in used:
                assert torch.equal(states[s], expected_states[s]), "an unused slot was touched"


def test_chunk_without_l2norm_and_custom_scale(backend):
    lengths, shapes = CASES[backend.kind]
    hk, hv, dk, dv = shapes[0]
    q, k, v, g, beta, states, cu, slots, has_initial = make_inputs(
        lengths, hk, hv, dk, dv, torch.float32, backend.device
    )
    k = torch.nn.functional.normalize(k.float(), dim=-1)  # the rule needs |k| <= 1 to stay bounded
    expected_states = states.clone()
    kwargs = dict(scale=0.3, use_qk_l2norm=False)
    out = backend.ops.gated_delta_rule_chunk(q, k, v, g, beta, states, cu, slots, has_initial, **kwargs)
    expected = reference.gated_delta_rule_chunk(q, k, v, g, beta, expected_states, cu, slots, has_initial, **kwargs)
    assert rel_err(out, expected) < 1e-5
    assert rel_err(states, expected_states) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_recurrent_matches_reference(backend, dtype):
    _, shapes = CASES[backend.kind]
    hk, hv, dk, dv = shapes[0]
    batch = 5
    q, k, v, g, beta, states, _, _, _ = make_inputs([1] * batch, hk, hv, dk, dv, dtype, backend.device)
    slots = slot_plan(batch, states.shape[0], backend.device, no_slot=(3,))
    expected_states = states.clone()
    out = backend.ops.gated_delta_rule_recurrent(q, k, v, g, beta, states, slots, out=nan_like(v.contiguous()))
    expected = reference.gated_delta_rule_recurrent(q, k, v, g, beta, expected_states, slots)
    assert rel_err(out, expected) < TOLERANCE[dtype]
    assert rel_err(states, expected_states) < 1e-5


def test_chunked_prefill_then_decode_equals_one_long_recurrence(backend):
    """Prefill chunks at odd boundaries, then recurrent decode == the reference recurrence over all tokens."""
    _, shapes = CASES[backend.kind]
    hk, hv, dk, dv = shapes[0]
    total = 150 if backend.kind != "sim" else 24
    q, k, v, g, beta, _, _, _, _ = make_inputs([total], hk, hv, dk, dv, torch.float32, backend.device)
    states = torch.zeros(2, hv, dk, dv, device=backend.device)
    slot = torch.tensor([1], dtype=torch.int32, device=backend.device)
    pieces, start = [], 0
    for n in (1, 70, 9) if backend.kind != "sim" else (1, 9, 3):
        cu = cu_seqlens_of([n], backend.device)
        initial = torch.tensor([start > 0], device=backend.device)
        sl = slice(start, start + n)
        pieces.append(
            backend.ops.gated_delta_rule_chunk(q[sl], k[sl], v[sl], g[sl], beta[sl], states, cu, slot, initial)
        )
        start += n
    while start < total:
        sl = slice(start, start + 1)
        pieces.append(backend.ops.gated_delta_rule_recurrent(q[sl], k[sl], v[sl], g[sl], beta[sl], states, slot))
        start += 1
    ref_states = torch.zeros(1, hv, dk, dv)
    expected = torch.cat(
        [
            reference.gated_delta_rule_recurrent(
                q[t : t + 1].cpu(),
                k[t : t + 1].cpu(),
                v[t : t + 1].cpu(),
                g[t : t + 1].cpu(),
                beta[t : t + 1].cpu(),
                ref_states,
                torch.tensor([0]),
            )
            for t in range(total)
        ]
    )
    assert rel_err(torch.cat(pieces), expected) < 1e-5
    assert rel_err(states[1], ref_states[0]) < 1e-5


# ---- the reference against the upstream oracles -------------------------------------------------
@pytest.mark.parametrize("length", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("hk, hv", [(2, 2), (2, 4)])
def test_reference_matches_transformers(length, hk, hv):
    qwen = qwen35_module()
    dk = dv = 32
    q, k, v, g, beta, states, _, _, _ = make_inputs([length], hk, hv, dk, dv, torch.float32, "cpu", num_slots=1)
    initial = states[0].clone()
    cu, slot, has_initial = cu_seqlens_of([length]), torch.tensor([0]), torch.tensor([True])
    ours = reference.gated_delta_rule_chunk(q, k, v, g, beta, states, cu, slot, has_initial)
    batched = [t.unsqueeze(0) for t in (q, k, v, g, beta)]
    for oracle in (qwen.torch_chunk_gated_delta_rule, qwen.torch_recurrent_gated_delta_rule):
        theirs, final = oracle(
            *batched[:3],
            g=batched[3],
            beta=batched[4],
            initial_state=initial.unsqueeze(0).clone(),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        assert rel_err(ours, theirs[0]) < 1e-5, oracle.__name__
        assert rel_err(states[0], final[0]) < 1e-5, oracle.__name__


@pytest.mark.parametrize("length", [1, 64, 130])
def test_reference_matches_fla_naive(length):
    naive = load_fla_naive()
    h, dk, dv = 3, 32, 48
    q = torch.randn(length, h, dk)
    k = torch.nn.functional.normalize(torch.randn(length, h, dk), dim=-1)
    v = torch.randn(length, h, dv)
    g, beta = -torch.rand(length, h) * 2, torch.rand(length, h)
    initial = torch.randn(h, dk, dv) * 0.3
    states = initial.clone().unsqueeze(0)
    cu, slot, has_initial = cu_seqlens_of([length]), torch.tensor([0]), torch.tensor([True])
    ours = reference.gated_delta_rule_chunk(q, k, v, g, beta, states, cu, slot, has_initial, use_qk_l2norm=False)
    batched = [t.unsqueeze(0) for t in (q, k, v)]
    rec, rec_state = naive.naive_recurrent_gated_delta_rule(
        *batched, beta=beta[None], g=g[None], initial_state=initial[None].clone(), output_final_state=True
    )
    chk, chk_state = naive.naive_chunk_gated_delta_rule(
        *batched, g=g[None], beta=beta[None], initial_state=initial[None].clone(), output_final_state=True
    )
    for theirs, final in ((rec, rec_state), (chk, chk_state)):
        assert rel_err(ours, theirs[0]) < 1e-5
        assert rel_err(states[0], final[0]) < 1e-5


def test_reference_chunk_equals_reference_recurrence():
    hk, hv, dk, dv, length = 2, 4, 16, 24, 140
    q, k, v, g, beta, states, _, _, _ = make_inputs([length], hk, hv, dk, dv, torch.float32, "cpu", num_slots=1)
    rec_states = states.clone()
    chunk = reference.gated_delta_rule_chunk(
        q, k, v, g, beta, states, cu_seqlens_of([length]), torch.tensor([0]), torch.tensor([True])
    )
    rec = torch.cat(
        [
            reference.gated_delta_rule_recurrent(
                q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], rec_states, torch.tensor([0])
            )
            for t in range(length)
        ]
    )
    assert rel_err(chunk, rec) < 1e-5
    assert rel_err(states, rec_states) < 1e-5


# ---- bad arguments ------------------------------------------------------------------------------
def _good_args():
    q, k, v, g, beta, states, cu, slots, has_initial = make_inputs([3, 4], 2, 4, 16, 16, torch.float32, "cpu")
    return dict(
        q=q, k=k, v=v, g=g, beta=beta, states=states, cu_seqlens=cu, state_indices=slots, has_initial_state=has_initial
    )


@pytest.mark.parametrize(
    "change, error, words",
    [
        (dict(q=torch.zeros(7, 2, 16, dtype=torch.float64)), TypeError, "q must be float32, float16 or bfloat16"),
        (dict(k=torch.zeros(7, 2, 8)), ValueError, "k must have shape"),
        (dict(v=torch.zeros(7, 3, 16)), ValueError, "must be a multiple of num_k_heads"),
        (dict(v=torch.zeros(7, 4, 16, dtype=torch.float16)), TypeError, "v must be Float"),
        (dict(g=torch.zeros(7, 3)), ValueError, "g must have shape"),
        (dict(states=torch.zeros(4, 4, 16, 16, dtype=torch.float16)), TypeError, "states must be Float"),
        (dict(states=torch.zeros(4, 4, 8, 16)), ValueError, "states must have shape"),
        (dict(state_indices=torch.tensor([2, 2], dtype=torch.int32)), ValueError, "share state slot 2"),
        (dict(cu_seqlens=torch.tensor([1, 3, 7], dtype=torch.int32)), ValueError, "cu_seqlens[0] must be 0"),
    ],
)
def test_bad_arguments_raise_clear_errors(change, error, words):
    from clef_cuda.kernels import ops

    with pytest.raises(error) as info:
        ops.gated_delta_rule_chunk(**(_good_args() | change))
    assert words in str(info.value)
    assert "gated_delta_rule_chunk" in str(info.value)


def test_cuda_launcher_rejects_uncompiled_head_dims(sim_ops):
    """The CUDA kernels are compiled for Dk == Dv in {16, 32, 64, 128}; others fail with a message (run here
    through the simulator, which executes the real launcher; on a GPU the host entry rejects them earlier)."""
    args = _good_args()
    args.update(q=torch.zeros(7, 2, 24), k=torch.zeros(7, 2, 24), states=torch.zeros(4, 4, 24, 16))
    with pytest.raises(RuntimeError, match="need head_k_dim == head_v_dim"):
        sim_ops.gated_delta_rule_chunk(**args)


# ---- the chunked kernel: 64-token chunks on tensor cores (the simulator, and a GPU where there is one) ----
# Its roundings (gated_delta_rule_chunked.cuh: normalised q and k, the system's inverse, W, U, the state scaled
# for the products, v_new, P, each rounded once to the activation dtype) put it a few units of that dtype's
# roundoff from the fp32 reference, outputs and states alike: TOLERANCE[dtype] (f16 2e-3, bf16 1.6e-2), where
# it measures 5e-4 and 4e-3.
CHUNKED_BACKENDS = ["sim"] + (["cuda"] if cuda_available() else [])
CHUNKED_CASES = {
    # (lengths in one pack: 1..3 chunks, odd tails), [(Hk, Hv, D), ...]
    "sim": ([1, 63, 64, 65, 129], [(2, 4, 16), (1, 1, 32)]),
    "cuda": ([1, 63, 64, 65, 129, 192, 1000], [(1, 2, 16), (2, 4, 32), (2, 4, 64), (16, 32, 128), (16, 48, 128)]),
}


@pytest.fixture(params=CHUNKED_BACKENDS)
def tc_backend(request):
    yield from _make_backend(request, request.param)


def chunked_errors(backend, lengths, hk, hv, d, dtype, kernel="chunked", **make):
    """(output's, states') relative errors of the op against the reference on the same inputs, having
    checked that every output element was written and no unused slot touched."""
    q, k, v, g, beta, states, cu, slots, has_initial = make_inputs(lengths, hk, hv, d, d, dtype, backend.device)
    for name, value in make.items():  # the caller's gates, betas or scaled inputs
        target = {"g": g, "beta": beta, "q": q, "k": k}[name]
        target.copy_(value(target))
    expected_states = states.clone()
    out = backend.ops.gated_delta_rule_chunk(
        q, k, v, g, beta, states, cu, slots, has_initial, out=nan_like(v.contiguous()), kernel=kernel
    )
    expected = reference.gated_delta_rule_chunk(q, k, v, g, beta, expected_states, cu, slots, has_initial)
    assert torch.isfinite(out).all(), "some output element was never written"
    for s in set(range(states.shape[0])) - set(slots.tolist()):
        assert torch.equal(states[s], expected_states[s]), "an unused slot was touched"
    return rel_err(out, expected), rel_err(states, expected_states)


def check_chunked(backend, lengths, hk, hv, d, dtype, **make):
    out_err, state_err = chunked_errors(backend, lengths, hk, hv, d, dtype, **make)
    assert out_err < TOLERANCE[dtype] and state_err < TOLERANCE[dtype], (hk, hv, d, out_err, state_err)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_chunked_matches_reference(tc_backend, dtype):
    """1, 2 and 3 chunks with odd tails, several sequences in one pack, states read, not read and not kept
    (a sequence without a slot), Hv = 2 Hk."""
    lengths, shapes = CHUNKED_CASES[tc_backend.kind]
    for hk, hv, d in shapes:
        check_chunked(tc_backend, lengths, hk, hv, d, dtype)


# ---- the state pass's variants: which each card runs, and each against the references -----------------------
# (compute capability, Hv) -> the state-pass variant the rule picks for a pack of 1, 2, 4 and 16 sequences at head
# dim 128 on the arch's card in csrc/common/arch_limits.h (its SMs and per-SM limits): clef-flash's 32 value
# heads and clef 27B's 48. "s64": 64 state columns a CTA, the chunk's tiles staged in shared memory; "d128": 128,
# read from the workspace. At B = 1 each card's choice runs in one wave where some variant can (the T4 with 27B's
# 48 heads cannot: 48 CTAs of its 40 SMs' one each); benchmarks/delta_rule_occupancy.py prints the waves.
VARIANTS = {
    (70, 32): ("s64", "d64", "d64", "d64"),
    (70, 48): ("d64", "d64", "d64", "d64"),
    (75, 32): ("d128", "d128", "d128", "d128"),
    (75, 48): ("d128", "d128", "d128", "d128"),
    (80, 32): ("s32", "s64", "d128", "d128"),
    (80, 48): ("s32", "s64", "d128", "d128"),
    (86, 32): ("s64", "d64", "d64", "d64"),
    (86, 48): ("d64", "d64", "d64", "d64"),
    (89, 32): ("d64", "d64", "d64", "d64"),
    (89, 48): ("d64", "d64", "d64", "d64"),
    (90, 32): ("s16", "s32", "s64", "d128"),
    (90, 48): ("s32", "s64", "d128", "d128"),
    (100, 32): ("s16", "s32", "s64", "d128"),
    (100, 48): ("s32", "s64", "d128", "d128"),
    (120, 32): ("s32", "s64", "d64", "d64"),
    (120, 48): ("s64", "d64", "d64", "d64"),
}
VARIANT_BATCHES = (1, 2, 4, 16)


def state_variant(sim_ops, cc: int, sms: int, hv: int, batch: int) -> str:
    q = torch.zeros(64 * batch, 16, 128, dtype=torch.float16)
    v = torch.zeros(64 * batch, hv, 128, dtype=torch.float16)
    with simulated(compute_capability=cc, multiprocessors=sms):
        return sim_ops.gated_delta_rule_variant(q, v, cu_seqlens_of([64] * batch), "chunked").removeprefix("chunked:")


def check_state_variants(backend, dtype, variants=None, naive=None) -> None:
    """Each state-pass variant compiled for head dim 128 (or `variants`), forced, on the simulated device's arch:
    a pack of 1, 2 and 3 chunks (tails) with initial states, the self-check's gates (every row of a chunk carries
    weight) against the fp32 reference, outputs and states; and with `naive` (FLA's oracle) a 150-token sequence
    against its chunked and recurrent forms too."""
    from clef_cuda.verification.selfcheck import delta_rule_gates

    generator = torch.Generator().manual_seed(5)
    for variant in variants or ("s16", "s32", "s64", "d64", "d128"):
        kernel = f"chunked:{variant}"
        try:
            backend.ops.gated_delta_rule_dispatch(*_dispatch_args(dtype), kernel)
        except ValueError:
            assert variants is None, f"{variant} cannot run here"  # a listed variant must run
            continue  # this device's shared memory does not hold it (s64 on a T4)
        lengths = [65, 1, 130]
        g, beta = delta_rule_gates(tuple(lengths), 2, generator)
        out_err, state_err = chunked_errors(
            backend, lengths, 1, 2, 128, dtype, kernel=kernel, g=lambda _, g=g: g, beta=lambda _, b=beta: b
        )
        assert out_err < TOLERANCE[dtype] and state_err < TOLERANCE[dtype], (variant, out_err, state_err)
        if naive is not None:
            check_against_fla_naive(backend, naive, 150, 2, 128, kernel)


def _dispatch_args(dtype):
    return torch.zeros(64, 1, 128, dtype=dtype), torch.zeros(64, 2, 128, dtype=dtype), cu_seqlens_of([64])


def test_each_card_runs_the_variant_its_residency_picks_and_each_matches_the_references(sim_ops):
    """The (arch, heads, sequences) -> variant table above, from each card's SMs and per-SM limits; then each
    variant a card picks, forced on that card's simulated device (its shared memory, cp.async from sm_80 or
    registers before), against the fp32 reference and FLA's naive oracles, in f16 and (from sm_80) bf16."""
    cards = simulated_cards()
    naive = load_fla_naive()
    for (cc, hv), expected in VARIANTS.items():
        card, sms = cards[cc]
        picked = tuple(state_variant(sim_ops, cc, sms, hv, b) for b in VARIANT_BATCHES)
        assert picked == expected, (card, hv, picked)
        # The self-check proves each variant a pack of up to MAX_PACK_SEQUENCES picks: every one of those is run
        # below (the rule reads the pack's count, not its offsets: the self-check asks it the same way).
        tested = {v for (c, _), vs in VARIANTS.items() if c == cc for v in vs}
        q, v = torch.empty(64, 16, 128, dtype=torch.float16), torch.empty(64, hv, 128, dtype=torch.float16)
        cu = torch.zeros(MAX_PACK_SEQUENCES + 1, dtype=torch.int32)
        with simulated(compute_capability=cc, multiprocessors=sms):
            packs = {sim_ops.gated_delta_rule_variant(q, v, cu[: b + 1], "chunked") for b in range(1, len(cu))}
        assert {p.removeprefix("chunked:") for p in packs} <= tested, (card, hv, packs)
    backend = Backend("sim", sim_ops, torch.device("cpu"))
    for cc in sorted({cc for cc, _ in VARIANTS}):
        variants = sorted({v for (c, _), vs in VARIANTS.items() if c == cc for v in vs})
        with simulated(compute_capability=cc, multiprocessors=cards[cc][1]):
            for dtype in (torch.float16, torch.bfloat16) if cc >= 80 else (torch.float16,):
                check_state_variants(backend, dtype, variants, naive if dtype == torch.float16 else None)


def test_the_variants_checks_catch_a_fault_in_each_fetch_path(sim_ops):
    """The staged variants fetch a chunk's tiles with cp.async from sm_80 and through registers before: a read
    before the cp.async lands (sm_80) and a register fetch stored while the chunk's W is still read (sm_70) each
    fail the checks above (a non-finite value or past the tolerance), which pass without them."""
    backend = Backend("sim", sim_ops, torch.device("cpu"))
    for cc, fault in ((80, "gdr_cp_async_not_waited"), (70, "gdr_prefetch_lands_early")):
        with simulated(compute_capability=cc):
            check_state_variants(backend, torch.float16, ("s32",))
            with simulated(fault=fault), pytest.raises((AssertionError, RuntimeError)):
                check_state_variants(backend, torch.float16, ("s32",))


def test_chunked_runs_any_block_order(sim_ops):
    """A GPU runs a grid's blocks in any order: the passes' CTAs write disjoint rows of the workspace."""
    backend = Backend("sim", sim_ops, torch.device("cpu"))
    with simulated(block_order="first-last"):
        check_chunked(backend, [65, 130], 1, 2, 16, torch.float16)


GATE_EDGES = {
    "gates near 0": dict(g=lambda g: -1e-6 * torch.rand_like(g)),
    "gates 0": dict(g=torch.zeros_like),
    "gates near -inf": dict(g=lambda g: torch.full_like(g, -1e4)),
    "gates -1e30": dict(g=lambda g: torch.full_like(g, -1e30)),
    "gates mixed near 0 and -inf": dict(g=lambda g: torch.where(torch.rand_like(g) < 0.3, -1e4, -1e-6)),
    "beta 0": dict(beta=torch.zeros_like),
    "beta 1": dict(beta=torch.ones_like),
    "beta 1, gates 0": dict(beta=torch.ones_like, g=torch.zeros_like),
}


@pytest.mark.parametrize("edge", list(GATE_EDGES))
def test_chunked_at_the_gates_edges(tc_backend, edge):
    check_chunked(tc_backend, [7, 140], 1, 2, 16, torch.float16, **GATE_EDGES[edge])


def test_chunked_normalises_keys_before_they_are_rounded(tc_backend):
    """f16 keys and queries whose K K^T overflows f16 (|k|^2 ~ 3e6 > 65,504): normalised in fp32 first, then
    rounded, the kernel stays within f16's tolerance."""
    big = dict(k=lambda k: k * 300, q=lambda q: q * 300)
    q, k, *_ = make_inputs([70], 1, 2, 32, 32, torch.float16, "cpu")
    raw = (k * 300).float()[:, 0]
    assert (raw @ raw.T).abs().max() > 65504 and torch.isfinite(k * 300).all()
    check_chunked(tc_backend, [70, 65], 1, 2, 32, torch.float16, **big)


def check_against_fla_naive(backend, naive, length=150, h=2, d=32, kernel="chunked") -> None:
    """The op against FLA's naive chunked and recurrent oracles directly (keys normalised by the caller, no fused
    norm), on the same f16-rounded inputs, with an initial state carried in and the final one out."""
    q = torch.randn(length, h, d).half()
    k = torch.nn.functional.normalize(torch.randn(length, h, d), dim=-1).half()
    v = torch.randn(length, h, d).half()
    g, beta = -torch.rand(length, h) * 0.1, torch.rand(length, h)
    initial = torch.randn(h, d, d) * 0.3
    dev = backend.device
    states = initial.clone().unsqueeze(0).to(dev)
    ours = backend.ops.gated_delta_rule_chunk(
        *(t.to(dev) for t in (q, k, v, g, beta)),
        states,
        cu_seqlens_of([length], dev),
        torch.tensor([0], device=dev),
        torch.tensor([True], device=dev),
        use_qk_l2norm=False,
        kernel=kernel,
    ).cpu()
    batched = [t.float().unsqueeze(0) for t in (q, k, v)]
    for oracle in (naive.naive_chunk_gated_delta_rule, naive.naive_recurrent_gated_delta_rule):
        theirs, final = oracle(
            *batched, g=g[None], beta=beta[None], initial_state=initial[None].clone(), output_final_state=True
        )
        assert rel_err(ours, theirs[0]) < TOLERANCE[torch.float16], (kernel, oracle.__name__)
        assert rel_err(states[0].cpu(), final[0]) < TOLERANCE[torch.float16], (kernel, oracle.__name__)


def test_chunked_matches_fla_naive(tc_backend):
    """Against FLA's naive chunked and recurrent oracles directly, with an initial state carried in and the final
    one out (slow decays: the whole chunk carries weight)."""
    check_against_fla_naive(tc_backend, load_fla_naive())


def test_chunked_kernel_prefill_then_decode_equals_one_long_recurrence(tc_backend):
    """Prefill chunks through the chunked kernel at odd boundaries (the state carried between calls through
    the slot), then decode: the reference recurrence over every token, in f16."""
    hk, hv, d, total = 1, 2, 16, 160
    dev = tc_backend.device
    q, k, v, g, beta, _, _, _, _ = make_inputs([total], hk, hv, d, d, torch.float16, dev)
    states = torch.zeros(2, hv, d, d, device=dev)
    slot = torch.tensor([1], dtype=torch.int32, device=dev)
    pieces, start = [], 0
    for n in (70, 9, 65):
        cu = cu_seqlens_of([n], dev)
        sl = slice(start, start + n)
        initial = torch.tensor([start > 0], device=dev)
        pieces.append(
            tc_backend.ops.gated_delta_rule_chunk(
                q[sl], k[sl], v[sl], g[sl], beta[sl], states, cu, slot, initial, kernel="chunked"
            )
        )
        start += n
    while start < total:
        sl = slice(start, start + 1)
        pieces.append(tc_backend.ops.gated_delta_rule_recurrent(q[sl], k[sl], v[sl], g[sl], beta[sl], states, slot))
        start += 1
    ref_states = torch.zeros(1, hv, d, d)
    cpu = [t.cpu() for t in (q, k, v, g, beta)]
    expected = torch.cat(
        [
            reference.gated_delta_rule_recurrent(*(x[t : t + 1] for x in cpu), ref_states, torch.tensor([0]))
            for t in range(total)
        ]
    )
    assert rel_err(torch.cat(pieces), expected) < TOLERANCE[torch.float16]
    assert rel_err(states[1], ref_states[0]) < TOLERANCE[torch.float16]


# Each compute capability's shared memory: (cc, dtype, the output pass's bytes at head dim 128: the whole head,
# or half of it where 84 KB does not fit (sm_75's 64 KB)).
ARCH_CASES = [
    (70, torch.float16, 84352),
    (75, torch.float16, 59776),
    (80, torch.bfloat16, 84352),
    (86, torch.float16, 84352),
    (90, torch.bfloat16, 84352),
    (120, torch.float16, 84352),
]


@pytest.mark.parametrize("cc, dtype, output_bytes", ARCH_CASES)
def test_chunked_fits_each_compute_capability(sim_ops, cc, dtype, output_bytes):
    """clef-flash's head dim on each arch's shared memory per block (the simulator refuses a launch over the
    limit, or above 48 KB without the opt-in): the tiles that fit, right."""
    backend = Backend("sim", sim_ops, torch.device("cpu"))
    with simulated(compute_capability=cc):
        check_chunked(backend, [70], 1, 1, 128, dtype)
        assert sim_ops._ops.launcher_device_calls()[2] == output_bytes  # the output pass, the last launch


def test_the_dispatch_rule_on_the_simulated_device(sim_ops):
    """auto: chunked for f16 from sm_70 and bf16 from sm_80 once sequences average 32 tokens; serial for fp32,
    short sequences, Pascal (no tensor cores), bf16 before sm_80 and head dims it is not compiled for. A forced
    chunked kernel that cannot run says why."""

    def dispatch(n, batch, dtype, d=128, kernel="auto"):
        q = torch.zeros(n, 2, d, dtype=dtype)
        v = torch.zeros(n, 4, d, dtype=dtype)
        return sim_ops.gated_delta_rule_dispatch(q, v, cu_seqlens_of([n // batch] * batch), kernel)

    assert dispatch(64, 2, torch.float16) == "chunked"
    assert dispatch(62, 2, torch.float16) == "serial"  # 31 tokens a sequence
    assert dispatch(64, 1, torch.float32) == "serial"
    assert dispatch(64, 1, torch.float16, d=24) == "serial"
    with pytest.raises(ValueError, match="f16 or bf16"):
        dispatch(64, 1, torch.float32, kernel="chunked")
    assert dispatch(2, 2, torch.float16, kernel="chunked") == "chunked"  # forced: short sequences run it too
    for cc in (60, 61):
        with simulated(compute_capability=cc):
            assert dispatch(640, 1, torch.float16) == "serial"
            with pytest.raises(ValueError, match="needs tensor cores"):
                dispatch(640, 1, torch.float16, kernel="chunked")
    with simulated(compute_capability=75):
        assert dispatch(640, 1, torch.float16) == "chunked"
        assert dispatch(640, 1, torch.bfloat16) == "serial"
        with pytest.raises(ValueError, match="bf16 tensor cores need sm_80"):
            dispatch(640, 1, torch.bfloat16, kernel="chunked")
    with pytest.raises(ValueError, match="'auto', 'serial' or 'chunked'"):
        dispatch(64, 1, torch.float16, kernel="wmma")


def test_a_forced_cuda_kernel_on_cpu_tensors_is_refused():
    from clef_cuda.kernels import ops

    args = _good_args()
    with pytest.raises(ValueError, match="picks a CUDA kernel"):
        ops.gated_delta_rule_chunk(**args, kernel="chunked")
    assert ops.gated_delta_rule_dispatch(args["q"], args["v"], args["cu_seqlens"]) == "cpu"


# Three of the test-only faults at the chunked kernel's CLEF_FAULT points: each is a bug the tests above must
# catch. Every fault point, these included, is also run against the op tests, the self-check and the autotune by
# tests/test_selfcheck_power.py (benchmarks/selfcheck_power.py).
CHUNKED_FAULTS = ["gdr_w_without_decay", "gdr_skip_causal_mask", "gdr_state_not_carried"]


@pytest.mark.parametrize("fault", CHUNKED_FAULTS)
def test_the_chunked_checks_catch_each_fault(sim_ops, fault):
    """The check test_chunked_matches_reference makes fails with each fault on (two chunks, initial states):
    W without its decay, the causal mask skipped in P, the state not carried from one chunk to the next."""
    backend = Backend("sim", sim_ops, torch.device("cpu"))
    check_chunked(backend, [65, 130], 1, 2, 16, torch.float16)  # passes without the fault
    # caught: past the tolerance, or a non-finite value the simulator saw (CLEF_CHECK_FINITE)
    with simulated(fault=fault), pytest.raises((AssertionError, RuntimeError)):
        check_chunked(backend, [65, 130], 1, 2, 16, torch.float16)


def test_one_record_fills_every_card_in_one_wave_of_the_state_pass():
    """benchmarks/delta_rule_occupancy.py's table from the launchers' own functions: clef-flash's one record (32 heads
    x 128) runs its state pass in one wave of CTAs on every tensor-core card of csrc/common/arch_limits.h, clef 27B's
    (48 heads) on all but the T4 (48 CTAs of one an SM on its 40 SMs). The block-count rule it replaced ran a V100's
    in 2 waves (128 CTAs of 32 columns, one an SM) and a T4's in 4."""
    import importlib.util

    from conftest import ROOT

    path = ROOT / "benchmarks" / "delta_rule_occupancy.py"
    spec = importlib.util.spec_from_file_location("delta_rule_occupancy", path)
    occupancy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(occupancy)
    for cc, card, sms in occupancy.cards():
        for model, (hk, hv) in occupancy.MODELS.items():
            fields = occupancy.host_probe_cached(cc, sms, hk, hv, 2048, 1).split()
            variant, waves = fields[3], int(fields[6])
            expected = 2 if (card, model) == ("T4", "clef 27B") else 1
            assert waves == expected, (card, model, variant, waves)
