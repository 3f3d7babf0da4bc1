"""The trunk's device memory: per-sequence state slots (the delta nets' conv history and fp32 recurrent
state) and the paged KV cache of the full-attention layers.

The trunk only indexes into these pools; which slot and which blocks a sequence owns is decided by the
caller (clef_cuda.decider for one record, the engine's allocators and prefix cache in clef_cuda.serving).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clef_cuda.model.config import TrunkConfig


@dataclass
class TrunkCache:
    conv_states: torch.Tensor  # [linear layers, slots, conv_dim, K-1], serving dtype: raw conv inputs
    gdr_states: torch.Tensor  # [linear layers, slots, Hv, Dk, Dv], fp32
    key_cache: torch.Tensor  # [attention layers, blocks, block_size, Hkv, D], serving dtype
    value_cache: torch.Tensor
    block_size: int
    name: str = "engine"  # which pool, to the other tensor-parallel ranks (Trunk.allocate_cache)

    @property
    def num_slots(self) -> int:
        return self.gdr_states.shape[1]

    @property
    def num_blocks(self) -> int:
        return self.key_cache.shape[1]

    @staticmethod
    def slot_bytes(config: TrunkConfig, dtype: torch.dtype) -> int:
        """Bytes one sequence's state slot takes across all delta-net layers."""
        conv = config.conv_dim * (config.linear_conv_kernel_dim - 1) * torch.finfo(dtype).bits // 8
        rule = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
        return len(config.linear_layers) * (conv + rule)

    @staticmethod
    def block_bytes(config: TrunkConfig, dtype: torch.dtype, block_size: int) -> int:
        """Bytes one KV block takes across all attention layers (keys and values)."""
        per_token = 2 * config.num_key_value_heads * config.head_dim * torch.finfo(dtype).bits // 8
        return len(config.attention_layers) * block_size * per_token

    @classmethod
    def allocate(
        cls,
        config: TrunkConfig,
        num_slots: int,
        num_blocks: int,
        block_size: int,
        device,
        dtype: torch.dtype,
        layers: tuple[int, int] | None = None,
    ) -> TrunkCache:
        """Zeroed pools for every layer, or for `layers` = (delta-net layers, attention layers) only (the
        self-check runs one layer of each kind on a pool of its own)."""
        linear, attention = layers or (len(config.linear_layers), len(config.attention_layers))
        k = config.linear_conv_kernel_dim
        kv_shape = (attention, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        return cls(
            conv_states=torch.zeros(linear, num_slots, config.conv_dim, k - 1, dtype=dtype, device=device),
            gdr_states=torch.zeros(
                linear,
                num_slots,
                config.linear_num_value_heads,
                config.linear_key_head_dim,
                config.linear_value_head_dim,
                dtype=torch.float32,
                device=device,
            ),
            key_cache=torch.zeros(kv_shape, dtype=dtype, device=device),
            value_cache=torch.zeros(kv_shape, dtype=dtype, device=device),
            block_size=block_size,
        )
