"""The vocabulary tables in host memory (--vocab-tables host, clef_cuda.model.vocab_tables): the embedding and
LM-head rows a step or a record needs, gathered there and copied to the device, are the same bits as a device
table's, so the answers are identical to the device placement's, with int8 weights too; the tables leave the
device's weight bytes; the placement names are checked. Under tensor parallel each rank holds a share of the
rows (VocabShard): the shares sum, exactly, to the whole table's rows, for any split (rank 0 holding none)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import cuda_available
from random_requests import random_request
from releases import TINY_PAST_TRAINING, mid_release, tiny_release

from clef_cuda import Decider
from clef_cuda.kernels import ops
from clef_cuda.model.footprint import host_table_bytes
from clef_cuda.model.quantize import quantize_int8
from clef_cuda.model.vocab_tables import HostTable, VocabShard


def probabilities(decider: Decider, requests) -> list:
    return [decider.probabilities(decider.encode(r)) for r in requests]


@pytest.mark.parametrize("quantize", ["none", "int8"])
@pytest.mark.parametrize("release", ["upstream-tiny", "mid"])
def test_host_tables_answer_exactly_as_device_tables(release, quantize):
    path = {"upstream-tiny": tiny_release, "mid": mid_release}[release]()
    requests = [random_request(random.Random(seed), state_words=(20, 300)) for seed in range(4)]
    long = TINY_PAST_TRAINING if release == "upstream-tiny" else {}  # its 300 words pass the 4,096 it declares
    on_device = Decider.from_release(path, device="cpu", progress=False, quantize=quantize, **long)
    on_host = Decider.from_release(path, device="cpu", progress=False, quantize=quantize, vocab_tables="host", **long)
    assert isinstance(on_host.trunk.embed, HostTable) and not isinstance(on_device.trunk.embed, HostTable)
    assert probabilities(on_host, requests) == probabilities(on_device, requests)
    assert on_host.weight_bytes()["embeddings"] == 0 < on_device.weight_bytes()["embeddings"]
    assert host_table_bytes(on_host.trunk) == on_device.weight_bytes()["embeddings"]


def test_an_unknown_placement_is_refused():
    with pytest.raises(ValueError, match="vocab_tables must be one of"):
        Decider.from_release(tiny_release(), device="cpu", progress=False, vocab_tables="disk")


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_available(), reason="needs a GPU and the CUDA build")
@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_host_tables_answer_exactly_as_device_tables_on_the_gpu(quantize):
    """Pinned host memory and the copy stream: the same bits as the device tables, on the GPU. int8 tables
    quantized on the host and on the device must be the same bits (on an H200 they were not: 5.2e-4 apart)."""
    path = mid_release()
    requests = [random_request(random.Random(seed), state_words=(20, 300)) for seed in range(4)]
    on_device = Decider.from_release(path, device="cuda", progress=False, quantize=quantize)
    on_host = Decider.from_release(path, device="cuda", progress=False, quantize=quantize, vocab_tables="host")
    assert (
        on_host.trunk.embed.table.qweight.is_pinned() if quantize == "int8" else on_host.trunk.embed.table.is_pinned()
    )
    assert probabilities(on_host, requests) == probabilities(on_device, requests)
    assert torch.cuda.memory_allocated() > 0


@pytest.mark.parametrize("kind", ["tensor", "int8", "host", "host int8"])
@pytest.mark.parametrize(
    "split", [(0, 50, 101), (0, 0, 101), (0, 34, 68, 101)], ids=["halves", "rank 0 none", "thirds"]
)
def test_vocab_shards_sum_to_the_whole_tables_rows(kind, split):
    """What the ranks' all-reduce adds: each shard's partial rows (its own, zeros for the others'); the sum is
    the whole table's rows, the same bits (one non-zero term a row), at every boundary of the split."""
    torch.manual_seed(0)
    table = torch.randn(101, 24, dtype=torch.float16)
    whole = quantize_int8(table, torch.float16) if "int8" in kind else table
    ids = torch.tensor([0, 1, 33, 34, 49, 50, 67, 68, 99, 100, 50, 0, 100])
    expected = whole.rows(ids, ops) if "int8" in kind else whole[ids]
    total = torch.zeros_like(expected)
    for start, end in zip(split, split[1:], strict=False):
        local = table[start:end]
        if "int8" in kind:  # the rank quantizes its own rows: per-row scales, the whole table's
            local = quantize_int8(local, torch.float16)
        if "host" in kind:
            local = HostTable(local, "cpu")
        shard = VocabShard(local, start, 101)
        part = shard.partial_rows(ids)
        mine = (ids >= start) & (ids < end)
        assert part.shape == expected.shape and not part[~mine].any()
        total += part
    assert torch.equal(total, expected)


def test_a_vocab_shard_is_read_whole_only_through_its_trunk():
    shard = VocabShard(torch.zeros(3, 4), 0, 6)
    with pytest.raises(RuntimeError, match="before its trunk joined"):
        shard[torch.tensor([1])]
