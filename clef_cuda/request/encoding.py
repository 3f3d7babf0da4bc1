"""A System One request -> token ids + question/option spans, exactly as the upstream reference encodes it
(shared/specs/clef-decision.md section 3): each text segment tokenised on its own, the record layout,
JSON rendering, option order and the token budget."""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clef_cuda.errors import ReleaseError, RequestError, RequestTooLongError

if TYPE_CHECKING:
    from clef_cuda.model.config import MediaTokens
    from clef_cuda.request.images import PreparedImage
    from clef_cuda.request.videos import PreparedVideo

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
CLIENT_SPECIAL_TOKENS = ("control", "text")


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
    is what the file says anyway). No BOS/EOS is added.

    Special tokens (<|im_start|>, <|im_end|>, ...) written in the record's own template are control
    tokens. In client text they are too by default ("control": the reference's behaviour, kept for
    parity), which lets a state forge the prompt's structure; client_special_tokens="text" tokenises
    them in client text as the plain characters they are (a prompt-injection defence)."""

    # Long segments (a state sent again with new questions) are remembered: re-tokenising a 16k-token
    # state costs milliseconds on every request that repeats it.
    CACHED_MIN_CHARS = 1024
    CACHE_ENTRIES = 64
    CACHE_CHARS = 1 << 24  # and at most this much remembered text in all
    # Longer texts are tokenised a piece at a time (so a huge one can be given up on early, and no more
    # than one piece's token strings and offsets, which the tokenizer keeps beside the ids, are held).
    PIECE_CHARS = 1 << 16

    def __init__(self, backend, client_backend=None, client_special_tokens: str = "control") -> None:
        import threading
        from collections import OrderedDict

        if client_special_tokens not in CLIENT_SPECIAL_TOKENS:
            raise ValueError(
                f"client_special_tokens must be one of {CLIENT_SPECIAL_TOKENS}, got {client_special_tokens!r}"
            )
        self._template = backend
        self._client = client_backend or backend
        self.client_special_tokens = client_special_tokens
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._cached_chars = 0
        # Characters of client text handed to the tokenizer, in all: what the budget bounds (a refused huge
        # state costs its first budget's worth, not its size). /metrics exports it.
        self.tokenized_chars = 0
        self._lock = threading.Lock()
        added = [t.content for t in backend.get_added_tokens_decoder().values()]
        self._added_tokens = [t for t in added if t]
        self._longest_added = max((len(t) for t in self._added_tokens), default=0)
        # Every token covers at most this many bytes of (NFC-normalised) text: a lower bound on the
        # count of any text is its UTF-8 length over this.
        byte_level = max((len(t) for t in backend.get_vocab(with_added_tokens=False)), default=1)
        self.max_token_bytes = max([byte_level, 1] + [len(t.encode("utf-8")) for t in self._added_tokens])

    @classmethod
    def from_release(cls, model_dir: str | Path, client_special_tokens: str = "control") -> Tokenizer:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ReleaseError(f"{path}: missing (the release's tokenizer)")
        backend = _qwen35_backend(path)
        client = None
        if client_special_tokens == "text":
            client = _qwen35_backend(path)
            client.encode_special_tokens = True  # special tokens in this text are split like any text
        return cls(backend, client, client_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._template.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Template text: special tokens are control tokens."""
        return self._template.encode(text, add_special_tokens=False).ids

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode_client(text)), in C-speed passes (no tokenisation)."""
        if not text:
            return 0
        if not text.isascii():
            if not unicodedata.is_normalized("NFC", text):
                text = unicodedata.normalize("NFC", text)
            return -(-len(text.encode("utf-8", "surrogatepass")) // self.max_token_bytes)
        return -(-len(text) // self.max_token_bytes)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """Client text (with template text that has no special tokens), each text on its own."""
        out: list[list[int] | None] = [self._remembered(text) for text in texts]
        todo = [i for i, ids in enumerate(out) if ids is None]
        self.tokenized_chars += sum(len(texts[i]) for i in todo)
        fresh = self._client.encode_batch([texts[i] for i in todo], add_special_tokens=False)
        for i, encoding in zip(todo, fresh, strict=True):
            out[i] = encoding.ids
            self._remember(texts[i], encoding.ids)
        return out

    def encode_bounded(self, text: str, limit: int) -> tuple[list[int], bool]:
        """Client text -> (ids, complete). Once more than `limit` ids are known the rest of the text is
        not tokenised: the ids returned are then the text's first ones (more than `limit` of them) and
        complete is False. A long text goes through in pieces cut only where the tokenizer splits anyway
        (see safe_cut), so the ids are those of one pass over the whole text."""
        remembered = self._remembered(text)
        if remembered is not None:
            return remembered, True
        ids: list[int] = []
        start = 0
        while start < len(text):
            cut = self.safe_cut(text, start + self.PIECE_CHARS)
            self.tokenized_chars += cut - start
            ids += self._client.encode_batch_fast([text[start:cut]], add_special_tokens=False)[0].ids
            start = cut
            if len(ids) > limit and start < len(text):
                return ids, False
        self._remember(text, ids)
        return ids, True

    def safe_cut(self, text: str, position: int) -> int:
        """The first position >= `position` where tokenising text[:p] and text[p:] apart gives the ids of
        text (len(text) if there is none). Qwen3.5's split regex never joins a word character (letter,
        digit, underscore) to a following space, nor a newline to a following word character, and it has
        no lookbehind, so at such a boundary both sides split into the same pieces as the whole does;
        NFC composes nothing across either boundary. Boundaries inside (or touching) an added token's
        occurrence are skipped: added tokens are matched before the split."""
        if position >= len(text):
            return len(text)
        for match in _SAFE_CUT.finditer(text, position):
            cut = match.start()
            if not self._touches_added_token(text, cut):
                return cut
        return len(text)

    def _touches_added_token(self, text: str, cut: int) -> bool:
        lo = max(0, cut - self._longest_added)
        window = text[lo : cut + self._longest_added]
        for token in self._added_tokens:
            found = window.find(token)
            while found != -1:
                if lo + found <= cut <= lo + found + len(token):
                    return True
                found = window.find(token, found + 1)
        return False

    def _remembered(self, text: str) -> list[int] | None:
        if len(text) < self.CACHED_MIN_CHARS:
            return None
        with self._lock:
            ids = self._cache.get(text)
            if ids is not None:
                self._cache.move_to_end(text)
            return ids

    def _remember(self, text: str, ids: list[int]) -> None:
        if len(text) < self.CACHED_MIN_CHARS or len(text) > self.CACHE_CHARS:
            return
        with self._lock:
            if text in self._cache:
                return
            self._cache[text] = ids
            self._cached_chars += len(text)
            while len(self._cache) > self.CACHE_ENTRIES or self._cached_chars > self.CACHE_CHARS:
                old, _ = self._cache.popitem(last=False)
                self._cached_chars -= len(old)


# Boundaries where the Qwen3.5 split regex always splits (Tokenizer.safe_cut): before a space that
# follows a word character, after a newline that precedes one.
_SAFE_CUT = re.compile(r"(?<=\w)(?= )|(?<=\n)(?=\w)")


def _qwen35_backend(path: Path):
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as Backend

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
    return backend


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
        if kind == "box":  # TypeSafe's locate-in-image type: it needs a head clef does not have
            raise RequestError(
                f"{question_id}: clef has no box head; it answers noul, choice and score questions", (*loc, "type")
            )
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
class MediaSpan:
    """One image's <|image_pad|> tokens (or one group of a video's frames, its <|video_pad|> tokens) in a record:
    where its feature rows go."""

    start: int  # index of its first <|image_pad|> token
    length: int  # tokens = feature rows
    merged_grid: tuple[int, int]  # (rows, columns) of merged patch blocks, raster order
    digest: bytes  # content digest (decoded pixels + preprocessing): what the caches key on
    video: bool = False  # a video's group of frames (<|video_pad|> tokens), not an image

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class EncodedRecord:
    input_ids: tuple[int, ...]
    questions: tuple[EncodedQuestion, ...]
    prefix_tokens: int  # the template's prefix and, after it, every image's block
    state_tokens: int  # kept
    dropped_state_tokens: int  # cut by truncation (0 unless the policy is "truncate")
    schema_tokens: int
    suffix_tokens: int
    dropped_state_tokens_exact: bool = True  # False: truncation stopped counting (a lower bound)
    media: tuple[MediaSpan, ...] = ()
    media_tokens: int = 0  # every token of the image blocks (framing included)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def media_digests(self, end: int) -> tuple[bytes, ...]:
        """Digests of the images among the first `end` tokens: with the tokens, what a prefix is."""
        return tuple(m.digest for m in self.media if m.start < end)

    def inside_media(self, position: int) -> bool:
        """Whether a cut at `position` would fall inside an image's tokens."""
        return any(m.start < position < m.end for m in self.media)

    def rope_positions(self):
        """[3, N] int64 (T, H, W) positions, as transformers' get_rope_index: text runs count up on all
        three axes; image token (r, c) of a merged (lh, lw) grid gets (p, p + r, p + c) with p the next
        text position, and the text after it continues from p + max(lh, lw). None for a text-only record
        (then the position is the token index on every axis)."""
        if not self.media:
            return None
        import torch

        positions = torch.arange(self.num_tokens).expand(3, -1).clone()
        shift = 0  # how far text positions lag token indices after the images so far
        for span in self.media:
            rows, cols = span.merged_grid
            p = span.start - shift
            grid_r = torch.arange(rows).repeat_interleave(cols)
            grid_c = torch.arange(cols).repeat(rows)
            positions[0, span.start : span.end] = p
            positions[1, span.start : span.end] = p + grid_r
            positions[2, span.start : span.end] = p + grid_c
            shift += span.length - max(rows, cols)
            positions[:, span.end :] -= span.length - max(rows, cols)
        return positions

    def truncation_fields(self) -> dict[str, Any]:
        """The response's extension fields when truncation cut the state (none otherwise)."""
        if not self.dropped_state_tokens:
            return {}
        fields: dict[str, Any] = {"x_truncated_state_tokens": self.dropped_state_tokens}
        if not self.dropped_state_tokens_exact:
            fields["x_truncated_state_tokens_exact"] = False  # at least that many
        return fields


def encode_request(
    tokenizer: Tokenizer,
    request: dict[str, Any],
    max_length: int = 16384,
    state_overflow: str = "reject",
    images: Sequence[PreparedImage] = (),
    media_tokens: MediaTokens | None = None,
    videos: Sequence[PreparedVideo] = (),
) -> EncodedRecord:
    """Encode a validated request. Over max_length: RequestTooLongError with the counts ("reject", the
    default), or the reference's behaviour ("truncate": keep the head of the state, cut its tail).

    The work is bounded by the budget, not by the body: a cheap lower bound on the token count refuses
    hopeless records before any tokenisation, and the state is tokenised only until the budget is
    passed (reject) or, beyond what truncation keeps, for at most one more budget's worth (truncate:
    x_truncated_state_tokens is then a lower bound, flagged by dropped_state_tokens_exact).

    `images` (prepared, in request order) go right after the template's prefix, as the reference places
    them: <|vision_start|> <|image_pad|> x tokens <|vision_end|> per image; then `videos`, each as the reference's
    processor writes one: <|vision_start|>, then per group of frames its time as text ("<1.6 seconds>") and
    <|vision_start|> <|video_pad|> x tokens <|vision_end|>, then <|vision_end|>; then one newline. Their tokens
    count toward the budget (`media_tokens`: the release's ids for them)."""
    if state_overflow not in STATE_OVERFLOW_POLICIES:
        raise ValueError(f"state_overflow must be one of {STATE_OVERFLOW_POLICIES}, got {state_overflow!r}")
    # Every segment is tokenised on its own: the span of a segment is exactly its tokens.
    state_text = render(request["state"])
    segments: list[str] = [SCHEMA_HEADER]
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
    prefix, suffix = tokenizer.encode(PREFIX), tokenizer.encode(SUFFIX)  # the template: control tokens
    media: list[MediaSpan] = []
    if images or videos:
        if media_tokens is None:
            raise ValueError("images and videos need the release's media token ids")
        block: list[int] = []
        for image in images:
            block.append(media_tokens.vision_start)
            media.append(MediaSpan(len(prefix) + len(block), image.num_tokens, image.merged_grid, image.digest))
            block += [media_tokens.image] * image.num_tokens + [media_tokens.vision_end]
        for video in videos:
            block.append(media_tokens.vision_start)
            for group, seconds in zip(video.groups, video.timestamps, strict=True):
                block += tokenizer.encode(f"<{seconds:.1f} seconds>") + [media_tokens.vision_start]
                span = MediaSpan(len(prefix) + len(block), group.num_tokens, group.merged_grid, group.digest, True)
                media.append(span)
                block += [media_tokens.video] * group.num_tokens + [media_tokens.vision_end]
            block.append(media_tokens.vision_end)
        block += tokenizer.encode("\n")
        media_count = len(block)
        prefix = prefix + block
    else:
        media_count = 0

    def too_long(needed: int, state_tokens: int, fixed_tokens: int, at_least: bool) -> RequestTooLongError:
        more = "at least " if at_least else ""
        return RequestTooLongError(
            f"the record needs {more}{needed} tokens ({more}{state_tokens} of state, {fixed_tokens} of prompt and "
            f"schema), over this server's maximum context length of {max_length} tokens a record (its maximum model "
            "length, --max-model-len)",
            input_tokens=needed,
            max_tokens=max_length,
            fixed_tokens=fixed_tokens,
            at_least=at_least,
        )

    fixed_bound = len(prefix) + len(suffix) + sum(tokenizer.min_tokens(text) for text in segments)
    if fixed_bound > max_length:  # the schema alone is over: nothing is tokenised
        raise too_long(
            fixed_bound + tokenizer.min_tokens(state_text), tokenizer.min_tokens(state_text), fixed_bound, True
        )
    ids = tokenizer.encode_many(segments)
    if images or videos:
        _refuse_literal_media_tokens(ids, media_tokens)

    schema: list[int] = list(ids[0])
    cursor = 1
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

    fixed = len(prefix) + len(schema) + len(suffix)
    budget = max_length - fixed
    if state_overflow == "reject":
        state_bound = tokenizer.min_tokens(state_text)
        if budget < 0 or state_bound > budget:
            raise too_long(fixed + state_bound, state_bound, fixed, True)
        state, complete = tokenizer.encode_bounded(state_text, budget)
        if not complete or len(state) > budget:
            raise too_long(fixed + len(state), len(state), fixed, not complete)
    else:
        if budget < 0:
            raise too_long(fixed + tokenizer.min_tokens(state_text), tokenizer.min_tokens(state_text), fixed, True)
        state, complete = tokenizer.encode_bounded(state_text, budget + max_length)
    if images or videos:
        _refuse_literal_media_tokens([state], media_tokens, ("state",))
    kept = state[:budget]
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
        dropped_state_tokens_exact=complete,
        media=tuple(media),
        media_tokens=media_count,
    )


def _refuse_literal_media_tokens(segments: list[list[int]], tokens: MediaTokens, loc: tuple = ("questions",)) -> None:
    """An image request whose own text holds <|image_pad|> or <|video_pad|> (as control tokens): the
    features would land on them. The reference raises; so do we, as a 422."""
    pads = {tokens.image, tokens.video}
    if any(pads.intersection(ids) for ids in segments):
        raise RequestError(
            "the text contains <|image_pad|> or <|video_pad|>, which an image request cannot hold "
            "(serve with --client-special-tokens text to take them as plain text)",
            loc,
        )
