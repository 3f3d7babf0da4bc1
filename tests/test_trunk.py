"""The trunk on clef_cuda ops against transformers' Qwen3.5 (fp32, relative error < 1e-4): tiny random
configs with Hv = 2 Hk and several full-attention layers, records longer than one chunk, prefill split at
odd boundaries, and several sequences interleaved in the same packed steps."""

from __future__ import annotations

import pytest
import torch
from conftest import qwen35_module, rel_err

from clef_cuda.model.config import load_trunk_config
from clef_cuda.model.trunk import ChunkBatch, SequenceChunk, Trunk
from clef_cuda.model.trunk_cache import TrunkCache

BLOCK = 16

CONFIGS = {
    "upstream-tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
    "two-attention-layers": dict(
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=6,
        layer_types=["linear_attention", "full_attention"] * 3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    ),
    "equal-heads-wide-rotary": dict(
        hidden_size=80,
        intermediate_size=96,
        num_hidden_layers=5,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=40,
        linear_num_key_heads=3,
        linear_num_value_heads=3,
        linear_key_head_dim=24,
        linear_value_head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5},
    ),
}


def make_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """transformers' Qwen3_5ForCausalLM with random weights, plus our Trunk over the same tensors."""
    import json
    import tempfile
    from pathlib import Path

    from transformers import Qwen3_5TextConfig

    qwen = qwen35_module()
    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(vocab_size=300, initializer_range=0.1, **CONFIGS[name])
    model = qwen.Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight.normal_(0.0, 0.3)
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(-1.0, 1.5)
                layer.linear_attn.norm.weight.normal_(1.0, 0.2)
            else:
                layer.self_attn.q_norm.weight.normal_(0.0, 0.3)
    path = Path(tempfile.mkdtemp()) / "config.json"
    path.write_text(json.dumps(config.to_dict() | {"architectures": ["Qwen3_5ForCausalLM"]}))
    trunk_config, prefix = load_trunk_config(path)
    from clef_cuda.model.weights import serving_dtype_for

    weights = {}
    for key, tensor in model.state_dict().items():
        key = key[len(prefix) :] if key.startswith(prefix) else key
        weights[key] = tensor.detach().to(serving_dtype_for(key, dtype)).clone()
    return model, Trunk(trunk_config, weights, dtype), trunk_config


def expected_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.model(input_ids=ids[None], use_cache=False).last_hidden_state[0]


def blocks_for(length: int, first: int) -> list[int]:
    return list(range(first, first + -(-length // BLOCK)))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_sequence_prefilled_in_odd_chunks(name):
    model, trunk, config = make_model(name)
    length = 300
    ids = torch.randint(0, 300, (length,))
    cache = TrunkCache.allocate(config, num_slots=3, num_blocks=40, block_size=BLOCK, device="cpu", dtype=torch.float32)
    blocks = blocks_for(length, 5)
    outputs, start = [], 0
    for size in (1, 63, 64, 65, 107):  # odd boundaries, longer than one chunk in total
        chunk = SequenceChunk(ids[start : start + size].tolist(), start, 2, blocks)
        with torch.inference_mode():
            outputs.append(trunk.forward(ChunkBatch.build([chunk], BLOCK, "cpu"), cache))
        start += size
    assert rel_err(torch.cat(outputs), expected_hidden(model, ids)) < 1e-4


def test_interleaved_sequences_equal_separate_passes():
    """Three sequences of different lengths advance in the same packed steps, each with its own slot and
    blocks, starting at different steps: each equals its own single pass (batching does not leak)."""
    model, trunk, config = make_model("two-attention-layers", seed=1)
    lengths = [150, 37, 96]
    seqs = [torch.randint(0, 300, (n,)) for n in lengths]
    cache = TrunkCache.allocate(config, num_slots=4, num_blocks=64, block_size=BLOCK, device="cpu", dtype=torch.float32)
    slots, block_starts = [3, 0, 1], [40, 7, 20]
    schedule = [[(0, 50)], [(0, 33), (1, 20)], [(1, 17), (2, 64), (0, 40)], [(0, 27), (2, 32)]]
    position = [0, 0, 0]
    produced = [[], [], []]
    for step in schedule:
        chunks = []
        for s, size in step:
            tokens = seqs[s][position[s] : position[s] + size].tolist()
            chunks.append(SequenceChunk(tokens, position[s], slots[s], blocks_for(lengths[s], block_starts[s])))
        with torch.inference_mode():
            hidden = trunk.forward(ChunkBatch.build(chunks, BLOCK, "cpu"), cache)
        start = 0
        for s, size in step:
            produced[s].append(hidden[start : start + size])
            start += size
            position[s] += size
    assert position == lengths
    for s in range(3):
        assert rel_err(torch.cat(produced[s]), expected_hidden(model, seqs[s])) < 1e-4


def test_f16_overflow_is_reported_not_answered():
    from clef_cuda.errors import NumericalOverflowError

    _, trunk, config = make_model("upstream-tiny", dtype=torch.float16)
    trunk.layers[0].down = torch.full_like(trunk.layers[0].down, 60000.0)  # outputs past f16 65504: inf
    cache = TrunkCache.allocate(config, 1, 4, BLOCK, "cpu", torch.float16)
    chunk = SequenceChunk(list(range(20)), 0, 0, [0, 1])
    with pytest.raises(NumericalOverflowError, match="non-finite hidden states"):
        trunk.forward(ChunkBatch.build([chunk], BLOCK, "cpu"), cache)


def test_f16_trunk_tracks_fp32():
    """The serving-dtype path (f16 GEMMs, fp32 residual, norms and states) stays close to fp32."""
    model, trunk, config = make_model("two-attention-layers", dtype=torch.float16)
    ids = torch.randint(0, 300, (130,))
    cache = TrunkCache.allocate(config, 1, 16, BLOCK, "cpu", torch.float16)
    chunk = SequenceChunk(ids.tolist(), 0, 0, blocks_for(130, 0))
    with torch.inference_mode():
        hidden = trunk.forward(ChunkBatch.build([chunk], BLOCK, "cpu"), cache)
    assert rel_err(hidden, expected_hidden(model, ids)) < 2e-2
