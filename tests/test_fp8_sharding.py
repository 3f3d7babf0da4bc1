"""fp8 block-quantized releases under tensor parallelism (clef_cuda.model.fp8.Fp8Weight): each rank reads only its
part of every fp8 weight and the scales of the blocks that part touches, and dequantizes just that; the parts are
bit for bit the whole weight dequantized, then sharded. Blocks that straddle the ranks' boundaries included."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from releases import tp4_release
from safetensors.torch import load_file, save_file
from test_publishing_variants import MAIN_FILE, fp8_pair

from clef_cuda.errors import ReleaseError
from clef_cuda.model import weights
from clef_cuda.model.config import load_release_config
from clef_cuda.model.shard import Shard, TensorReader, shard_tensor
from clef_cuda.model.vocab_tables import VOCAB_TABLES
from clef_cuda.model.weights import load_release_weights

# tp4_release's rows and columns split into parts of 16 to 64 (heads of 16, 40 MLP columns per rank of 4):
# blocks of 24 x 36 straddle most of the ranks' boundaries; 128 x 128 puts a whole small weight in one block.
BLOCKS = [(24, 36), (128, 128)]


@pytest.fixture(scope="module", params=BLOCKS, ids=lambda block: f"{block[0]}x{block[1]}")
def fp8_release(request, tmp_path_factory):
    quantized, _ = fp8_pair(tmp_path_factory.mktemp("fp8"), request.param, source=tp4_release())
    return quantized


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_dequantizes_its_part_bit_for_bit_as_the_whole_then_sharded(fp8_release, size):
    config = load_release_config(fp8_release)
    whole = load_release_weights(fp8_release, config, progress=False).trunk  # dequantized whole
    for rank in range(size):
        shard = Shard(rank, size)
        ours = load_release_weights(fp8_release, config, progress=False, shard=shard).trunk
        for key, tensor in whole.items():
            if key in VOCAB_TABLES:
                continue
            expected = shard_tensor(key, TensorReader.of(tensor), config.trunk, shard)
            assert torch.equal(ours[key], expected), (rank, key)


class CountingFile:
    """A safetensors file (weights._open's handle) that counts the elements read of each tensor."""

    def __init__(self, handle, reads: Counter) -> None:
        self.handle, self.reads = handle, reads

    def __enter__(self) -> CountingFile:
        self.handle.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.handle.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        tensor = self.handle.get_tensor(name)
        self.reads[name] += tensor.numel()
        return tensor

    def get_slice(self, name: str) -> CountingSlice:
        return CountingSlice(self.handle.get_slice(name), name, self.reads)


class CountingSlice:
    def __init__(self, piece, name: str, reads: Counter) -> None:
        self.piece, self.name, self.reads = piece, name, reads

    def get_shape(self) -> list[int]:
        return self.piece.get_shape()

    def __getitem__(self, index) -> torch.Tensor:
        tensor = self.piece[index]
        self.reads[self.name] += tensor.numel()
        return tensor


@pytest.mark.parametrize("size", [2, 4])
def test_a_rank_reads_only_its_part_of_each_fp8_weight_and_of_its_scales(fp8_release, monkeypatch, size):
    """Counting the elements each rank reads from the files: of every fp8 weight exactly the part it holds (the
    ranks together read each element once: no rank ever has a whole weight to dequantize), and of the scales
    less than all of them (4 ranks: the blocks its parts touch)."""
    config = load_release_config(fp8_release)
    stored = load_file(str(fp8_release / MAIN_FILE))
    fp8_names = [name for name in stored if name + "_scale_inv" in stored]
    open_file = weights._open
    total = Counter()
    for rank in range(size):
        reads: Counter = Counter()
        monkeypatch.setattr(weights, "_open", lambda path, reads=reads: CountingFile(open_file(path), reads))
        ours = load_release_weights(fp8_release, config, progress=False, shard=Shard(rank, size)).trunk
        for name in fp8_names:
            assert reads[name] == ours[name.removeprefix(config.weight_prefix)].numel(), (rank, name)
        scales_read = sum(reads[name + "_scale_inv"] for name in fp8_names)
        scales = sum(stored[name + "_scale_inv"].numel() for name in fp8_names)
        assert 0 < scales_read <= scales and (size == 2 or scales_read < scales), (rank, scales_read, scales)
        total.update(reads)
    for name in fp8_names:
        assert total[name] == stored[name].numel(), name


@pytest.mark.parametrize("size", [1, 2])
def test_scales_that_do_not_tile_the_weight_are_refused_naming_it(tmp_path, size):
    quantized, _ = fp8_pair(tmp_path, (24, 36), source=tp4_release())
    tensors = load_file(str(quantized / MAIN_FILE))
    name = "model.language_model.layers.0.mlp.up_proj.weight_scale_inv"
    tensors[name] = tensors[name][:-1]  # one block row short
    save_file(tensors, str(quantized / MAIN_FILE))
    shard = Shard(0, size) if size > 1 else None
    with pytest.raises(ReleaseError, match=r"up_proj\.weight: its scales have shape \[6, 3\]; .* needs \[7, 3\]"):
        load_release_weights(quantized, load_release_config(quantized), progress=False, shard=shard)
