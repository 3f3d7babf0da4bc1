"""The vocabulary tables in host memory: token embeddings and the LM-head rows the joint head reads.

clef-flash has two 248,320 x 4,096 tables (1.9 GiB each in f16, 0.95 GiB at int8) that are only ever read by
rows: a step's tokens (the embedding lookup) and a record's option tokens (the head's lexical vectors). On a
12-16 GB card they are the difference between fitting and not, so `--vocab-tables host` keeps them in pinned
host memory and gathers the rows a step needs there, copying them to the device over PCIe: at most a step's
tokens x 8 KiB (f16; 4 KiB at int8, dequantized on the device by the trunk's own op), on a copy stream of
its own so it overlaps the device's work still queued. The rows are the same bits as a device table's,
so the answers are identical (tests/test_vocab_tables.py).

Under tensor parallel each rank holds a share of the rows (VocabShard: rank r the r-th ceil(vocab / N) of
them, on its device or, with `--vocab-tables host`, in its host memory): a lookup gathers the rows a rank
holds, zeros for the others', and one all-reduce sums the shares. Exactly one rank adds a non-zero row and
x + 0 is x in every float format, so the sum is the same bits as one whole table's row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from clef_cuda.model.quantize import Int8Weight

Tensor = torch.Tensor
VOCAB_TABLES = ("embed_tokens.weight", "lm_head.weight")  # their checkpoint names (relative to the text model)


def vocab_part(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """Rank `rank` of `size`'s rows [start, end) of a vocab_size-row table: ceil(vocab / size) rows a rank, the
    last rank's share the rest (a vocabulary need not divide)."""
    per = -(-vocab_size // size)
    return min(rank * per, vocab_size), min((rank + 1) * per, vocab_size)


class HostTable:
    """A [vocab, hidden] table (a tensor, or an Int8Weight) in host memory, read by rows onto `device`.

    Duck-types a device table's uses: `shape`, `dtype` (of the rows it returns), `device` (where the rows go:
    the serving device), `table[ids]` and `rows(ids, ops)`."""

    def __init__(self, table: Tensor | Int8Weight, device: torch.device | str) -> None:
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        if isinstance(table, Int8Weight):
            qweight, scale = table.qweight.cpu(), table.scale.cpu()
            self.table = Int8Weight(
                qweight.pin_memory() if pin else qweight, scale.pin_memory() if pin else scale, table.dtype
            )
        else:
            table = table.cpu()
            self.table = table.pin_memory() if pin else table
        self._copy_stream = torch.cuda.Stream(self.device) if pin else None

    @property
    def shape(self) -> torch.Size:
        return self.table.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.table.dtype

    @property
    def quantized(self) -> bool:
        return isinstance(self.table, Int8Weight)

    def nbytes(self) -> int:
        """Host bytes it holds."""
        if isinstance(self.table, Int8Weight):
            return self.table.qweight.numel() + 4 * self.table.scale.numel()
        return self.table.numel() * self.table.element_size()

    def rows(self, ids: Tensor, ops=None) -> Tensor:
        """Rows `ids` (int64 [n], host or device) on the device: [n, hidden] in `dtype`. Host ids (the trunk
        passes the chunk's) need no device-to-host copy; int8 rows are dequantized on the device by `ops`."""
        ids = ids.cpu() if ids.device.type != "cpu" else ids
        if isinstance(self.table, Int8Weight):
            if ops is None:
                from clef_cuda.kernels import ops
            q = self._to_device(self._gather(self.table.qweight, ids))
            s = self._to_device(self._gather(self.table.scale, ids))
            return ops.dequantize_int8(q, s, dtype=self.table.dtype)
        return self._to_device(self._gather(self.table, ids))

    def __getitem__(self, ids: Tensor) -> Tensor:
        return self.rows(ids)

    def _gather(self, source: Tensor, ids: Tensor) -> Tensor:
        """source[ids] into (pinned, on a GPU) host memory: the staging a non-blocking copy needs."""
        out = torch.empty(
            (ids.numel(), *source.shape[1:]), dtype=source.dtype, pin_memory=self._copy_stream is not None
        )
        return torch.index_select(source, 0, ids.to(torch.int64), out=out)

    def _to_device(self, staged: Tensor) -> Tensor:
        if self._copy_stream is None:
            return staged
        # On the copy stream, so the transfer overlaps the work queued before it; the consumer's stream waits
        # for it, and the caching allocators keep both buffers until the copy is done with them (the host one
        # records the copy stream's event; the device one the consumer's use).
        consumer = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._copy_stream):  # the staging buffer is fresh: nothing to wait for
            rows = staged.to(self.device, non_blocking=True)
        consumer.wait_stream(self._copy_stream)
        rows.record_stream(consumer)
        return rows


class VocabShard:
    """One tensor-parallel rank's rows [start, start + rows) of a [vocab, hidden] table (`local`: a tensor, an
    Int8Weight or a HostTable), read by whole rows all the same.

    partial_rows(ids) is this rank's share of the rows (its own, zeros for the others'): summed over the ranks
    (an all-reduce) it is the whole rows; the trunk does that inside its forward. rows(ids) / table[ids] return
    the whole rows at once: `gather` (set by the trunk that owns the table: a call every rank makes, so that
    each adds its share) does it; the joint head reads its options' LM-head rows so."""

    def __init__(self, local: Tensor | Int8Weight | HostTable, start: int, vocab_size: int) -> None:
        self.local, self.start, self.vocab_size = local, start, vocab_size
        self.gather: Callable[[Tensor], Tensor] | None = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.vocab_size, self.local.shape[1]))

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        """Where the rows go (the serving device)."""
        return self.local.device

    @property
    def end(self) -> int:
        return self.start + self.local.shape[0]

    def partial_rows(self, ids: Tensor, ops=None) -> Tensor:
        """[n, hidden] on the device in `dtype`: row ids[i] where this rank holds it, zeros where another does."""
        if ops is None:
            from clef_cuda.kernels import ops
        if self.local.shape[0] == 0:  # rank 0 may hold no rows (clef_cuda.model.footprint.vocab_split)
            return torch.zeros(ids.shape[0], self.shape[1], dtype=self.dtype, device=self.device)
        mine = (ids >= self.start) & (ids < self.end)
        local_ids = torch.where(mine, ids - self.start, torch.zeros_like(ids))  # row 0 stands in, then zeroed
        if isinstance(self.local, HostTable | Int8Weight):
            rows = self.local.rows(local_ids, ops)
        else:
            rows = self.local[local_ids.to(self.local.device)]
        return rows.masked_fill_(~mine.to(rows.device).unsqueeze(1), 0)

    def rows(self, ids: Tensor, ops=None) -> Tensor:
        """The whole rows `ids`, summed over the ranks by `gather`."""
        if self.gather is None:
            raise RuntimeError("a vocabulary shard read whole before its trunk joined the tensor-parallel group")
        return self.gather(ids)

    def __getitem__(self, ids: Tensor) -> Tensor:
        return self.rows(ids)
