"""The vocabulary tables in host memory (--vocab-tables host, clef_cuda.model.vocab_tables): the embedding and
LM-head rows a step or a record needs, gathered there and copied to the device, are the same bits as a device
table's, so the answers are identical to the device placement's, with int8 weights too; the tables leave the
device's weight bytes; the placement names are checked."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import cuda_available
from random_requests import random_request
from releases import mid_release, tiny_release

from clef_cuda import Decider
from clef_cuda.model.footprint import host_table_bytes
from clef_cuda.model.vocab_tables import HostTable


def probabilities(decider: Decider, requests) -> list:
    return [decider.probabilities(decider.encode(r)) for r in requests]


@pytest.mark.parametrize("quantize", ["none", "int8"])
@pytest.mark.parametrize("release", ["upstream-tiny", "mid"])
def test_host_tables_answer_exactly_as_device_tables(release, quantize):
    path = {"upstream-tiny": tiny_release, "mid": mid_release}[release]()
    requests = [random_request(random.Random(seed), state_words=(20, 300)) for seed in range(4)]
    on_device = Decider.from_release(path, device="cpu", progress=False, quantize=quantize)
    on_host = Decider.from_release(path, device="cpu", progress=False, quantize=quantize, vocab_tables="host")
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
    """Pinned host memory and the copy stream: the same bits as the device tables, on the GPU."""
    path = mid_release()
    requests = [random_request(random.Random(seed), state_words=(20, 300)) for seed in range(4)]
    on_device = Decider.from_release(path, device="cuda", progress=False, quantize=quantize)
    on_host = Decider.from_release(path, device="cuda", progress=False, quantize=quantize, vocab_tables="host")
    assert (
        on_host.trunk.embed.table.qweight.is_pinned() if quantize == "int8" else on_host.trunk.embed.table.is_pinned()
    )
    assert probabilities(on_host, requests) == probabilities(on_device, requests)
    assert torch.cuda.memory_allocated() > 0
