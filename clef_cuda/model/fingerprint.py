"""Layer fingerprints: what each layer of the trunk computed for one record, in a few KiB.

Comparing a served record's final probabilities with the reference's is the blunt end: a softmax near 0 or 1
hides most of a wrong layer, and it cannot say which layer went wrong. So for a record sampled for shadow
verification, the served pass keeps, per layer, a sketch of the mixer's output (the delta net's or the
attention's) and of the MLP's, at a few positions spread over the record and its last token; the shadow run
computes the same sketches on the reference ops, and the two are compared layer by layer (clef_cuda.serving
.shadow names the first layer whose sketch differs by more than its tolerance).

The sketch is a count sketch: each hidden coordinate is added, with a random sign, into one of SKETCH_WIDTH
buckets (a fixed seed, so the served pass and the shadow run use the same one), which keeps the vector's norm
in expectation. Two sketches are compared by their drift, ||served - reference|| / ||reference|| over every
bucket and position: how far the layer's output moved as a whole. (The worst single bucket relative to its
position's scale was tried too: on healthy records it swung 10-100x wider than the drift, from positions where
a layer's output is near zero, so it saw less, not more.)

The drift sees a whole layer gone wrong, and each layer is judged against the drift of the input it was handed
(clef_cuda.serving.shadow), but a fault confined to a few channels (an int8 row scale off by 5%) or to a norm
(whose input and output are both the trunk's, so its error reads as the next block's input drift) can hide in
rounding. Position-wise parts can be checked on their own, with nothing upstream accumulated: the served pass
also keeps, whole, at the sketched positions, the residual stream after each norm's add and each norm's output
(the MLP's input is the post-mixer norm's output) and the MLP's output; the shadow run replays each norm and
each MLP on the reference ops from the served pass's own inputs. A replay is judged per channel, as a gain: for
channel c, the least-squares ratio of served to reference over the positions, served_c ~ (1 + g_c)
reference_c, and the check is max |g_c|. A wrong row scale, weight row, activation channel or norm scale moves
its g_c consistently at every position, while rounding, which is not consistent, averages down. (At
clef-flash's shapes: 4,096 channels x 8 positions x 32 layers x 5 rows, 14 MiB of host memory a sample.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

Tensor = torch.Tensor

SKETCH_WIDTH = 32  # buckets per sketch
SKETCH_POSITIONS = 8  # positions of a record sketched (spread evenly, the last token always among them)
SKETCH_SEED = 0x5EED


def sketch_positions(num_tokens: int) -> list[int]:
    """The record positions a fingerprint covers: SKETCH_POSITIONS spread evenly over the record, ending at its
    last token (which every layer's answer flows into). The same for the served pass and the shadow run, however
    each chunks the record."""
    if num_tokens <= SKETCH_POSITIONS:
        return list(range(num_tokens))
    step = num_tokens / SKETCH_POSITIONS
    return sorted({min(num_tokens - 1, int((i + 1) * step) - 1) for i in range(SKETCH_POSITIONS)})


class CountSketch:
    """hidden -> SKETCH_WIDTH buckets: bucket[j] = sum of sign[i] x[i] over the coordinates i hashed to j."""

    def __init__(self, hidden: int, device: torch.device) -> None:
        generator = torch.Generator().manual_seed(SKETCH_SEED)
        self.bucket = torch.randint(0, SKETCH_WIDTH, (hidden,), generator=generator).to(device)
        self.sign = (torch.randint(0, 2, (hidden,), generator=generator) * 2 - 1).float().to(device)

    def __call__(self, rows: Tensor) -> Tensor:
        """rows [n, hidden] (any dtype) -> [n, SKETCH_WIDTH] fp32."""
        out = torch.zeros(rows.shape[0], SKETCH_WIDTH, dtype=torch.float32, device=rows.device)
        return out.index_add_(1, self.bucket, rows.float() * self.sign)


# The parts a probe keeps whole, for the replays: the residual stream after each norm's add (fp32), each norm's
# output (the mixer's input, the MLP's input) and the MLP's output.
KEPT_PARTS = ("mixer_res", "mixer_in", "mlp_res", "mlp_in", "mlp")
SKETCHED_PARTS = ("mixer_in", "mixer", "mlp_in", "mlp")


@dataclass
class LayerProbe:
    """What one trunk step sketches: `rows` of the step's pack (int64, on the device), grouped by the record
    they belong to: per group its fingerprint and the record positions of its rows (the group's rows are
    consecutive in `rows`, in that order). The trunk calls record() at each part of each layer."""

    rows: Tensor
    groups: list[tuple[Fingerprint, list[int]]]
    sketch: CountSketch
    keep_rows: bool = True  # the served pass keeps them; the shadow run replays from those and keeps none

    def record(self, layer: int, part: str, output: Tensor) -> None:
        """output [N, hidden] for the whole pack, at `part` of `layer`: "mixer_res" (the residual stream after the
        input norm's add), "mixer_in" (the input norm's output), "mixer" (the mixer's output), "mlp_res",
        "mlp_in" (the post-mixer norm's), "mlp" (the MLP's output). One gather and one copy to the host for the
        whole step; each record keeps views of its rows."""
        kept = part in KEPT_PARTS and self.keep_rows
        if part not in SKETCHED_PARTS and not kept:
            return
        rows = output.index_select(0, self.rows)
        whole = rows.cpu() if kept else None
        sketches = self.sketch(rows).cpu() if part in SKETCHED_PARTS else None
        start = 0
        for fingerprint, positions in self.groups:
            end = start + len(positions)
            if whole is not None:
                fingerprint.rows.setdefault((layer, part), []).append((positions, whole[start:end]))
            if sketches is not None:
                fingerprint.sketches.setdefault((layer, part), []).append((positions, sketches[start:end]))
            start = end


# (layer, part) -> the steps' (positions, rows [len(positions), width]) in the order the steps ran
Entries = dict[tuple[int, str], list[tuple[list[int], Tensor]]]


def _by_position(entries: list[tuple[list[int], Tensor]]) -> dict[int, Tensor]:
    return {position: row for positions, rows in entries for position, row in zip(positions, rows, strict=True)}


@dataclass
class Fingerprint:
    """One record's sketches ([SKETCH_WIDTH] fp32 a position) and the rows kept whole for the replays ([hidden]
    as the trunk had them, parts in KEPT_PARTS), by (layer, part), in host memory."""

    positions: list[int]
    sketches: Entries = field(default_factory=dict)
    rows: Entries = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(rows.nbytes for table in (self.sketches, self.rows) for e in table.values() for _, rows in e)

    def sketch(self, layer: int, part: str) -> dict[int, Tensor]:
        """`layer`'s sketches at `part`: position -> [SKETCH_WIDTH]."""
        return _by_position(self.sketches.get((layer, part), []))

    def replay_pair(self, layer: int, given: str, served: str) -> tuple[Tensor, Tensor] | None:
        """`layer`'s kept rows at part `given` (a replay's input) and at part `served` (what the served pass
        computed from it), [P, hidden] each over the positions both hold; None if not kept."""
        inputs = _by_position(self.rows.get((layer, given), []))
        outputs = _by_position(self.rows.get((layer, served), []))
        shared = sorted(set(inputs) & set(outputs))
        if not shared:
            return None
        return torch.stack([inputs[p] for p in shared]), torch.stack([outputs[p] for p in shared])


def fingerprint_drift(served: dict[int, Tensor], reference: dict[int, Tensor]) -> float | None:
    """||served - reference|| / ||reference|| over every bucket of the positions both sketched: how far the
    layer's output moved as a whole (a fault that scales or skews a whole layer); None when they share none."""
    shared = sorted(set(served) & set(reference))
    if not shared:
        return None
    s = torch.stack([served[p] for p in shared])
    r = torch.stack([reference[p] for p in shared])
    drift = float((s - r).norm() / r.norm().clamp_min(1e-30))
    return float("inf") if drift != drift else drift


def channel_gain_error(served: Tensor, reference: Tensor) -> float:
    """max over channels of |g_c|, where served_c ~ (1 + g_c) reference_c in least squares over the rows
    (served, reference: [P, hidden]). A channel whose reference is small at every row is judged against a tenth
    of the layer's RMS instead of its own size, so rounding on near-zero channels does not read as a gain."""
    s, r = served.double(), reference.double()
    rms_squared = float(r.square().mean())
    power = r.square().sum(0).clamp_min(0.01 * rms_squared * r.shape[0])
    gain = ((s - r) * r).sum(0) / power.clamp_min(1e-300)
    worst = float(gain.abs().max()) if gain.numel() else 0.0
    if not torch.isfinite(s).all():
        return float("inf")
    return worst
