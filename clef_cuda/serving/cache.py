"""Memory pools the trunk reads and writes: per-sequence state slots (the delta nets' conv history and
fp32 recurrent state) and the paged KV cache of the full-attention layers, with their allocators.

The trunk only indexes into these; which slot and which blocks a sequence owns is decided here (and, for
the server, by the engine on top of these allocators).
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


class FreeList:
    """Ids first .. first+n-1 handed out and returned; running out returns None (the caller decides to
    wait or fail)."""

    def __init__(self, n: int, first: int = 0) -> None:
        self._free = list(range(first + n - 1, first - 1, -1))
        self.capacity = n

    @property
    def available(self) -> int:
        return len(self._free)

    def take(self, count: int = 1) -> list[int] | None:
        if count > len(self._free):
            return None
        taken = self._free[-count:] if count else []
        del self._free[len(self._free) - count :]
        return taken[::-1]

    def give_back(self, ids: list[int]) -> None:
        self._free.extend(reversed(ids))


class BlockPool:
    """KV blocks with reference counts: a block returns to the free list when its last holder (a running
    sequence or a prefix-cache entry) lets go."""

    def __init__(self, num_blocks: int) -> None:
        self._free = FreeList(num_blocks)
        self._refs = [0] * num_blocks
        self.capacity = num_blocks

    @property
    def available(self) -> int:
        return self._free.available

    @property
    def used(self) -> int:
        return self.capacity - self._free.available

    def take(self, count: int) -> list[int] | None:
        blocks = self._free.take(count)
        if blocks is not None:
            for b in blocks:
                self._refs[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            self._refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        freed = []
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                freed.append(b)
        self._free.give_back(freed)


@dataclass
class PrefixEntry:
    """What a later record with the same first `length` tokens can reuse instead of recomputing them."""

    tokens: tuple[int, ...]  # the prefix itself (hash collisions are checked, not trusted)
    digests: tuple[bytes, ...]  # of the images among those tokens: same-size images have the same tokens
    blocks: list[int]  # KV blocks holding positions [0, length)
    snapshot_slot: int  # a state slot holding every delta net's conv and recurrent state after `length`
    memory: torch.Tensor  # the head's memory rows [length, width]
    span_sums: dict[tuple[int, int], torch.Tensor]  # head span sums over [start, min(end, length))
    bytes: int

    @property
    def length(self) -> int:
        return len(self.tokens)


class PrefixCache:
    """Prefix snapshots keyed by a hash of their tokens, evicted least-recently-used first."""

    def __init__(self) -> None:
        from collections import OrderedDict

        self._entries: OrderedDict[bytes, PrefixEntry] = OrderedDict()
        self.hits = self.misses = self.evictions = 0

    @staticmethod
    def key(tokens: tuple[int, ...] | list[int], digests: tuple[bytes, ...] = ()) -> bytes:
        """Tokens and image digests: two images of one size give the same tokens, never the same key."""
        import hashlib
        from array import array

        key = hashlib.blake2b(array("i", tokens).tobytes(), digest_size=16)
        for digest in digests:
            key.update(digest)
        return key.digest()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes, tokens: tuple[int, ...], digests: tuple[bytes, ...] = ()) -> PrefixEntry | None:
        entry = self._entries.get(key)
        if entry is None or entry.tokens != tokens or entry.digests != digests:
            return None
        self._entries.move_to_end(key)
        return entry

    def put(self, key: bytes, entry: PrefixEntry) -> None:
        self._entries[key] = entry
        self._entries.move_to_end(key)

    def pop_where(self, predicate) -> list[PrefixEntry]:
        """Take out every entry `predicate` accepts (an unloaded variant's)."""
        keys = [key for key, entry in self._entries.items() if predicate(entry)]
        return [self._entries.pop(key) for key in keys]

    def pop_oldest(self) -> PrefixEntry | None:
        if not self._entries:
            return None
        _, entry = self._entries.popitem(last=False)
        self.evictions += 1
        return entry

    @property
    def bytes(self) -> int:
        return sum(e.bytes for e in self._entries.values())

    @property
    def blocks_held(self) -> int:
        """Distinct blocks the entries hold (a state-end entry's blocks are a prefix of the schema-end one's)."""
        return len({b for e in self._entries.values() for b in e.blocks})


class VisionCache:
    """Vision-tower outputs by image digest, least recently used evicted past `capacity_bytes`: a repeated
    image skips the tower."""

    def __init__(self, capacity_bytes: int) -> None:
        from collections import OrderedDict

        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, digest: bytes) -> torch.Tensor | None:
        rows = self._entries.get(digest)
        if rows is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(digest)
        return rows

    def put(self, digest: bytes, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        if size > self.capacity_bytes or digest in self._entries:
            return
        self._entries[digest] = rows
        self.bytes += size
        while self.bytes > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
