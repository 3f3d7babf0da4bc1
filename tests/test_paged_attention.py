"""reshape_and_cache / paged_attention: fast ops vs reference; reference vs torch's attention.

paged_attention has two CUDA kernels, tensor-core (WMMA) and SIMT; the simulator (and a GPU, where there is
one) runs each of them forced over the awkward shapes, the dispatch rule between them is checked on the
simulated device, and test-only faults injected into the tensor-core kernel show that these tests fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TOLERANCE, Backend, cuda_available, qwen35_module, rel_err, simulated
from packing import cu_seqlens_of, nan_like

from clef_cuda.kernels import reference

# Each sequence: (new queries, context length incl. them): fresh prefill, chunked prefill, prefix-cache
# hit (short chunk, long cached prefix), decode.
SEQUENCES = {
    "cpu": [(37, 37), (64, 200), (5, 300), (1, 129), (1, 1), (130, 130)],
    "cuda": [(37, 37), (64, 200), (5, 300), (1, 129), (1, 1), (130, 130)],
    "sim": [(9, 9), (3, 40), (1, 17)],
}
# (Hq, Hkv, D, block_size)
# clef-flash's 16 / 4 x 256, and clef 27B's GQA 6 (24 / 4 x 256; 12 / 2 a rank at TP=2, 6 / 1 at TP=4).
HEADS = {
    "cpu": [(16, 4, 256, 16), (8, 8, 64, 32), (4, 2, 128, 16), (6, 2, 24, 8), (12, 2, 256, 16)],
    "cuda": [(16, 4, 256, 16), (8, 8, 64, 32), (4, 2, 128, 16), (8, 1, 16, 8), (24, 4, 256, 16), (6, 1, 256, 16)],
    "sim": [(4, 1, 256, 16), (4, 2, 64, 8), (2, 2, 16, 4), (6, 1, 32, 4)],
}
# The tensor-core kernel's head dims, with GQA 4, 2, 1 and 8 or 16 (64-row tiles of 16, 32, 64 and 8 or 4
# tokens); in the simulator a chunk after a cached prefix that spans two query tiles and three key tiles.
WMMA_HEADS = {
    "cuda": [(16, 4, 256, 16), (8, 8, 64, 32), (4, 2, 128, 16), (16, 1, 128, 16), (24, 4, 256, 16)],
    "sim": [(4, 1, 256, 16), (4, 2, 64, 8), (2, 2, 128, 4), (16, 2, 64, 16), (6, 1, 64, 8)],
}
WMMA_SEQUENCES = {
    "cuda": SEQUENCES["cuda"] + [(300, 1000)],
    "sim": [(9, 9), (3, 40), (1, 17), (20, 70)],
}
# CLEF_FAULT points of the tensor-core kernel: its causal mask skipped; P V reading the wrong 16-key
# sub-tile of V; the softmax rescale assuming an element-to-lane mapping (which the simulator scrambles).
WMMA_FAULTS = ("wmma_skip_causal_mask", "wmma_tile_offset", "wmma_assumes_element_order")


@pytest.fixture(params=["sim"] + (["cuda"] if cuda_available() else []))
def cuda_kernels(request) -> Backend:
    """The backends that run the CUDA kernels: the simulator and, where there is one, the GPU."""
    from clef_cuda.kernels import ops

    if request.param == "cuda":
        return Backend("cuda", ops._default, torch.device("cuda"))
    return Backend("sim", request.getfixturevalue("sim_ops"), torch.device("cpu"))


def skip_without_bf16_tensor_cores(backend: Backend, dtype: torch.dtype) -> None:
    if backend.kind == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 tensor cores need sm_80 (this GPU runs bf16 on the SIMT kernel)")


def make_cache(sequences, hkv, d, block_size, dtype, device, spare_blocks=3):
    """Caches with each sequence's blocks scattered over a shuffled pool; unused blocks hold NaN and
    unused block-table entries point far outside the pool, so reading anything outside a context shows."""
    blocks_needed = [(ctx + block_size - 1) // block_size for _, ctx in sequences]
    num_blocks = sum(blocks_needed) + spare_blocks
    key_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype, device=device)
    value_cache = torch.full_like(key_cache, float("nan"))
    max_blocks = max(blocks_needed) + 2
    block_tables = torch.full((len(sequences), max_blocks), 10**6, dtype=torch.int32)
    pool = torch.randperm(num_blocks).tolist()
    for b, n in enumerate(blocks_needed):
        block_tables[b, :n] = torch.tensor([pool.pop() for _ in range(n)], dtype=torch.int32)
    return key_cache, value_cache, block_tables.to(device)


def slots_of(block_table: torch.Tensor, positions: range, block_size: int) -> list[int]:
    return [int(block_table[p // block_size]) * block_size + p % block_size for p in positions]


def fill_context(sequences, key_cache, value_cache, block_tables, dtype, device):
    """Write every context key/value (cached prefix and new tokens alike) through the reference writer."""
    hkv, d, block_size = key_cache.shape[2], key_cache.shape[3], key_cache.shape[1]
    for b, (_, ctx) in enumerate(sequences):
        slots = torch.tensor(slots_of(block_tables[b].cpu(), range(ctx), block_size), dtype=torch.int32, device=device)
        keys = torch.randn(ctx, hkv, d, dtype=dtype, device=device)
        values = torch.randn(ctx, hkv, d, dtype=dtype, device=device)
        reference.reshape_and_cache(keys, values, key_cache, value_cache, slots)


def packed_queries(sequences, hq, d, dtype, device):
    """Queries as the q_proj output delivers them: [N, Hq, 2D] with the output gate beside each query."""
    n = sum(q for q, _ in sequences)
    q_and_gate = torch.randn(n, hq, 2 * d, dtype=dtype, device=device)
    return q_and_gate[:, :, :d]


def attention_failures(backend, dtype, heads, sequences, kernel="auto", max_query_len="exact") -> list[str]:
    """paged_attention vs the reference for each head configuration over one pack of `sequences`;
    what went wrong for each configuration that does not match (empty: all match). max_query_len: "exact"
    (the pack's longest, as the trunk passes it), or a value to pass (None: the op's num_tokens bound)."""
    if max_query_len == "exact":
        max_query_len = max((q for q, _ in sequences), default=0) or None
    failures = []
    for hq, hkv, d, block_size in heads:
        key_cache, value_cache, block_tables = make_cache(sequences, hkv, d, block_size, dtype, backend.device)
        fill_context(sequences, key_cache, value_cache, block_tables, dtype, backend.device)
        query = packed_queries(sequences, hq, d, dtype, backend.device)
        cu = cu_seqlens_of([q for q, _ in sequences], backend.device)
        context_lens = torch.tensor([c for _, c in sequences], dtype=torch.int32, device=backend.device)
        out = nan_like(query.contiguous())
        caches = (key_cache, value_cache)
        backend.ops.paged_attention(
            query, *caches, cu, context_lens, block_tables, out=out, kernel=kernel, max_query_len=max_query_len
        )
        expected = reference.paged_attention(
            query.cpu(), key_cache.cpu(), value_cache.cpu(), cu.cpu(), context_lens.cpu(), block_tables.cpu()
        )
        if not torch.isfinite(out).all():
            failures.append(f"{(hq, hkv, d, block_size)}: read outside a context or left an output unwritten")
        elif rel_err(out, expected) >= TOLERANCE[dtype]:
            failures.append(f"{(hq, hkv, d, block_size)}: relative error {rel_err(out, expected):.2e}")
    return failures


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_attention_matches_reference(backend, dtype):
    """The op as the trunk calls it (on a GPU, or in the simulator: the kernel the dispatch rule picks)."""
    assert not attention_failures(backend, dtype, HEADS[backend.kind], SEQUENCES[backend.kind])


def test_without_the_hosts_max_query_len_the_grid_covers_the_whole_pack(backend):
    """max_query_len=None sizes the grid from the pack's token count (the old bound: CTAs past a sequence's
    queries exit at once): the same answers."""
    assert not attention_failures(
        backend, torch.float16, HEADS[backend.kind], SEQUENCES[backend.kind], max_query_len=None
    )


def test_a_max_query_len_below_a_sequence_is_refused_where_it_can_be_checked(backend):
    """On CPU tensors (the CPU implementation, the simulator) the values are cheap to read: a bound below a
    sequence's queries, which would leave its last rows unwritten on a GPU, is a ValueError naming it."""
    if backend.kind == "cuda":
        pytest.skip("GPU tensors: the op trusts the host's bound (reading the lengths back would cost a sync)")
    sequences = [(3, 10), (7, 7)]
    with pytest.raises(ValueError, match="sequence 1 has 7 new queries, more than max_query_len = 5"):
        attention_failures(backend, torch.float32, HEADS[backend.kind][:1], sequences, max_query_len=5)
    with pytest.raises(ValueError, match="max_query_len must be >= 0"):
        attention_failures(backend, torch.float32, HEADS[backend.kind][:1], sequences, max_query_len=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_simt_kernel_matches_reference(cuda_kernels, dtype):
    heads, sequences = HEADS[cuda_kernels.name], SEQUENCES[cuda_kernels.name]
    assert not attention_failures(cuda_kernels, dtype, heads, sequences, kernel="simt")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_wmma_kernel_matches_reference(cuda_kernels, dtype):
    """Tensor cores over unaligned context lengths, block sizes 4..32, GQA 1..16, chunks after a cached
    prefix and NaN in every unused cache slot (and, in the simulator, in unwritten shared memory)."""
    skip_without_bf16_tensor_cores(cuda_kernels, dtype)
    heads, sequences = WMMA_HEADS[cuda_kernels.name], WMMA_SEQUENCES[cuda_kernels.name]
    assert not attention_failures(cuda_kernels, dtype, heads, sequences, kernel="wmma")


@pytest.mark.parametrize("order", ["first-last", "last-first"])
@pytest.mark.parametrize("kernel", ["simt", "wmma", "wmma2"])
def test_dead_rows_of_gqa_6_write_nothing_whichever_block_runs_first(sim_ops, kernel, order):
    """clef 27B's GQA 6 does not divide a tile's 16 or 64 rows: each tile's last rows are dead, and must write
    nothing, or a block overwrites the first token of the next tile's heads. A GPU runs blocks in any order,
    so the simulator runs them both ways (in one of them the owner would write last and hide it)."""
    sim = Backend("sim", sim_ops, torch.device("cpu"))
    with simulated(block_order=order):
        assert not attention_failures(sim, torch.float16, [(6, 1, 64, 8)], [(25, 25), (12, 40)], kernel=kernel)


@pytest.mark.parametrize("fault", WMMA_FAULTS)
def test_the_wmma_tests_catch_an_injected_fault(sim_ops, fault):
    """The tensor-core kernel with one test-only bug (WMMA_FAULTS) fails test_wmma_kernel_matches_reference
    in every configuration."""
    sim = Backend("sim", sim_ops, torch.device("cpu"))
    with simulated(fault=fault):
        failures = attention_failures(sim, torch.float16, WMMA_HEADS["sim"], WMMA_SEQUENCES["sim"], kernel="wmma")
    assert len(failures) == len(WMMA_HEADS["sim"]), failures
    assert not attention_failures(sim, torch.float16, WMMA_HEADS["sim"][:1], WMMA_SEQUENCES["sim"], kernel="wmma")


def test_custom_scale_and_empty_sequences(backend):
    hq, hkv, d, block_size = HEADS[backend.kind][1]
    sequences = [(0, 5), (3, 7), (0, 0)]  # sequences with no new queries in the pack
    key_cache, value_cache, block_tables = make_cache(sequences, hkv, d, block_size, torch.float32, backend.device)
    fill_context(sequences, key_cache, value_cache, block_tables, torch.float32, backend.device)
    query = torch.randn(3, hq, d, device=backend.device)
    cu = cu_seqlens_of([0, 3, 0], backend.device)
    context_lens = torch.tensor([5, 7, 0], dtype=torch.int32, device=backend.device)
    out = backend.ops.paged_attention(query, key_cache, value_cache, cu, context_lens, block_tables, scale=0.05)
    expected = reference.paged_attention(query, key_cache, value_cache, cu, context_lens, block_tables, scale=0.05)
    assert rel_err(out, expected) < 1e-5


def test_wmma_custom_scale_and_empty_sequences(cuda_kernels):
    hq, hkv, d, block_size = WMMA_HEADS[cuda_kernels.name][1]
    sequences = [(0, 5), (3, 7), (0, 0)]
    key_cache, value_cache, block_tables = make_cache(sequences, hkv, d, block_size, torch.float16, cuda_kernels.device)
    fill_context(sequences, key_cache, value_cache, block_tables, torch.float16, cuda_kernels.device)
    query = torch.randn(3, hq, d, dtype=torch.float16, device=cuda_kernels.device)
    cu = cu_seqlens_of([0, 3, 0], cuda_kernels.device)
    context_lens = torch.tensor([5, 7, 0], dtype=torch.int32, device=cuda_kernels.device)
    out = cuda_kernels.ops.paged_attention(
        query, key_cache, value_cache, cu, context_lens, block_tables, scale=0.05, kernel="wmma"
    )
    expected = reference.paged_attention(query, key_cache, value_cache, cu, context_lens, block_tables, scale=0.05)
    assert rel_err(out, expected) < TOLERANCE[torch.float16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reshape_and_cache_matches_reference(backend, dtype):
    hkv, d, block_size, num_blocks, n = 2, 64, 16, 6, 40
    key = torch.randn(n, hkv, 2 * d, dtype=dtype, device=backend.device)[:, :, :d]  # strided rows
    value = torch.randn(n, hkv, d, dtype=dtype, device=backend.device)
    slots = torch.randperm(num_blocks * block_size)[:n].to(torch.int32)
    slots[[3, 17]] = -1  # padding tokens are skipped
    slots = slots.to(backend.device)
    key_cache = torch.randn(num_blocks, block_size, hkv, d, dtype=dtype, device=backend.device)
    value_cache = torch.randn_like(key_cache)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    backend.ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    reference.reshape_and_cache(key, value, expected_k, expected_v, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


def chunked_attention(ops, device, dtype, heads, total, chunks, kernel="auto"):
    """(each chunk's paged_attention over the cache written so far, concatenated; one causal SDPA pass in
    fp32 over the same inputs)."""
    hq, hkv, d, block_size = heads
    key_cache, value_cache, block_tables = make_cache([(total, total)], hkv, d, block_size, dtype, device)
    q = torch.randn(total, hq, d, device=device).to(dtype)
    k = torch.randn(total, hkv, d, device=device).to(dtype)
    v = torch.randn(total, hkv, d, device=device).to(dtype)
    pieces, start = [], 0
    for n in chunks:
        slots = torch.tensor(slots_of(block_tables[0].cpu(), range(start, start + n), block_size), dtype=torch.int32)
        ops.reshape_and_cache(k[start : start + n], v[start : start + n], key_cache, value_cache, slots.to(device))
        ctx = torch.tensor([start + n], dtype=torch.int32, device=device)
        cu = cu_seqlens_of([n], device)
        chunk = q[start : start + n]
        pieces.append(ops.paged_attention(chunk, key_cache, value_cache, cu, ctx, block_tables, kernel=kernel))
        start += n
    q, k, v = (t.cpu().float().transpose(0, 1) for t in (q, k, v))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(0, 1)
    return torch.cat(pieces), expected


def test_chunked_prefill_and_decode_equal_full_causal_attention(backend):
    """Writing a sequence's KV chunk by chunk and attending each chunk over the cache == one causal pass."""
    total = 90 if backend.kind != "sim" else 14
    chunks = (40, 1, 33, 16) if backend.kind != "sim" else (5, 1, 8)
    out, expected = chunked_attention(backend.ops, backend.device, torch.float32, HEADS[backend.kind][0], total, chunks)
    assert rel_err(out, expected) < 1e-5


def test_wmma_chunked_prefill_and_decode_equal_full_causal_attention(cuda_kernels):
    total = 90 if cuda_kernels.name != "sim" else 40
    chunks = (40, 1, 33, 16) if cuda_kernels.name != "sim" else (17, 1, 22)
    heads = WMMA_HEADS[cuda_kernels.name][0]
    out, expected = chunked_attention(
        cuda_kernels.ops, cuda_kernels.device, torch.float16, heads, total, chunks, kernel="wmma"
    )
    assert rel_err(out, expected) < TOLERANCE[torch.float16]


# ---- which kernel: the dispatch rule ------------------------------------------------------------
def test_the_dispatch_rule_on_the_simulated_device(sim_ops):
    """Tensor cores for f16 (sm_70+) and bf16 (sm_80+) at head dims 64/128/256 when the pack averages 16
    query rows per sequence or more; the SIMT kernel for the rest; forcing works and says why it cannot."""

    def dispatch(dtype=torch.float16, hq=16, hkv=4, d=256, q_lens=(13, 20), contexts=(50, 20), kernel="auto", wide=0):
        sequences = list(zip(q_lens, contexts, strict=True))
        key_cache, value_cache, block_tables = make_cache(sequences, hkv, d, 16, dtype, "cpu")
        query = torch.randn(sum(q_lens), hq, d + wide, dtype=dtype)[:, :, wide:]
        cu, ctx = cu_seqlens_of(list(q_lens)), torch.tensor(contexts, dtype=torch.int32)
        return sim_ops.paged_attention_dispatch(query, key_cache, value_cache, cu, ctx, block_tables, kernel=kernel)

    for cc in (60, 61, 70, 75, 80, 86, 89, 90):
        with simulated(compute_capability=cc):
            # clef-flash's shapes (a chunk after a prefix and a fresh prefill): tensor cores from sm_70, on
            # a T4 with its 64 KB tile (test_every_card_runs_clef_flash_attention_within_its_shared_memory)
            assert dispatch() == ("wmma" if cc >= 70 else "simt")
            assert dispatch(torch.bfloat16) == ("wmma" if cc >= 80 else "simt")
            assert dispatch(torch.float32) == "simt"
    with simulated(compute_capability=61), pytest.raises(ValueError, match="tensor cores need sm_70"):
        dispatch(kernel="wmma")
    assert [dispatch(d=d, hq=4, hkv=2) for d in (16, 32, 64, 128, 256)] == ["simt", "simt", "wmma", "wmma", "wmma"]
    # 16 rows per sequence on average: at GQA 4, 4 tokens. Decode packs stay on SIMT.
    assert dispatch(q_lens=(4, 4), contexts=(9, 4)) == "wmma"
    assert dispatch(q_lens=(4, 3), contexts=(9, 4)) == "simt"
    assert dispatch(q_lens=(1, 1, 1), contexts=(40, 17, 1)) == "simt"
    assert dispatch(hq=2, hkv=2, d=128, q_lens=(16,), contexts=(16,)) == "wmma"
    assert dispatch(hq=12, hkv=1, d=64) == "wmma"  # GQA 12: 5 tokens in the 64-row tile, 4 rows dead
    assert dispatch(hq=6, hkv=1, d=256) == "wmma"  # clef 27B's GQA 6: 10 tokens, 4 rows dead
    assert dispatch(wide=1) == "simt"  # a query view 2 bytes off 16-byte alignment
    assert dispatch(kernel="simt") == "simt" and dispatch(q_lens=(1,), contexts=(9,), kernel="wmma") == "wmma"
    with pytest.raises(ValueError, match="f16 or bf16"):
        dispatch(torch.float32, kernel="wmma")
    with pytest.raises(ValueError, match="16-byte aligned"):
        dispatch(wide=1, kernel="wmma")
    with simulated(compute_capability=70), pytest.raises(ValueError, match="sm_80"):
        dispatch(torch.bfloat16, kernel="wmma")
    with pytest.raises(ValueError, match="kernel must be 'auto', 'simt', 'wmma' or 'wmma2'"):
        dispatch(kernel="tensor")
    sim = Backend("sim", sim_ops, torch.device("cpu"))
    with pytest.raises(ValueError, match="kernel='wmma' cannot run these arguments: the tensor-core kernel takes f16"):
        attention_failures(sim, torch.float32, [(4, 1, 256, 16)], [(9, 9)], kernel="wmma")  # the op, before launching


# The simulated cards (tests/cuda_sim: each compute capability's shared memory per block is enforced).
CARDS = {60: "P100", 61: "P40", 70: "V100", 75: "T4", 80: "A100", 86: "A10", 89: "L4", 90: "H100"}


@pytest.mark.parametrize("cc", sorted(CARDS), ids=[f"sm_{cc}-{CARDS[cc]}" for cc in sorted(CARDS)])
def test_every_card_runs_clef_flash_attention_within_its_shared_memory(sim_ops, cc):
    """D = 256 at clef-flash's GQA 4, f16 and fp32, on each card's simulated device: the tile the launcher
    picks fits the card (a T4 gets the 16-key tensor-core tile, Pascal the 8-key SIMT one) and matches
    the reference. Before the tiles followed the device, a T4 asked for 75.75 KB and Pascal 49.4 KB."""
    sim = Backend("sim", sim_ops, torch.device("cpu"))
    heads, sequences = [(4, 1, 256, 16)], [(9, 9), (20, 70)]
    with simulated(compute_capability=cc):
        assert not attention_failures(sim, torch.float16, heads, sequences)
        assert not attention_failures(sim, torch.float32, heads, sequences)
        if cc >= 70:
            assert not attention_failures(sim, torch.float16, heads, sequences, kernel="wmma")


def test_the_simulator_refuses_a_tile_over_the_cards_shared_memory(sim_ops):
    """The same calls with the launcher's tile choice ignoring the device's limit (a test-only fault:
    always the largest tile) fail on a T4 and on Pascal, not on an A100: the checks above can fail."""
    sim = Backend("sim", sim_ops, torch.device("cpu"))
    heads, sequences = [(4, 1, 256, 16)], [(9, 9), (20, 70)]
    with simulated(fault="attention_ignores_smem_limit"):
        with simulated(compute_capability=75), pytest.raises(RuntimeError, match="more than sm_75 allows"):
            attention_failures(sim, torch.float16, heads, sequences)
        with simulated(compute_capability=61), pytest.raises(RuntimeError, match="more than sm_61 allows"):
            attention_failures(sim, torch.float32, heads, sequences)
        with simulated(compute_capability=80):
            assert not attention_failures(sim, torch.float16, heads, sequences)


def test_the_t4_tile_matches_the_reference_over_awkward_shapes(sim_ops):
    """The 16-key tensor-core tile (one key sub-tile per barrier) over the WMMA test's shapes, and its
    test-only faults caught there too."""
    sim = Backend("sim", sim_ops, torch.device("cpu"))
    heads = [h for h in WMMA_HEADS["sim"] if h[2] == 256]
    with simulated(compute_capability=75):
        assert not attention_failures(sim, torch.float16, heads, WMMA_SEQUENCES["sim"], kernel="wmma")
        for fault in WMMA_FAULTS:
            with simulated(fault=fault):
                assert attention_failures(sim, torch.float16, heads, WMMA_SEQUENCES["sim"], kernel="wmma"), fault


def test_the_launcher_runs_the_kernel_the_rule_names(sim_ops):
    """With the tensor-core kernel broken (a test-only fault), exactly the calls dispatched to it go wrong."""
    sim = Backend("sim", sim_ops, torch.device("cpu"))
    heads = [(4, 1, 256, 16)]
    prefill, decode = [(9, 9), (7, 20)], [(1, 9), (1, 20), (1, 3)]
    with simulated(fault="wmma_skip_causal_mask"):
        assert attention_failures(sim, torch.float16, heads, prefill)  # auto -> wmma
        assert not attention_failures(sim, torch.float16, heads, prefill, kernel="simt")
        assert not attention_failures(sim, torch.float32, heads, prefill)  # auto -> simt
        with simulated(compute_capability=70):
            assert not attention_failures(sim, torch.bfloat16, heads, prefill)  # auto -> simt below sm_80
    assert not attention_failures(sim, torch.float16, heads, decode)


# ---- the reference against torch / transformers -------------------------------------------------
@pytest.mark.parametrize("q_len, ctx", [(50, 50), (7, 60), (1, 33)])
def test_reference_matches_torch_attention(q_len, ctx):
    hq, hkv, d, block_size = 16, 4, 64, 16
    sequences = [(q_len, ctx)]
    key_cache, value_cache, block_tables = make_cache(sequences, hkv, d, block_size, torch.float32, "cpu")
    fill_context(sequences, key_cache, value_cache, block_tables, torch.float32, "cpu")
    query = torch.randn(q_len, hq, d)
    ours = reference.paged_attention(
        query, key_cache, value_cache, cu_seqlens_of([q_len]), torch.tensor([ctx]), block_tables
    )
    keys = reference.gather_context(key_cache, block_tables[0], ctx)
    values = reference.gather_context(value_cache, block_tables[0], ctx)
    # Bottom-right aligned causal mask: query i sits at position ctx - q_len + i.
    mask = torch.ones(q_len, ctx, dtype=torch.bool).tril(diagonal=ctx - q_len)
    sdpa = F.scaled_dot_product_attention(
        query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask, enable_gqa=True
    ).transpose(0, 1)
    assert rel_err(ours, sdpa) < 1e-5
    qwen = qwen35_module()

    class _Module:  # eager_attention_forward reads these attributes
        num_key_value_groups = hq // hkv
        training = False

    additive = torch.zeros(q_len, ctx).masked_fill(~mask, float("-inf"))[None, None]
    eager, _ = qwen.eager_attention_forward(
        _Module(),
        query.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        additive,
        scaling=d**-0.5,
    )
    assert rel_err(ours, eager[0]) < 1e-5


# ---- bad arguments ------------------------------------------------------------------------------
def _good_args():
    sequences = [(2, 5), (3, 3)]
    key_cache, value_cache, block_tables = make_cache(sequences, 2, 16, 4, torch.float32, "cpu")
    fill_context(sequences, key_cache, value_cache, block_tables, torch.float32, "cpu")
    return dict(
        query=torch.randn(5, 4, 16),
        key_cache=key_cache,
        value_cache=value_cache,
        cu_seqlens_q=cu_seqlens_of([2, 3]),
        context_lens=torch.tensor([5, 3], dtype=torch.int32),
        block_tables=block_tables,
    )


@pytest.mark.parametrize(
    "change, error, words",
    [
        (dict(query=torch.zeros(5, 3, 16)), ValueError, "must be a multiple of num_kv_heads"),
        (dict(query=torch.zeros(5, 4, 32)), ValueError, "differs from the query's"),
        (dict(query=torch.zeros(5, 4, 16, dtype=torch.float16)), TypeError, "key_cache must be Half"),
        (
            dict(context_lens=torch.tensor([1, 3], dtype=torch.int32)),
            ValueError,
            "shorter than the sequence's 2 new queries",
        ),
        (dict(context_lens=torch.tensor([5, 99], dtype=torch.int32)), ValueError, "needs more than the block table's"),
        (dict(block_tables=torch.full((2, 4), -1, dtype=torch.int32)), ValueError, "is outside the cache's"),
        (dict(cu_seqlens_q=torch.tensor([0, 2, 4], dtype=torch.int32)), ValueError, "must equal the number of tokens"),
        (dict(block_tables=torch.zeros(3, 4, dtype=torch.int32)), ValueError, "block_tables must have shape"),
        (dict(kernel="tensor"), ValueError, "kernel must be 'auto', 'simt', 'wmma' or 'wmma2'"),
        (dict(kernel="wmma"), ValueError, "picks a CUDA kernel, but cpu tensors run the CPU implementation"),
    ],
)
def test_bad_arguments_raise_clear_errors(change, error, words):
    from clef_cuda.kernels import ops

    with pytest.raises(error) as info:
        ops.paged_attention(**(_good_args() | change))
    assert words in str(info.value)
    assert "paged_attention" in str(info.value)


def test_bad_cache_write_arguments():
    from clef_cuda.kernels import ops

    key = torch.randn(4, 2, 16)
    cache = torch.zeros(3, 4, 2, 16)
    with pytest.raises(ValueError, match="outside the cache's 12 slots"):
        ops.reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([0, 1, 2, 12]))
    with pytest.raises(ValueError, match="key_cache must have shape"):
        ops.reshape_and_cache(key, key, torch.zeros(3, 4, 1, 16), torch.zeros(3, 4, 1, 16), torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="slot_mapping must have shape"):
        ops.reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([0, 1]))


def test_cuda_launcher_rejects_uncompiled_head_dims(sim_ops):
    args = _good_args()
    args.update(query=torch.randn(5, 4, 24), key_cache=torch.zeros(4, 4, 2, 24), value_cache=torch.zeros(4, 4, 2, 24))
    args["block_tables"] = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="compiled for head dims"):
        sim_ops.paged_attention(**args)


def test_the_tile_rule_in_words_is_the_launchers():
    """clef_cuda.kernels.ops.paged_attention_tiles (what --plan prints for a GPU and benchmarks/card_plans.py
    uses) states the rule the launcher and scripts/check_archs.py apply."""
    from clef_cuda.kernels import ops

    assert ops.paged_attention_tiles(256, 75, 64 * 1024) == (
        "tensor cores: 16 keys a tile (55.00 KB); tensor cores v2: 16 keys a tile (61.25 KB); "
        "SIMT: 16 keys a tile (49.38 KB)"
    )
    assert ops.paged_attention_tiles(256, 70, 96 * 1024).startswith("tensor cores: 32 keys a tile (75.75 KB)")
    assert ops.paged_attention_tiles(256, 61, 48 * 1024) == "SIMT: 8 keys a tile (32.78 KB)"
    assert ops.paged_attention_tiles(32, 90, 227 * 1024) == "SIMT: 32 keys a tile (12.56 KB)"  # no WMMA at D = 32
    with pytest.raises(ValueError, match="head_dim 16, 32, 64, 128 and 256"):
        ops.paged_attention_tiles(96, 80, 163 * 1024)
