"""How our answers are compared with an independent reference (Cloudflare's vendored `systemone` on
transformers, on a release or on clef-finetune's merge): the one place the rules and the bound live.

Our fast path and the reference sum in different orders (and MKL, oneDNN and our CPU kernels pick other
blockings on other CPUs), so their probabilities differ by rounding, up to PARITY_BOUND. A probability
that lands near a boundary of the 4-decimal rounding can then round either way: two rounded answers may
differ by a whole unit of the 4th decimal on one machine and agree on another. So:

- unrounded probabilities are compared within the bound;
- a rounded number of our response is compared with the reference's UNROUNDED value: within half a unit
  of the 4th decimal (our rounding) plus the bound (a score, sum k p_k, gets the bound times sum k);
- choices, legends, types, the order of questions and options, the model name and token counts exactly.

Comparisons of our code with itself where the arithmetic is the same (batching, chunking, a cache hit
against a cold run) stay exact and do not come here.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

# max |p_ours - p_reference| for the fp32 CPU path against the fp32 reference on the test releases
# (docs/development.md, Test; measured worst 1.1e-6 on the test releases, 4.5e-7 on the merges, 7.2e-7 on clef-tiny).
PARITY_BOUND = 1e-5
HALF_UNIT = 0.5e-4  # answers are rounded to 4 decimals

# int8 weights (--quantize int8) against the same model's fp32 weights on the CPU, per release and activation
# dtype: max |p_int8 - p_f32| measured over 200 random requests on each test release and 200 held-out clef-tiny
# examples, and per LoRA variant over 15 long requests on the int8 upstream-tiny base (fp32 activations) against
# clef-finetune's fp32 merge (python benchmarks/int8_bounds.py, 2026-12-03: benchmarks/RESULTS.md), and the
# bound the tests hold, about twice the figure.
INT8_BOUNDS = {
    ("upstream-tiny", "f32"): 2.5e-3,  # measured 1.24e-3
    ("upstream-tiny", "f16"): 2.5e-3,  # 1.25e-3
    ("upstream-tiny", "bf16"): 2.6e-3,  # 1.30e-3
    ("mid", "f32"): 5.1e-2,  # 2.55e-2
    ("mid", "f16"): 5.1e-2,  # 2.53e-2
    ("mid", "bf16"): 5.0e-2,  # 2.48e-2
    ("clef-tiny", "f32"): 6.8e-2,  # 3.39e-2
    ("clef-tiny", "f16"): 6.6e-2,  # 3.31e-2
    ("clef-tiny", "bf16"): 8.4e-2,  # 4.20e-2
    ("upstream-tiny+lora:all", "f32"): 7.5e-2,  # 3.74e-2
    ("upstream-tiny+lora:subset", "f32"): 4.5e-4,  # 2.24e-4
}

# The release as stored, served in f16 / bf16 activations (--dtype) against itself in fp32 on the CPU: max
# |p_16 - p_f32| measured over 200 requests per release (python benchmarks/int8_bounds.py --weights stored
# --no-variants, 2026-12-04: benchmarks/RESULTS.md), and the bound the tests hold, about twice the figure.
DTYPE_BOUNDS = {
    ("upstream-tiny", "f16"): 5.5e-5,  # measured 2.71e-5
    ("upstream-tiny", "bf16"): 4.6e-4,  # 2.27e-4
    ("mid", "f16"): 2.2e-3,  # 1.07e-3
    ("mid", "bf16"): 1.9e-2,  # 9.27e-3
    ("clef-tiny", "f16"): 5.6e-3,  # 2.77e-3
    ("clef-tiny", "bf16"): 3.1e-2,  # 1.55e-2
}


@contextlib.contextmanager
def capturing_reference_probabilities(jsm) -> Iterator[list[dict[str, float]]]:
    """While active, every `jsm.systemone` call appends each question's unrounded per-option probabilities
    (the dict its own `systemone_answer` rounds), in answer order."""
    seen: list[dict[str, float]] = []
    real = jsm.systemone_answer

    def record(question, probabilities):
        seen.append(dict(probabilities))
        return real(question, probabilities)

    jsm.systemone_answer = record
    try:
        yield seen
    finally:
        jsm.systemone_answer = real


def reference_response(reference, request: dict, **options) -> tuple[dict, dict[str, dict[str, float]]]:
    """`systemone` of the reference (jsm, model, processor) on `request`: its response body and the
    unrounded probabilities behind each answer, by question id."""
    jsm, model, processor = reference
    with capturing_reference_probabilities(jsm) as seen:
        response = jsm.systemone(model, processor, request, **options)
    assert len(seen) == len(response["answers"])
    return response, dict(zip(response["answers"], seen, strict=True))


def _close(ours: float, unrounded: float, bound: float, where: tuple) -> None:
    assert isinstance(ours, float | int) and math.isfinite(ours), where
    assert abs(ours - unrounded) <= bound, (*where, ours, unrounded, abs(ours - unrounded), bound)


def assert_answers_match(
    ours: dict, reference: dict, unrounded: dict[str, dict[str, float]], bound: float = PARITY_BOUND, where=""
) -> None:
    """`ours` (our response's `answers`) against `reference` (the reference's) and its unrounded
    probabilities, by the rules above."""
    assert list(ours) == list(reference), (where, list(ours), list(reference))
    rounded = HALF_UNIT + bound
    for qid, want in reference.items():
        have, p = ours[qid], unrounded[qid]
        at = (where, qid)
        assert have["type"] == want["type"] and set(have) == set(want), (*at, have, want)
        if want["type"] == "noul":
            _close(have["noul"], p["true"], rounded, (*at, "noul"))
            continue
        assert list(have["probabilities"]) == list(want["probabilities"]), at  # request order
        if want["type"] == "choice":
            assert have["choice"] == want["choice"], (*at, have, want)
            _close(have["confidence"], p[want["choice"]], rounded, (*at, "confidence"))
            for option, value in have["probabilities"].items():
                _close(value, p[option], rounded, (*at, option))
            continue
        assert have["legend"] == want["legend"], at
        levels = list(want["probabilities"])
        for level in levels:
            _close(have["probabilities"][level], p[level], rounded, (*at, level))
        _close(have["confidence"], max(p[level] for level in levels), rounded, (*at, "confidence"))
        expected_score = sum(k * p[level] for k, level in enumerate(levels))
        _close(have["score"], expected_score, HALF_UNIT + bound * sum(range(len(levels))), (*at, "score"))


def assert_response_matches(
    ours: dict, reference: dict, unrounded: dict[str, dict[str, float]], bound: float = PARITY_BOUND
) -> None:
    """A whole response body: the reference's keys, model and usage (token counts) exactly, answers as
    assert_answers_match. Our own extensions (x_cached_tokens, x_timing_ms, ...) are not compared."""
    assert ours["model"] == reference["model"] and ours["usage"] == reference["usage"], (ours, reference)
    assert_answers_match(ours["answers"], reference["answers"], unrounded, bound)
