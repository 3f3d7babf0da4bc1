"""Body intake before any parsing (app/intake.py): the nesting depth read from the bytes alone, and what
parse_json refuses (too deep, not UTF-8, not JSON, numbers Python will not convert, lone surrogates)
with the place in the body."""

from __future__ import annotations

import json
import random

import pytest

from app.intake import InvalidBody, json_depth, parse_json

# Characters that make string literals hard to skip: brackets, quotes and backslashes inside them.
NASTY = ["[", "]", "{", "}", '"', "\\", "a", " ", "é", '\\"', "\\\\", "\n", "🙂"]


def nested_depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max((nested_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((nested_depth(v) for v in value), default=0)
    return 0


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(5 if depth < 14 else 2)
    if kind == 0:
        return "".join(rng.choice(NASTY) for _ in range(rng.randrange(8)))
    if kind == 1:
        return rng.choice([1, None, True, 2.5, -0.0])
    if kind == 2:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ("".join(rng.choice(NASTY) for _ in range(rng.randrange(4))) for _ in range(rng.randrange(4)))
    return {key: random_value(rng, depth + 1) for key in keys}


def test_depth_from_the_bytes_equals_the_parsed_depth():
    rng = random.Random(7)
    for _ in range(2000):
        value = random_value(rng)
        for raw in (json.dumps(value), json.dumps(value, ensure_ascii=False), json.dumps(value, indent=2)):
            assert json_depth(raw.encode()) == nested_depth(value), raw


def test_depth_ignores_brackets_in_strings():
    assert json_depth(b'["[[[[", "\\\\", "\\"[{"]') == 1
    assert json_depth(b'{"a": "]]]]]]", "b": [[{}]]}') == 4


def refusal(raw: bytes, max_depth: int = 256) -> InvalidBody:
    with pytest.raises(InvalidBody) as info:
        parse_json(raw, max_depth)
    return info.value


def test_too_deep_is_refused_before_parsing_and_the_limit_is_inclusive():
    deep = b"[" * 3000 + b"]" * 3000  # Python's decoder would raise RecursionError
    error = refusal(deep)
    assert error.kind == "json_too_deep" and "3000 levels" in error.message and "--max-json-depth" in error.message
    assert parse_json(b"[" * 256 + b"]" * 256, 256) is not None
    assert refusal(b"[" * 257 + b"]" * 257).kind == "json_too_deep"
    assert parse_json(b'"' + b"[" * 5000 + b'"', 256) == "[" * 5000  # brackets in a string do not nest


@pytest.mark.parametrize(
    "raw, loc",
    [
        (b'{"state": "x\\ud800"}', ["body", "state"]),
        (b'{"state": "\\udc00 low first"}', ["body", "state"]),
        (
            b'{"questions": {"q": {"criteria": {"a": 1, "b\\ud83d": 2}}}}',
            ["body", "questions", "q", "criteria", "b\\ud83d"],
        ),
        (b'{"state": ["ok", {"k": ["\\ud800"]}]}', ["body", "state", 1, "k", 0]),
        (b'{"model": "\\ud800"}', ["body", "model"]),
    ],
)
def test_lone_surrogates_are_refused_by_place(raw, loc):
    error = refusal(raw)
    assert error.kind == "string_unicode" and error.loc == loc


def test_surrogate_pairs_and_escaped_backslashes_are_text():
    assert parse_json(b'{"s": "\\ud83d\\ude00"}', 256) == {"s": "😀"}
    assert parse_json(b'{"s": "\\\\ud800"}', 256) == {"s": "\\ud800"}  # a backslash, then "ud800"


@pytest.mark.parametrize(
    "raw, words",
    [
        (b"\xff\xfe{}", "UTF-8"),
        (b'{"s": "\xed\xa0\x80"}', "UTF-8"),  # a surrogate encoded in UTF-8 bytes
        (b"{not json", "not valid JSON"),
        (b"1" * 5000, "not valid JSON"),  # more digits than Python converts to an int
        (b"", "not valid JSON"),
    ],
)
def test_undecodable_bodies(raw, words):
    error = refusal(raw)
    assert words in error.message and error.loc == ["body"]


def test_a_utf8_bom_is_tolerated():
    assert parse_json("\ufeff{}".encode(), 256) == {}
