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
(clef_cuda.verification.shadow), but a fault confined to a few channels (an int8 row scale off by 5%) or to a norm
(whose input and output are both the trunk's, so its error reads as the next block's input drift) can hide in
rounding. Position-wise parts can be checked on their own, with nothing upstream accumulated: the served pass
also keeps, whole, at the sketched positions, the residual stream after each norm's add and each norm's output
(the MLP's input is the post-mixer norm's output) and the MLP's output; the shadow run replays each norm and
each MLP on the reference ops from the served pass's own inputs. A replay is judged per channel, as a gain: for
channel c, the least-squares ratio of served to reference over the positions, served_c ~ (1 + g_c)
reference_c, and the check is max |g_c|. A wrong row scale, weight row, activation channel or norm scale moves
its g_c consistently at every position, while rounding, which is not consistent, averages down. (At
clef-flash's shapes: 4,096 channels x 8 positions x 32 layers x 5 rows, 14 MiB of host memory a sample.)

The head's inputs (clef_cuda.model.head): the head reads every position through its memory rows, each question
and option through the mean of its span, and the last token on its own. A sampled record's served pass also
keeps what the head read: a count sketch of its LayerNorm output (JointSchemaHead.normed) at every position the
pass computed, [tokens, SKETCH_WIDTH] fp32 (128 B a token), and, once answered, a sketch of each span mean and of
the last row as HeadInputs held them (prefix-cache restores included), [Q + O + 1, SKETCH_WIDTH]. A sketch is
linear, so a span mean's sketch is the mean of its tokens' sketches, up to the roundings of the head's sum and
of the sketches: head_read_error compares the two, a check of the served pass against itself that the head read
what the trunk computed, as tight as those roundings (clef_cuda.verification.shadow.head_read_tolerance). The shadow
run keeps the same sketches from the reference ops: output_drift, the drift of every row the head read, is what
the probabilities' tolerance is measured from. At clef-flash's shapes: 2 MiB for a 16k-token record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from clef_cuda.model.head import HeadInputs, JointSchemaHead, RecordLayout

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
    # What the head read at every position a pass computed: (first position, [n, SKETCH_WIDTH] sketches of its
    # LayerNorm's output) per step; and the sketches of the span means and last row it held (head_input_rows).
    outputs: list[tuple[int, Tensor]] = field(default_factory=list)
    head_rows: Tensor | None = None

    def nbytes(self) -> int:
        kept = sum(rows.nbytes for table in (self.sketches, self.rows) for e in table.values() for _, rows in e)
        kept += sum(sketch.nbytes for _, sketch in self.outputs)
        return kept + (self.head_rows.nbytes if self.head_rows is not None else 0)

    def record_output(self, start: int, hidden: Tensor, sketch: CountSketch, head: JointSchemaHead) -> None:
        """The trunk's output rows [n, hidden] for record positions start .. start + n: what `head` reads of
        them (its LayerNorm's output, JointSchemaHead.normed, as consume computes it), sketched, to the host."""
        self.outputs.append((start, sketch(head.normed(hidden)).cpu()))

    def keep_head_inputs(self, inputs: HeadInputs, layout: RecordLayout, sketch: CountSketch) -> None:
        """The span means and the last row the head read, once the record is answered: sketched, to the host."""
        self.head_rows = sketch(head_input_rows(inputs, layout)).cpu()

    def output_sketches(self, num_tokens: int) -> tuple[Tensor, Tensor]:
        """[num_tokens, SKETCH_WIDTH] sketches of the rows the head read, and [num_tokens] bool: which positions
        this pass computed (a prefix restored from the cache was not)."""
        sketches = torch.zeros(num_tokens, SKETCH_WIDTH)
        computed = torch.zeros(num_tokens, dtype=torch.bool)
        for start, rows in self.outputs:
            sketches[start : start + rows.shape[0]] = rows
            computed[start : start + rows.shape[0]] = True
        return sketches, computed

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


def head_input_rows(inputs: HeadInputs, layout: RecordLayout) -> Tensor:
    """What the head reads of each question and option, and of the last token: the span means (as
    JointSchemaHead.logits computes them) then the last row, [Q + O + 1, hidden] fp32."""
    means = inputs.span_sums[:-1] / layout.span_lengths[:, None]
    return torch.cat([means, inputs.last[None]]).float()


def head_read_error(head_rows: Tensor, outputs: Tensor, computed: Tensor, layout: RecordLayout) -> Tensor:
    """Per row of head_input_rows (each span, then the last token), how far the head's sketched mean is from the
    mean of its tokens' sketched rows, relative to their mean norm: ||S(mean) - mean_p S(row_p)|| / mean_p
    ||S(row_p)||. head_rows [Q + O + 1, W] and outputs [L, W] from one pass (outputs' positions `computed` [L]);
    NaN where a span has a position the pass did not compute (restored from the prefix cache), inf if non-finite."""
    spans = layout.num_questions + layout.num_options
    span_of_token = layout.span_of_token.cpu()
    rows = outputs.double()
    sums = torch.zeros(spans + 1, rows.shape[1], dtype=torch.float64).index_add_(0, span_of_token, rows)
    norms = torch.zeros(spans + 1, dtype=torch.float64).index_add_(0, span_of_token, rows.norm(dim=-1))
    missing = torch.zeros(spans + 1).index_add_(0, span_of_token, (~computed).float())[:spans] > 0
    lengths = layout.span_lengths.cpu().double()[:, None]
    means = torch.cat([sums[:spans] / lengths, rows[-1:]])
    scale = torch.cat([norms[:spans] / lengths[:, 0], rows[-1:].norm(dim=-1)])
    error = ((head_rows.double() - means).norm(dim=-1) / scale.clamp_min(1e-30)).float()
    error = torch.where(torch.isfinite(error), error, torch.full_like(error, math.inf))
    return torch.where(torch.cat([missing, ~computed[-1:]]), torch.full_like(error, math.nan), error)


def output_drift(served: Tensor, reference: Tensor, computed: Tensor) -> float:
    """The largest drift of a row the head read, served against reference, over the positions the served pass
    computed: ||S(served_p - reference_p)|| relative to the reference rows' mean sketched norm (rows of a
    LayerNorm's output have near one norm: a mean keeps a row whose sketch happens to be short from reading as a
    large drift). inf if non-finite."""
    if not bool(computed.any()):
        return 0.0
    differences = (served.double() - reference.double())[computed].norm(dim=-1)
    drift = float(differences.max() / reference.double()[computed].norm(dim=-1).mean().clamp_min(1e-30))
    return drift if math.isfinite(drift) else math.inf
