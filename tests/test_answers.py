"""Post-processing: request order, ties, rounding, score maths, confidence modes."""

from __future__ import annotations

import pytest

from clef_cuda.request.answers import answer


def test_noul_has_no_confidence_and_rounds_half_even_on_the_double():
    assert answer({"type": "noul"}, {"true": 0.94255, "false": 0.05745}) == {"type": "noul", "noul": round(0.94255, 4)}


def test_choice_lists_request_order_and_ties_go_to_the_first_in_request_order():
    question = {"type": "choice", "criteria": {"sales": "x", "billing": "y", "technical": "z"}}
    result = answer(question, {"billing": 0.4, "sales": 0.4, "technical": 0.2})
    assert result["choice"] == "sales"
    assert list(result["probabilities"]) == ["sales", "billing", "technical"]
    assert result["confidence"] == 0.4


def test_score_uses_unrounded_probabilities_and_keeps_the_legend():
    question = {"type": "score", "criteria": ["Can wait", {"n": 1}, None]}
    probs = {"0": 0.01704, "1": 0.00776, "2": 0.9752}
    result = answer(question, probs)
    assert result["score"] == round(0.00776 + 2 * 0.9752, 4)
    assert result["legend"] == {"0": "Can wait", "1": {"n": 1}, "2": None}
    assert result["probabilities"] == {"0": 0.017, "1": 0.0078, "2": 0.9752}
    assert result["confidence"] == 0.9752


@pytest.mark.parametrize(
    "probs, expected",
    [({"a": 0.5, "b": 0.5}, 0.0), ({"a": 1.0, "b": 0.0}, 1.0), ({"a": 0.75, "b": 0.25}, 0.5)],
)
def test_typesafe_choice_confidence(probs, expected):
    result = answer({"type": "choice", "criteria": {"a": 1, "b": 2}}, probs, confidence="typesafe")
    assert result["confidence"] == expected


def test_typesafe_score_confidence_is_one_minus_expected_distance_from_the_mode():
    question = {"type": "score", "criteria": ["a", "b", "c"]}
    assert answer(question, {"0": 0.0, "1": 1.0, "2": 0.0}, "typesafe")["confidence"] == 1.0
    # mode 0 (the first of the tied levels), half the mass two levels away: 1 - 0.5 * 2 / 2
    assert answer(question, {"0": 0.5, "1": 0.0, "2": 0.5}, "typesafe")["confidence"] == 0.5
    assert answer(question, {"0": 0.2, "1": 0.6, "2": 0.2}, "typesafe")["confidence"] == 0.8
