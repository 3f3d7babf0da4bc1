"""The vocabulary tables in host memory: token embeddings and the LM-head rows the joint head reads.

clef-flash has two 248,320 x 4,096 tables (1.9 GiB each in f16, 0.95 GiB at int8) that are only ever read by
rows: a step's tokens (the embedding lookup) and a record's option tokens (the head's lexical vectors). On a
12-16 GB card they are the difference between fitting and not, so `--vocab-tables host` keeps them in pinned
host memory and gathers the rows a step needs there, copying them to the device over PCIe: at most a step's
tokens x 8 KiB (f16; 4 KiB at int8, dequantized on the device by the trunk's own op), on a copy stream of
its own so it overlaps the device's work still queued. The rows are the same bits as a device table's,
so the answers are identical (tests/test_vocab_tables.py).
"""

from __future__ import annotations

import torch

from clef_cuda.model.quantize import Int8Weight

Tensor = torch.Tensor


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
                from clef_cuda import ops
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
