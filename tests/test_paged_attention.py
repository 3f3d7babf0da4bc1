"""reshape_and_cache / paged_attention: fast ops vs reference; reference vs torch's attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TOLERANCE, qwen35_module, rel_err
from packing import cu_seqlens_of, nan_like

from clef_cuda import reference

# Each sequence: (new queries, context length incl. them): fresh prefill, chunked prefill, prefix-cache
# hit (short chunk, long cached prefix), decode.
SEQUENCES = {
    "cpu": [(37, 37), (64, 200), (5, 300), (1, 129), (1, 1), (130, 130)],
    "cuda": [(37, 37), (64, 200), (5, 300), (1, 129), (1, 1), (130, 130)],
    "sim": [(9, 9), (3, 40), (1, 17)],
}
# (Hq, Hkv, D, block_size)
HEADS = {
    "cpu": [(16, 4, 256, 16), (8, 8, 64, 32), (4, 2, 128, 16), (6, 2, 24, 8)],
    "cuda": [(16, 4, 256, 16), (8, 8, 64, 32), (4, 2, 128, 16), (8, 1, 16, 8)],
    "sim": [(4, 1, 256, 16), (4, 2, 64, 8), (2, 2, 16, 4)],
}


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_attention_matches_reference(backend, dtype):
    sequences = SEQUENCES[backend.name]
    for hq, hkv, d, block_size in HEADS[backend.name]:
        key_cache, value_cache, block_tables = make_cache(sequences, hkv, d, block_size, dtype, backend.device)
        fill_context(sequences, key_cache, value_cache, block_tables, dtype, backend.device)
        query = packed_queries(sequences, hq, d, dtype, backend.device)
        cu = cu_seqlens_of([q for q, _ in sequences], backend.device)
        context_lens = torch.tensor([c for _, c in sequences], dtype=torch.int32, device=backend.device)
        out = backend.ops.paged_attention(
            query, key_cache, value_cache, cu, context_lens, block_tables, out=nan_like(query.contiguous())
        )
        expected = reference.paged_attention(
            query.cpu(), key_cache.cpu(), value_cache.cpu(), cu.cpu(), context_lens.cpu(), block_tables.cpu()
        )
        assert torch.isfinite(out).all(), (hq, hkv, d, "read outside a context or left an output unwritten")
        assert rel_err(out, expected) < TOLERANCE[dtype], (hq, hkv, d)


def test_custom_scale_and_empty_sequences(backend):
    hq, hkv, d, block_size = HEADS[backend.name][1]
    sequences = [(0, 5), (3, 7), (0, 0)]  # sequences with no new queries in the pack
    key_cache, value_cache, block_tables = make_cache(sequences, hkv, d, block_size, torch.float32, backend.device)
    fill_context(sequences, key_cache, value_cache, block_tables, torch.float32, backend.device)
    query = torch.randn(3, hq, d, device=backend.device)
    cu = cu_seqlens_of([0, 3, 0], backend.device)
    context_lens = torch.tensor([5, 7, 0], dtype=torch.int32, device=backend.device)
    out = backend.ops.paged_attention(query, key_cache, value_cache, cu, context_lens, block_tables, scale=0.05)
    expected = reference.paged_attention(query, key_cache, value_cache, cu, context_lens, block_tables, scale=0.05)
    assert rel_err(out, expected) < 1e-5


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


def test_chunked_prefill_and_decode_equal_full_causal_attention(backend):
    """Writing a sequence's KV chunk by chunk and attending each chunk over the cache == one causal pass."""
    hq, hkv, d, block_size = HEADS[backend.name][0]
    total = 90 if backend.name != "sim" else 14
    chunks = (40, 1, 33, 16) if backend.name != "sim" else (5, 1, 8)
    key_cache, value_cache, block_tables = make_cache(
        [(total, total)], hkv, d, block_size, torch.float32, backend.device
    )
    q = torch.randn(total, hq, d, device=backend.device)
    k = torch.randn(total, hkv, d, device=backend.device)
    v = torch.randn(total, hkv, d, device=backend.device)
    pieces, start = [], 0
    for n in chunks:
        slots = torch.tensor(slots_of(block_tables[0].cpu(), range(start, start + n), block_size), dtype=torch.int32)
        backend.ops.reshape_and_cache(
            k[start : start + n], v[start : start + n], key_cache, value_cache, slots.to(backend.device)
        )
        ctx = torch.tensor([start + n], dtype=torch.int32, device=backend.device)
        pieces.append(
            backend.ops.paged_attention(
                q[start : start + n], key_cache, value_cache, cu_seqlens_of([n], backend.device), ctx, block_tables
            )
        )
        start += n
    expected = F.scaled_dot_product_attention(
        q.cpu().transpose(0, 1), k.cpu().transpose(0, 1), v.cpu().transpose(0, 1), is_causal=True, enable_gqa=True
    ).transpose(0, 1)
    assert rel_err(torch.cat(pieces), expected) < 1e-5


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
    ],
)
def test_bad_arguments_raise_clear_errors(change, error, words):
    from clef_cuda import ops

    with pytest.raises(error) as info:
        ops.paged_attention(**(_good_args() | change))
    assert words in str(info.value)
    assert "paged_attention" in str(info.value)


def test_bad_cache_write_arguments():
    from clef_cuda import ops

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
