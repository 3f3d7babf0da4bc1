"""Tensor-parallel shards of the trunk: which part of each checkpoint tensor a rank holds, and the trunk
config a rank runs (its heads and MLP columns).

Every layer is split by heads so that nothing but its output crosses ranks (one all-reduce after each mixer and
each MLP; clef_cuda.parallel.tensor_parallel runs the ranks):
  delta net   key heads and their value heads: in_proj_qkv by its q, k and v bands, in_proj_z / b / a and the
              conv's channels, A_log and dt_bias by value head (column-parallel: rows of the weights);
              out_proj by its input columns (row-parallel). Each rank's recurrent state is its own value heads'
              (value heads / N, Dk, Dv): the recurrence never talks across ranks.
  attention   query heads with their KV heads: q_proj (each head's query and gate rows), k_proj, v_proj by
              rows; o_proj by columns. Each rank's KV blocks hold its own KV heads.
  MLP         gate_proj and up_proj by rows (intermediate columns), down_proj by columns.
Norm gains are replicated. The embedding and LM-head tables are split by rows (vocab-parallel,
clef_cuda.model.vocab_tables.VocabShard): each rank looks up the rows it holds and one all-reduce sums the
shares, for a step's tokens as for the head's option rows. The joint head is rank 0's alone (it runs it on the
hidden states the all-reduces made whole); the vision tower is the last rank's (tower_rank: another card than
the head's whenever there are two; rank 0 sends it the prepared images and gets the features back in host
memory). Those two ranks take fewer of the tables' rows (clef_cuda.model.footprint.vocab_split: the ranks'
weights as equal as they can be).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from clef_cuda.model.config import TrunkConfig
from clef_cuda.model.vocab_tables import VOCAB_TABLES, vocab_part

TENSOR_PARALLEL_SIZES = (1, 2, 4)


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int
    vocab: tuple[int, int] | None = None  # its rows [start, end) of the vocabulary tables (None: an even split)

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        return self.vocab if self.vocab is not None else vocab_part(vocab_size, self.rank, self.size)

    @property
    def holds_head(self) -> bool:
        return self.rank == 0

    @property
    def holds_tower(self) -> bool:
        return self.rank == tower_rank(self.size)

    def part(self, count: int) -> tuple[int, int]:
        """This rank's [start, end) of `count` things split evenly."""
        per = count // self.size
        return self.rank * per, (self.rank + 1) * per


def tower_rank(size: int) -> int:
    """The rank that holds and runs the vision tower over `size` ranks: the last, so that the tower and the joint
    head (rank 0's), the two largest parts outside the trunk, are on different cards whenever there are two."""
    return size - 1


def check_shardable(config: TrunkConfig, size: int) -> None:
    """ValueError, naming the count, when the trunk does not split over `size` ranks."""
    if size not in TENSOR_PARALLEL_SIZES:
        raise ValueError(f"--tensor-parallel-size must be one of 1, 2, 4, got {size}")
    counts = {
        "attention heads (num_attention_heads)": config.num_attention_heads,
        "KV heads (num_key_value_heads)": config.num_key_value_heads,
        "delta-net key heads (linear_num_key_heads)": config.linear_num_key_heads,
        "delta-net value heads (linear_num_value_heads)": config.linear_num_value_heads,
        "MLP columns (intermediate_size)": config.intermediate_size,
    }
    for name, count in counts.items():
        if count % size:
            raise ValueError(f"--tensor-parallel-size {size} does not divide the model's {count} {name}")


def local_config(config: TrunkConfig, size: int) -> TrunkConfig:
    """The trunk one of `size` ranks runs: its share of every head count and of the MLP's columns."""
    check_shardable(config, size)
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // size,
        num_key_value_heads=config.num_key_value_heads // size,
        linear_num_key_heads=config.linear_num_key_heads // size,
        linear_num_value_heads=config.linear_num_value_heads // size,
        intermediate_size=config.intermediate_size // size,
    )


# How a rank reads its part of a tensor: rows(start, end) and cols(start, end) of the stored [out, in] tensor
# (safetensors' get_slice reads only those bytes), whole() for a replicated one.
class TensorReader:
    def __init__(self, rows: Callable, cols: Callable, whole: Callable) -> None:
        self.rows, self.cols, self.whole = rows, cols, whole

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorReader:
        return cls(lambda a, b: tensor[a:b], lambda a, b: tensor[:, a:b], lambda: tensor)


def shard_tensor(key: str, reader: TensorReader, config: TrunkConfig, shard: Shard) -> torch.Tensor:
    """Rank `shard`'s part of trunk tensor `key` (a name relative to the text model, as in trunk_shapes)."""
    if key in VOCAB_TABLES:
        return reader.rows(*shard.vocab_rows(config.vocab_size))
    name = key.split(".", 2)[-1] if key.startswith("layers.") else key
    c = config
    dk, dv, d = c.linear_key_head_dim, c.linear_value_head_dim, c.head_dim
    k0, k1 = shard.part(c.linear_num_key_heads)
    v0, v1 = shard.part(c.linear_num_value_heads)
    q0, q1 = shard.part(c.num_attention_heads)
    h0, h1 = shard.part(c.num_key_value_heads)
    i0, i1 = shard.part(c.intermediate_size)

    def bands() -> torch.Tensor:  # q | k | v bands of in_proj_qkv and the conv: the rank's heads of each
        key_dim = c.key_dim
        parts = [
            reader.rows(k0 * dk, k1 * dk),
            reader.rows(key_dim + k0 * dk, key_dim + k1 * dk),
            reader.rows(2 * key_dim + v0 * dv, 2 * key_dim + v1 * dv),
        ]
        return torch.cat(parts)

    by_name: dict[str, Callable[[], torch.Tensor]] = {
        "linear_attn.in_proj_qkv.weight": bands,
        "linear_attn.conv1d.weight": bands,
        "linear_attn.in_proj_z.weight": lambda: reader.rows(v0 * dv, v1 * dv),
        "linear_attn.in_proj_b.weight": lambda: reader.rows(v0, v1),
        "linear_attn.in_proj_a.weight": lambda: reader.rows(v0, v1),
        "linear_attn.A_log": lambda: reader.rows(v0, v1),
        "linear_attn.dt_bias": lambda: reader.rows(v0, v1),
        "linear_attn.out_proj.weight": lambda: reader.cols(v0 * dv, v1 * dv),
        "self_attn.q_proj.weight": lambda: reader.rows(q0 * 2 * d, q1 * 2 * d),
        "self_attn.k_proj.weight": lambda: reader.rows(h0 * d, h1 * d),
        "self_attn.v_proj.weight": lambda: reader.rows(h0 * d, h1 * d),
        "self_attn.o_proj.weight": lambda: reader.cols(q0 * d, q1 * d),
        "mlp.gate_proj.weight": lambda: reader.rows(i0, i1),
        "mlp.up_proj.weight": lambda: reader.rows(i0, i1),
        "mlp.down_proj.weight": lambda: reader.cols(i0, i1),
    }
    take = by_name.get(name)
    return take() if take is not None else reader.whole()  # norms: replicated
