"""Per-question probabilities -> System One answers (shared/specs/clef-decision.md section 4)."""

from __future__ import annotations

from typing import Any

CONFIDENCE_MODES = ("clef", "typesafe", "hosted")


def _round(x: float) -> float:
    # Python's round on the double: correctly rounded, half-even on the exact binary value (as the reference).
    return round(float(x), 4)


def _typesafe_choice_confidence(top: float, n: int) -> float:
    """TypeSafe's definition: how far the top probability is above uniform, scaled to [0, 1]."""
    return (top - 1.0 / n) / (1.0 - 1.0 / n)


def _typesafe_score_confidence(probabilities: list[float]) -> float:
    """A mode-distance form: 1 minus the expected distance of the level from the most likely level,
    as a fraction of the scale's span (1: all mass on the mode; 0: all mass at the far end)."""
    mode = max(range(len(probabilities)), key=probabilities.__getitem__)
    spread = sum(p * abs(k - mode) for k, p in enumerate(probabilities))
    return 1.0 - spread / (len(probabilities) - 1)


def _hosted_confidence(probabilities: list[float]) -> float:
    """Cloudflare's hosted API, as its clients report it: how far the distribution is from uniform by its
    squared mass, (sum of p^2 - 1/n) / (1 - 1/n) (1: all mass on one option; 0: uniform)."""
    n = len(probabilities)
    return (sum(p * p for p in probabilities) - 1.0 / n) / (1.0 - 1.0 / n)


def _confidence(mode: str, probabilities: list[float], top: float, typesafe) -> float:
    if mode == "clef":
        return top
    return _hosted_confidence(probabilities) if mode == "hosted" else typesafe()


def answer(question: dict[str, Any], probabilities: dict[str, float], confidence: str = "clef") -> dict[str, Any]:
    """One question's answer from its unrounded per-option probabilities (option id -> p); `confidence`: the
    reference's top probability (clef), TypeSafe's definition or the hosted API's (CONFIDENCE_MODES)."""
    kind = question["type"]
    if kind == "noul":
        return {"type": "noul", "noul": _round(probabilities["true"])}
    if kind == "choice":
        options = [str(option) for option in question["criteria"]]  # request order, not encoded order
        choice = max(options, key=probabilities.__getitem__)  # ties: the first in request order
        top = probabilities[choice]
        return {
            "type": "choice",
            "choice": choice,
            "confidence": _round(
                _confidence(
                    confidence,
                    [probabilities[option] for option in options],
                    top,
                    lambda: _typesafe_choice_confidence(top, len(options)),
                )
            ),
            "probabilities": {option: _round(probabilities[option]) for option in options},
        }
    levels = [str(index) for index in range(len(question["criteria"]))]
    ordered = [probabilities[level] for level in levels]
    return {
        "type": "score",
        "score": _round(sum(index * p for index, p in enumerate(ordered))),
        "confidence": _round(
            _confidence(confidence, ordered, max(ordered), lambda: _typesafe_score_confidence(ordered))
        ),
        "legend": dict(zip(levels, question["criteria"], strict=True)),
        "probabilities": {level: _round(p) for level, p in zip(levels, ordered, strict=True)},
    }


def response(model: str, answers: dict[str, dict[str, Any]], input_tokens: int) -> dict[str, Any]:
    return {"model": model, "answers": answers, "usage": {"input_tokens": input_tokens, "output_tokens": 0}}
