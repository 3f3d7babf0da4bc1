"""A System One request -> token ids + question/option spans, exactly as the upstream reference encodes it
(shared/specs/clef-decision.md section 3): each text segment tokenised on its own, the record layout,
JSON rendering, option order and the token budget."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clef_cuda.errors import ReleaseError, RequestError, RequestTooLongError

SYSTEM_PROMPT = (
    "Read the complete state and schema. Decide every field jointly. Each answer must be exactly one of that "
    "field's allowed options."
)
PREFIX = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\nSTATE:\n"
SCHEMA_HEADER = "\n\nSCHEMA FIELDS:\n"
OPTIONS_HEADER = "\nALLOWED OPTIONS:\n"
FIELD_END = "END FIELD\n"
SUFFIX = "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:"
QUESTION_TYPES = {"noul": 0, "choice": 1, "score": 2}
NOUL_DEFAULTS = {
    "true": "The proposition is true or the answer is yes.",
    "false": "The proposition is false or the answer is no.",
}
STATE_OVERFLOW_POLICIES = ("reject", "truncate")


# Qwen3.5's pre-tokenizer split (transformers' Qwen3_5Tokenizer): digits one by one, letters with marks.
QWEN35_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)


class Tokenizer:
    """The release's tokenizer.json through the `tokenizers` library, as the reference tokenises.

    The reference loads it as transformers' Qwen3_5Tokenizer, which keeps tokenizer.json's vocabulary,
    merges and added tokens but always applies Qwen3.5's own text pipeline: NFC normalisation, the Qwen
    regex split, byte-level mapping. So does this class (for clef-flash's own tokenizer.json that pipeline
    is what the file says anyway). Special tokens written in the text (<|im_start|>...) are matched as
    added tokens; no BOS/EOS is added."""

    # Long segments (a state sent again with new questions) are remembered: re-tokenising a 16k-token
    # state costs milliseconds on every request that repeats it.
    CACHED_MIN_CHARS = 1024
    CACHE_ENTRIES = 64

    def __init__(self, backend) -> None:
        import threading
        from collections import OrderedDict

        self._backend = backend
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_release(cls, model_dir: str | Path) -> Tokenizer:
        from tokenizers import Regex, decoders, normalizers, pre_tokenizers
        from tokenizers import Tokenizer as Backend

        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ReleaseError(f"{path}: missing (the release's tokenizer)")
        try:
            backend = Backend.from_file(str(path))
        except Exception as error:  # the Rust side raises plain Exception subclasses
            raise ReleaseError(f"{path}: not a readable tokenizer.json ({error})") from error
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        backend.decoder = decoders.ByteLevel()
        return cls(backend)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        out: list[list[int] | None] = [None] * len(texts)
        with self._lock:
            for i, text in enumerate(texts):
                if len(text) >= self.CACHED_MIN_CHARS and text in self._cache:
                    self._cache.move_to_end(text)
                    out[i] = self._cache[text]
        todo = [i for i, ids in enumerate(out) if ids is None]
        fresh = self._backend.encode_batch([texts[i] for i in todo], add_special_tokens=False)
        for i, encoding in zip(todo, fresh, strict=True):
            out[i] = encoding.ids
            if len(texts[i]) >= self.CACHED_MIN_CHARS:
                with self._lock:
                    self._cache[texts[i]] = encoding.ids
                    while len(self._cache) > self.CACHE_ENTRIES:
                        self._cache.popitem(last=False)
        return out


def render(value: Any) -> str:
    """Strings as they are; anything else as compact, key-sorted JSON with non-ASCII kept literally."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def question_options(question: dict[str, Any]) -> list[tuple[str, Any]]:
    """(option id, description) in encoded order: noul true/false, choice by code point, score by index."""
    kind = question["type"]
    if kind == "noul":
        criteria = dict(NOUL_DEFAULTS)
        criteria.update(question.get("criteria") or {})
        return [(key, criteria[key]) for key in ("true", "false")]
    if kind == "choice":
        return sorted((str(key), value) for key, value in question["criteria"].items())
    return [(str(index), value) for index, value in enumerate(question["criteria"])]


def validate_request(request: Any) -> None:
    """The reference's checks (model and state present, questions a non-empty object, known types, criteria
    for choice and score) plus the structural ones it assumes (criteria of the right JSON kind)."""
    if not isinstance(request, dict):
        raise RequestError("the request body must be a JSON object", ())
    if not isinstance(request.get("model"), str):
        raise RequestError("model is required and must be a string", ("model",))
    if "state" not in request:
        raise RequestError("state is required", ("state",))
    questions = request.get("questions")
    if not isinstance(questions, dict) or not questions:
        raise RequestError("questions must be a non-empty object", ("questions",))
    for question_id, question in questions.items():
        loc = ("questions", question_id)
        if not isinstance(question, dict):
            raise RequestError(f"{question_id}: a question must be an object", loc)
        kind = question.get("type")
        if kind not in QUESTION_TYPES:
            raise RequestError(f"{question_id}: type must be noul, choice, or score", (*loc, "type"))
        criteria = question.get("criteria")
        if kind == "noul":
            if criteria is not None and not isinstance(criteria, dict):
                raise RequestError(f"{question_id}: noul criteria must be an object or null", (*loc, "criteria"))
        elif not criteria:
            raise RequestError(f"{question_id}: criteria must not be empty", (*loc, "criteria"))
        elif kind == "choice" and not isinstance(criteria, dict):
            raise RequestError(
                f"{question_id}: choice criteria must be an object option -> description", (*loc, "criteria")
            )
        elif kind == "score" and not isinstance(criteria, list):
            raise RequestError(
                f"{question_id}: score criteria must be an array of levels, low to high", (*loc, "criteria")
            )


@dataclass(frozen=True)
class EncodedQuestion:
    question_id: str
    type_name: str
    type_id: int
    span: tuple[int, int]  # the instruction tokens, half-open, absolute positions
    option_spans: tuple[tuple[int, int], ...]  # each option's rendered JSON, in encoded option order
    option_ids: tuple[str, ...]


@dataclass(frozen=True)
class EncodedRecord:
    input_ids: tuple[int, ...]
    questions: tuple[EncodedQuestion, ...]
    prefix_tokens: int
    state_tokens: int  # kept
    dropped_state_tokens: int  # cut by truncation (0 unless the policy is "truncate")
    schema_tokens: int
    suffix_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def encode_request(
    tokenizer: Tokenizer,
    request: dict[str, Any],
    max_length: int = 16384,
    state_overflow: str = "reject",
    max_state_tokens: int | None = None,
) -> EncodedRecord:
    """Encode a validated request. Over max_length: RequestTooLongError with the counts ("reject", the
    default), or the reference's behaviour ("truncate": keep the head of the state, cut its tail)."""
    if state_overflow not in STATE_OVERFLOW_POLICIES:
        raise ValueError(f"state_overflow must be one of {STATE_OVERFLOW_POLICIES}, got {state_overflow!r}")
    # Every segment is tokenised on its own: the span of a segment is exactly its tokens.
    segments: list[str] = [PREFIX, render(request["state"]), SCHEMA_HEADER]
    layout: list[tuple[str, str, int, list[tuple[str, Any]]]] = []
    for number, (question_id, question) in enumerate(request["questions"].items(), start=1):
        instructions = question.get("instructions")
        if instructions is None or instructions == "":
            instructions = str(question_id)
        options = question_options(question)
        segments.append(f"\nFIELD {number}\nID: {question_id}\nTYPE: {question['type']}\nINSTRUCTION: ")
        segments.append(render(instructions))
        segments.append(OPTIONS_HEADER)
        for index, (option_id, description) in enumerate(options, start=1):
            semantics: dict[str, Any] = {"option_id": option_id}
            if description is not None:
                semantics["description"] = description
            segments += [f"OPTION {index}: ", render(semantics), "\n"]
        segments.append(FIELD_END)
        layout.append((str(question_id), question["type"], len(options), options))
    segments.append(SUFFIX)
    ids = tokenizer.encode_many(segments)

    prefix, state, schema_header, suffix = ids[0], ids[1], ids[2], ids[-1]
    schema: list[int] = list(schema_header)
    cursor = 3
    relative: list[tuple[tuple[int, int], list[tuple[int, int]]]] = []
    for _, _, option_count, _ in layout:
        schema += ids[cursor]  # field header
        question_span = (len(schema), len(schema) + len(ids[cursor + 1]))
        schema += ids[cursor + 1] + ids[cursor + 2]
        cursor += 3
        option_spans = []
        for _ in range(option_count):
            schema += ids[cursor]
            option_spans.append((len(schema), len(schema) + len(ids[cursor + 1])))
            schema += ids[cursor + 1] + ids[cursor + 2]
            cursor += 3
        schema += ids[cursor]  # END FIELD
        cursor += 1
        relative.append((question_span, option_spans))

    if max_state_tokens is not None:
        state = state[:max_state_tokens]
    fixed = len(prefix) + len(schema) + len(suffix)
    total = fixed + len(state)
    if fixed > max_length or (total > max_length and state_overflow == "reject"):
        raise RequestTooLongError(
            f"the record needs {total} tokens ({len(state)} of state, {fixed} of prompt and schema); "
            f"the limit is {max_length}",
            input_tokens=total,
            max_tokens=max_length,
            fixed_tokens=fixed,
        )
    kept = state[: max_length - fixed]
    offset = len(prefix) + len(kept)
    questions = tuple(
        EncodedQuestion(
            question_id=question_id,
            type_name=kind,
            type_id=QUESTION_TYPES[kind],
            span=(question_span[0] + offset, question_span[1] + offset),
            option_spans=tuple((s + offset, e + offset) for s, e in option_spans),
            option_ids=tuple(option_id for option_id, _ in options),
        )
        for (question_id, kind, _, options), (question_span, option_spans) in zip(layout, relative, strict=True)
    )
    return EncodedRecord(
        input_ids=tuple(prefix + kept + schema + suffix),
        questions=questions,
        prefix_tokens=len(prefix),
        state_tokens=len(kept),
        dropped_state_tokens=len(state) - len(kept),
        schema_tokens=len(schema),
        suffix_tokens=len(suffix),
    )
