"""Helpers that build packed batches for the op tests."""

from __future__ import annotations

import torch


def cu_seqlens_of(lengths: list[int], device="cpu") -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def slot_plan(batch: int, num_slots: int, device="cpu", no_slot: tuple[int, ...] = ()) -> torch.Tensor:
    """Distinct slots in a shuffled order (so sequence b rarely owns slot b); sequences in `no_slot` get -1."""
    assert num_slots >= batch
    slots = torch.randperm(num_slots)[:batch].to(torch.int32)
    for b in no_slot:
        slots[b] = -1
    return slots.to(device)


def strided(t: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """The same values as t, as a view whose rows are not contiguous (a slice of a wider buffer), like the
    q|k|v bands of the conv output or in_proj slices."""
    wide = torch.full((*t.shape[:-1], t.shape[-1] + pad), float("nan"), dtype=t.dtype, device=t.device)
    wide[..., pad:] = t
    view = wide[..., pad:]
    assert not view.is_contiguous()
    return view


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))
