"""The comparison rules of tests/parity.py: a probability that rounds the other way at a 4-decimal boundary
passes (the AVX-512 failure of a `==` on rounded answers), and every real disagreement fails."""

from __future__ import annotations

import copy

import pytest
from parity import HALF_UNIT, PARITY_BOUND, assert_answers_match

from clef_cuda.request.answers import answer

QUESTIONS = {
    "n": {"type": "noul"},
    "c": {"type": "choice", "criteria": {"a": None, "b": "B", "z": None}},
    "s": {"type": "score", "criteria": ["lo", "mid", "hi"]},
}
# Reference probabilities; "n" sits just below a rounding boundary (0.12345 - 1e-9 rounds to 0.1234).
REFERENCE = {
    "n": {"true": 0.12345 - 1e-9, "false": 0.87655 + 1e-9},
    "c": {"a": 0.2, "b": 0.7, "z": 0.1},
    "s": {"0": 0.1, "1": 0.3, "2": 0.6},
}


def answers(probabilities: dict) -> dict:
    return {qid: answer(QUESTIONS[qid], p) for qid, p in probabilities.items()}


def shifted(qid: str, option: str, delta: float) -> dict:
    probabilities = copy.deepcopy(REFERENCE)
    probabilities[qid][option] += delta
    return probabilities


def check(ours: dict) -> None:
    assert_answers_match(ours, answers(REFERENCE), REFERENCE)


def test_a_value_that_rounds_the_other_way_within_the_bound_passes():
    ours = answers(shifted("n", "true", 2e-9))  # across the boundary: rounds to 0.1235, the reference to 0.1234
    assert ours["n"]["noul"] != answers(REFERENCE)["n"]["noul"]
    check(ours)
    check(answers(shifted("c", "b", PARITY_BOUND / 2)))


@pytest.mark.parametrize(
    "fault",
    ["noul off", "probability off", "score off", "choice flipped", "legend changed", "options reordered", "missing"],
)
def test_every_disagreement_fails(fault):
    ours = answers(REFERENCE)
    if fault == "noul off":
        ours = answers(shifted("n", "true", 3 * HALF_UNIT))
    elif fault == "probability off":
        ours["c"]["probabilities"]["a"] += 2 * HALF_UNIT
    elif fault == "score off":
        ours["s"]["score"] += 2 * HALF_UNIT + 3 * PARITY_BOUND
    elif fault == "choice flipped":
        ours["c"]["choice"] = "a"
    elif fault == "legend changed":
        ours["s"]["legend"]["2"] = "top"
    elif fault == "options reordered":
        ours["c"]["probabilities"] = dict(reversed(list(ours["c"]["probabilities"].items())))
    else:
        del ours["s"]
    with pytest.raises(AssertionError):
        check(ours)
