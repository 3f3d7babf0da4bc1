"""paged_attention's tensor-core kernel v2 (kernel="wmma2"): 8 warps a CTA with O's columns split over warp
pairs, the next K/V tile prefetched into registers, O rescaled only when a row's max rises, and a
split-context pass when the grid has fewer CTAs than the GPU has SMs. Checked against the reference in
the simulator on each tensor-core card's shared memory (and on a GPU where there is one); each of its
test-only faults is shown to fail these checks, and the simulator's model of the named barriers and warp
votes it relies on is probed directly."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
from conftest import TOLERANCE, Backend, cuda_available, rel_err, simulated
from packing import cu_seqlens_of
from test_paged_attention import attention_failures, chunked_attention, fill_context, make_cache

from clef_cuda.kernels import reference

KERNEL = "wmma2"
# (Hq, Hkv, D, block_size): head dims 64, 128, 256 at GQA 4, 2, 1 and 8, block sizes 4..16.
HEADS = [(4, 1, 256, 16), (4, 2, 64, 8), (2, 2, 128, 4), (16, 2, 64, 16), (6, 1, 64, 8)]  # GQA 6: clef 27B's
# One pack: a fresh prefill, a chunk after a cached prefix, a decode token, a chunk spanning two query
# tiles and three key tiles; no context a multiple of the key tile, every sequence's pages scattered.
PACK = [(9, 9), (3, 40), (1, 17), (20, 70)]
# A long-ish record with a decode token beside it: a grid of 4 CTAs (GQA 4) or fewer, far below the
# simulated V100's 80 SMs, so the split-context pass runs; the record's CTAs get 3 to 6 parts of 2 or
# more key tiles each, the decode token's CTA one.
SPLIT_HEADS = [(4, 1, 256, 16), (8, 4, 128, 8), (2, 2, 64, 16), (12, 2, 64, 16)]
SPLIT_PACK = [(20, 200), (1, 9)]
TENSOR_CORE_CARDS = {70: "V100", 75: "T4", 80: "A100", 90: "H100"}
CASES = [
    (cc, dtype)
    for cc in TENSOR_CORE_CARDS
    for dtype in (torch.float16, torch.bfloat16)
    if dtype != torch.bfloat16 or cc >= 80
]
CASE_IDS = [f"sm_{cc}-{TENSOR_CORE_CARDS[cc]}-{str(dtype).removeprefix('torch.')}" for cc, dtype in CASES]
# Test-only faults of v2 (CLEF_FAULT points) and what they break: the pair's output column halves swapped;
# the register prefetch filled from the current tile's offsets again (the next tile a stale copy); the
# rescale vote taken with __all_sync (skipped unless every row's max rose); the combine weighting every
# part by the first part's max; the pair's named barrier counting v1's 128 threads instead of the pair's 64.
FAULTS = {
    "wmma2_swap_column_halves": "every configuration",
    "wmma2_prefetch_one_tile_late": "every configuration",
    "wmma2_rescale_vote": "every configuration",
    "wmma2_combine_wrong_max": "the split pass",
    "wmma2_pair_barrier_count": "a deadlock",
}


@contextlib.contextmanager
def simulated_sms(count: int):
    """The simulated device with `count` SMs (v2's split rule reads it), then restored."""
    previous = torch.ops.clef_sim.set_multiprocessor_count(count)
    try:
        yield
    finally:
        torch.ops.clef_sim.set_multiprocessor_count(previous)


@pytest.fixture
def sim(sim_ops) -> Backend:
    return Backend("sim", sim_ops, torch.device("cpu"))


def whole_grid_failures(sim, dtype=torch.float16, heads=HEADS) -> list[str]:
    """v2 without the split pass (a device of 1 SM: every grid fills it) over the pack."""
    with simulated_sms(1):
        return attention_failures(sim, dtype, heads, PACK, kernel=KERNEL)


def split_failures(sim, dtype=torch.float16, heads=SPLIT_HEADS) -> list[str]:
    """v2 with the split pass (the default 80 SMs) over the long record."""
    return attention_failures(sim, dtype, heads, SPLIT_PACK, kernel=KERNEL)


@pytest.mark.parametrize("cc, dtype", CASES, ids=CASE_IDS)
def test_wmma2_matches_reference(sim, cc, dtype):
    """The awkward pack on each card's shared memory (a T4 runs 16-key tiles, one warp of a pair scoring
    them), f16 and, from sm_80, bf16; NaN in unused cache slots and unwritten shared memory."""
    with simulated(compute_capability=cc):
        assert not whole_grid_failures(sim, dtype)


@pytest.mark.parametrize("cc, dtype", CASES, ids=CASE_IDS)
def test_wmma2_split_context_matches_reference(sim, cc, dtype):
    with simulated(compute_capability=cc):
        assert not split_failures(sim, dtype)


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_available(), reason="needs a GPU and the CUDA build")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_wmma2_matches_reference_on_the_gpu(dtype):
    from clef_cuda.kernels import ops

    if dtype == torch.bfloat16 and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 tensor cores need sm_80")
    gpu = Backend("cuda", ops._default, torch.device("cuda"))
    heads = [(16, 4, 256, 16), (8, 8, 64, 32), (4, 2, 128, 16), (16, 1, 128, 16)]
    pack = [(37, 37), (64, 200), (5, 300), (1, 129), (1, 1), (130, 130), (300, 1000)]
    assert not attention_failures(gpu, dtype, heads, pack, kernel=KERNEL)
    # A prefix-cache hit over a long context: 4 CTAs, so the split pass runs on any GPU.
    assert not attention_failures(gpu, dtype, heads[:1], [(64, 4096)], kernel=KERNEL)


def test_wmma2_chunked_prefill_and_decode_equal_full_causal_attention(sim):
    out, expected = chunked_attention(sim.ops, sim.device, torch.float16, HEADS[0], 40, (17, 1, 22), kernel=KERNEL)
    assert rel_err(out, expected) < TOLERANCE[torch.float16]


def test_wmma2_custom_scale_and_empty_sequences(sim):
    hq, hkv, d, block_size = HEADS[1]
    sequences = [(0, 5), (3, 7), (0, 0)]  # sequences with no new queries in the pack
    key_cache, value_cache, block_tables = make_cache(sequences, hkv, d, block_size, torch.float16, "cpu")
    fill_context(sequences, key_cache, value_cache, block_tables, torch.float16, "cpu")
    query = torch.randn(3, hq, d, dtype=torch.float16)
    cu = cu_seqlens_of([0, 3, 0])
    context_lens = torch.tensor([5, 7, 0], dtype=torch.int32)
    args = (query, key_cache, value_cache, cu, context_lens, block_tables)
    expected = reference.paged_attention(*args, scale=0.05)
    for sms in (1, 80):
        with simulated_sms(sms):
            out = sim.ops.paged_attention(*args, scale=0.05, kernel=KERNEL)
        assert rel_err(out, expected) < TOLERANCE[torch.float16], sms


@pytest.mark.parametrize("fault", FAULTS)
def test_the_wmma2_tests_catch_an_injected_fault(sim, fault):
    """v2 with one test-only bug (FAULTS) fails the checks above in every configuration it can reach: the
    combine's only where the split pass runs, the barrier's as the deadlock the simulator reports."""
    with simulated(fault=fault):
        if FAULTS[fault] == "a deadlock":
            with pytest.raises(RuntimeError, match=r"deadlock: not every thread reached bar\.sync"):
                whole_grid_failures(sim)
        elif FAULTS[fault] == "the split pass":
            assert not whole_grid_failures(sim)
            assert len(split_failures(sim)) == len(SPLIT_HEADS)
        else:
            assert len(whole_grid_failures(sim)) == len(HEADS)
            assert len(split_failures(sim)) == len(SPLIT_HEADS)
    assert not whole_grid_failures(sim, heads=HEADS[:1]) and not split_failures(sim, heads=SPLIT_HEADS[:1])


def test_the_split_pass_runs_when_the_grid_is_smaller_than_the_gpu(sim):
    """The rule in paged_attention.h (paged_attention_wmma2_splits), seen through the combine's fault, which
    changes answers exactly when parts are combined: SPLIT_PACK at GQA 4 launches 4 CTAs, so 8 SMs give
    2 parts (4 or 5 SMs: fewer than two a CTA, no split) and 80 SMs up to 20; a record whose block table
    holds fewer than 2 x 2 key tiles is never split."""
    heads = SPLIT_HEADS[:1]
    with simulated(fault="wmma2_combine_wrong_max"):
        for sms, split in ((4, False), (5, False), (8, True), (80, True)):
            with simulated_sms(sms):
                assert bool(attention_failures(sim, torch.float16, heads, SPLIT_PACK, kernel=KERNEL)) == split, sms
        assert not attention_failures(sim, torch.float16, heads, [(9, 40)], kernel=KERNEL)  # 80 keys of table


def test_the_split_rule_counts_the_grids_real_ctas(sim):
    """Four prefix-cache hits of 64 tokens (GQA 4, 2 KV heads): the grid sized from the host's longest query
    (4 query tiles x 2 x 4 = 32 CTAs) is under a 64-SM device, so the split pass runs (seen through the
    combine's fault); sized from the pack's 256 tokens (the old bound, max_query_len=None) the phantom CTAs
    (16 tiles x 2 x 4 = 128) kept it from ever splitting."""
    heads, pack = [(8, 2, 64, 16)], [(64, 192)] * 4
    with simulated(fault="wmma2_combine_wrong_max"), simulated_sms(64):
        assert attention_failures(sim, torch.float16, heads, pack, kernel=KERNEL)  # split: the fault shows
        assert not attention_failures(sim, torch.float16, heads, pack, kernel=KERNEL, max_query_len=None)
    with simulated_sms(64):
        assert not attention_failures(sim, torch.float16, heads, pack, kernel=KERNEL)


def test_a_grid_past_cudas_limits_is_a_clear_error(sim):
    """65,536 sequences in one call would need grid.z = 65,536 (the limit is 65,535): the launcher says so
    before any launch, for the SIMT kernel and v2 alike."""
    n = 65536
    key_cache, value_cache, tables = make_cache([(1, 1)] * 2, 1, 64, 16, torch.float16, "cpu")
    query = torch.randn(n, 4, 64, dtype=torch.float16)
    cu, ctx = cu_seqlens_of([1] * n), torch.ones(n, dtype=torch.int32)
    tables = tables[:1].expand(n, -1).contiguous()
    for kernel in ("simt", KERNEL):
        with pytest.raises(RuntimeError, match="more sequences in one call than a grid's 65,535"):
            sim.ops.paged_attention(query, key_cache, value_cache, cu, ctx, tables, kernel=kernel, max_query_len=1)


def test_clef_smem_limit_gives_a_big_gpu_a_small_cards_tiles(sim, monkeypatch):
    """CLEF_SMEM_LIMIT (test-only) caps the shared memory the launchers see, so an H100 runs a T4's 16-key
    D = 256 tiles (64 KB) or Pascal's 48 KB, where no tensor-core tile of D = 256 fits: the dispatch then
    falls back to SIMT and a forced tensor-core kernel is refused saying why."""
    heads, pack = [(4, 1, 256, 16)], [(20, 70), (1, 9)]

    def dispatch(kernel="auto"):
        key_cache, value_cache, tables = make_cache(pack, 1, 256, 16, torch.float16, "cpu")
        query = torch.randn(21, 4, 256, dtype=torch.float16)
        cu, ctx = cu_seqlens_of([20, 1]), torch.tensor([70, 9], dtype=torch.int32)
        return sim.ops.paged_attention_dispatch(query, key_cache, value_cache, cu, ctx, tables, kernel=kernel)

    with simulated(compute_capability=90):
        monkeypatch.setenv("CLEF_SMEM_LIMIT", str(64 * 1024))
        assert dispatch() == "wmma" and not attention_failures(sim, torch.float16, heads, pack, kernel="wmma")
        assert launched_smem() == 56320  # the T4's 16-key tile (55 KB), not the 32-key one an H100 takes
        with simulated_sms(1):  # no split pass: v2's own launch is the last
            assert not attention_failures(sim, torch.float16, heads, pack, kernel=KERNEL)
        assert launched_smem() == 62720  # v2's 16-key tile (61.25 KB)
        monkeypatch.setenv("CLEF_SMEM_LIMIT", str(48 * 1024))
        assert dispatch() == "simt"
        with pytest.raises(ValueError, match="no tensor-core tile of this head dim fits"):
            dispatch("wmma")
        assert not attention_failures(sim, torch.float16, heads, pack)
        monkeypatch.delenv("CLEF_SMEM_LIMIT")
        assert dispatch() == "wmma"
        assert not attention_failures(sim, torch.float16, heads, pack, kernel="wmma") and launched_smem() == 77568


def launched_smem() -> int:
    return torch.ops.clef_sim.launcher_device_calls()[2]


def test_the_device_is_asked_once_and_kernels_opted_in_once(sim):
    """The launchers cache the device's attributes and each kernel's shared-memory opt-in per device: ten calls
    ask nothing more after the first; a changed (simulated) device is asked again."""
    heads, pack = [(4, 1, 256, 16)], [(20, 70)]
    with simulated(compute_capability=90):
        attention_failures(sim, torch.float16, heads, pack, kernel="wmma")
        before = torch.ops.clef_sim.launcher_device_calls()
        for _ in range(10):
            attention_failures(sim, torch.float16, heads, pack, kernel="wmma")
        assert torch.ops.clef_sim.launcher_device_calls()[:2] == before[:2]
    with simulated(compute_capability=80):
        attention_failures(sim, torch.float16, heads, pack, kernel="wmma")
    queries, opt_ins, _ = torch.ops.clef_sim.launcher_device_calls()
    assert queries > before[0] and opt_ins > before[1]


def test_wmma2_runs_only_where_it_can_and_says_why_not(sim):
    """kernel="wmma2" forces v2 (paged_attention_dispatch names it; "auto" keeps v1); a device or call it
    cannot run is a ValueError naming the reason, before any launch."""

    def dispatch(dtype=torch.float16, hq=16, hkv=4, d=256, kernel=KERNEL):
        sequences = [(13, 50), (20, 20)]
        key_cache, value_cache, block_tables = make_cache(sequences, hkv, d, 16, dtype, "cpu")
        query = torch.randn(33, hq, d, dtype=dtype)
        cu, ctx = cu_seqlens_of([13, 20]), torch.tensor([50, 20], dtype=torch.int32)
        return sim.ops.paged_attention_dispatch(query, key_cache, value_cache, cu, ctx, block_tables, kernel=kernel)

    for cc in (70, 75, 80, 86, 89, 90):
        with simulated(compute_capability=cc):
            assert dispatch() == "wmma2" and dispatch(kernel="auto") == "wmma"
    for cc in (60, 61):
        with simulated(compute_capability=cc):
            with pytest.raises(ValueError, match="kernel='wmma2' cannot run these arguments: tensor cores need sm_70"):
                dispatch()
            with pytest.raises(ValueError, match="kernel='wmma2' cannot run these arguments: tensor cores need sm_70"):
                attention_failures(sim, torch.float16, [(4, 1, 256, 16)], [(9, 9)], kernel=KERNEL)
    with simulated(compute_capability=70), pytest.raises(ValueError, match="bf16 tensor cores need sm_80"):
        dispatch(torch.bfloat16)
    with pytest.raises(ValueError, match="f16 or bf16"):
        dispatch(torch.float32)
    with pytest.raises(ValueError, match="head dims 64, 128 and 256"):
        dispatch(hq=4, hkv=2, d=32)
    from clef_cuda.kernels import ops

    with pytest.raises(ValueError, match="kernel='wmma2' picks a CUDA kernel, but cpu tensors run the CPU"):
        args = make_cache([(1, 1)], 1, 64, 16, torch.float16, "cpu")
        ops.paged_attention(
            torch.randn(1, 4, 64, dtype=torch.float16),
            *args[:2],
            cu_seqlens_of([1]),
            torch.tensor([1], dtype=torch.int32),
            args[2],
            kernel=KERNEL,
        )


def test_the_simulator_refuses_a_v2_tile_over_the_t4s_shared_memory(sim):
    """v2's 32-key D = 256 tile (86 KB) on a T4 (64 KB), with the launcher's tile choice ignoring the
    device (a test-only fault): the T4 case of test_wmma2_matches_reference can fail."""
    with simulated(compute_capability=75, fault="attention_ignores_smem_limit"):
        with pytest.raises(RuntimeError, match="more than sm_75 allows"):
            whole_grid_failures(sim, heads=HEADS[:1])


@pytest.mark.parametrize(
    "how, error",
    [
        ("right", None),
        ("count_not_a_multiple_of_32", r"bar\.sync 1 over 48 threads: a multiple of 32"),
        ("participants_disagree", r"bar\.sync 1 with (64|96) threads, while others wait at it for (96|64)"),
        ("count_never_reached", r"deadlock: not every thread reached bar\.sync 1 \(every thread still running"),
    ],
)
def test_the_simulator_models_named_barriers_and_warp_votes(sim_ops, how, error):
    """A probe kernel (tests/cuda_sim/sim_controls.cpp): two warp pairs hand values over across named
    barriers of their own and vote with __any_sync / __all_sync. Right, every handoff and vote comes out
    as on a GPU; each way of getting the barrier's count wrong is an error naming it (the count its
    participants never reach as soon as every thread waits, not after a timeout)."""
    result = torch.ops.clef_sim.probe_named_barriers(how)
    if error is None:
        assert result == "ok"
    else:
        assert re.search(error, result), result
