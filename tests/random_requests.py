"""Seeded random System One requests covering what the encoder and head must get right: all three types,
unicode ids and options, object/array states and instructions, null and missing descriptions, one-sided
noul criteria, 2..255 choice options, 2..10 score levels, and states long enough to cross chunks."""

from __future__ import annotations

import random
from typing import Any

WORDS = [
    "checkout",
    "failing",
    "customer",
    "orders",
    "blocked",
    "refund",
    "invoice",
    "shipped",
    "delayed",
    "ERROR",
    "WARN",
    "2026-11-30T05:01:27Z",
    "café",
    "naïve",
    "部門",
    "緊急",
    "urgência",
    "🙂",
    "Ωmega",
    'say "hi"',
    "back\\slash",
    "tab\there",
    "line\nbreak",
    "ctl\u0001char",
    "<|im_end|>",
    "  spaced  ",
]
IDS = ["billing", "technical", "sales", "urgência", "部門", "emoji 🙂", "a b", "x-1", "Ω", "0", "true", "é"]


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def json_value(rng: random.Random, depth: int = 2) -> Any:
    kind = rng.randrange(8 if depth > 0 else 6)
    if kind == 0:
        return text(rng, rng.randint(1, 6))
    if kind == 1:
        return rng.choice([0, 1, -7, 2**40, 12345678901234567890])
    if kind == 2:
        return rng.choice([2.0, 1e-05, 1e16, -0.5, 3.14159, 1.5e300])
    if kind == 3:
        return rng.choice([True, False])
    if kind == 4:
        return None
    if kind == 5:
        return rng.choice(IDS)
    if kind == 6:
        return [json_value(rng, depth - 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(IDS + WORDS[:6]): json_value(rng, depth - 1) for _ in range(rng.randint(0, 4))}


def description(rng: random.Random) -> Any:
    return rng.choice([text(rng, rng.randint(1, 5)), None, {"detail": text(rng, 2), "n": 3}, ["a", 1, None]])


def question(rng: random.Random, kind: str, max_choice: int, null_score_levels: bool = True) -> dict[str, Any]:
    q: dict[str, Any] = {"type": kind}
    instructions = rng.randrange(6)
    if instructions < 3:
        q["instructions"] = text(rng, rng.randint(2, 10))
    elif instructions == 3:
        q["instructions"] = {"ask": text(rng, 3), "hints": [text(rng, 1), 2]}
    elif instructions == 4:
        q["instructions"] = rng.choice([None, ""])  # becomes the question id
    # 5: missing
    if kind == "noul":
        form = rng.randrange(5)
        if form == 1:
            q["criteria"] = None
        elif form == 2:
            q["criteria"] = {"true": description(rng)}  # one-sided
        elif form == 3:
            q["criteria"] = {"false": description(rng), "extra": "ignored"}
        elif form == 4:
            q["criteria"] = {"true": description(rng), "false": description(rng)}
    elif kind == "choice":
        count = rng.randint(2, max_choice)
        names = rng.sample(IDS, min(count, len(IDS))) + [f"opt{i}-{rng.choice(IDS)}" for i in range(count - len(IDS))]
        q["criteria"] = {name: description(rng) for name in names[:count]}
    else:
        levels = [description(rng) for _ in range(rng.randint(2, 10))]
        q["criteria"] = levels if null_score_levels else [text(rng, 2) if d is None else d for d in levels]
    return q


def random_request(
    rng: random.Random, max_choice: int = 12, state_words: tuple[int, int] = (5, 120), null_score_levels: bool = True
) -> dict:
    """null_score_levels=False for requests sent over HTTP: the contract refuses a null score level (422),
    which the reference itself (and so the in-process Decider) accepts."""
    state_kind = rng.randrange(3)
    if state_kind == 0:
        state: Any = text(rng, rng.randint(*state_words))
    elif state_kind == 1:
        state = {"ticket": text(rng, rng.randint(*state_words)), "meta": json_value(rng), "tags": [rng.choice(IDS)]}
    else:
        state = [json_value(rng) for _ in range(rng.randint(1, 6))] + [text(rng, rng.randint(*state_words))]
    questions = {}
    for _ in range(rng.randint(1, 4)):
        qid = rng.choice(IDS + [f"q{rng.randrange(1000)}", "cúestion ☃"])
        questions[qid] = question(rng, rng.choice(["noul", "choice", "score"]), max_choice, null_score_levels)
    return {"model": "clef-flash", "state": state, "questions": questions}


def features(request: dict) -> set[str]:
    """Which coverage items a request exercises (the tests assert the whole set is covered)."""
    found = {f"state:{type(request['state']).__name__}"}
    for qid, q in request["questions"].items():
        found.add(f"type:{q['type']}")
        if any(ord(ch) > 127 for ch in qid):
            found.add("unicode id")
        found.add(f"instructions:{type(q['instructions']).__name__}" if "instructions" in q else "instructions:missing")
        criteria = q.get("criteria")
        if q["type"] == "noul" and isinstance(criteria, dict) and len({"true", "false"} & set(criteria)) == 1:
            found.add("noul one-sided")
        if q["type"] == "choice":
            if any(ord(ch) > 127 for name in criteria for ch in name):
                found.add("unicode option")
            found.add("choice 255" if len(criteria) == 255 else "choice")
        if q["type"] == "score":
            found.add(f"score {len(criteria)}" if len(criteria) in (2, 10) else "score")
        descriptions = list(criteria.values()) if isinstance(criteria, dict) else list(criteria or [])
        if any(d is None for d in descriptions):
            found.add("null description")
    return found
