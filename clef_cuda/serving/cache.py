"""The server's cache policies over the trunk's memory (clef_cuda.model.trunk_cache): allocators for its
state slots and KV blocks (blocks reference-counted, shared by running sequences and cached prefixes),
the prefix cache (which snapshots of which token prefixes are kept, LRU) and the vision cache (tower
outputs by image digest). The engine decides with these which slot and blocks a sequence owns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
