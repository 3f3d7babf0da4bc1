"""Pydantic models of the System One contract (shared/specs/systemone-api.md): what gets a 422 before
anything deeper sees the request. The validated body is then passed on as the client sent it (the
encoder renders the client's own JSON values, not pydantic's re-serialisation)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints

# What one request may hold (shared/specs/systemone-api.md), named in every refusal (capacity_message).
QUESTIONS_PER_REQUEST = (1, 64)
OPTIONS_PER_CHOICE = (2, 255)
LEVELS_PER_SCORE = (2, 10)

# A description or instruction: any JSON text, object or array (or null where the contract allows it).
Describable = str | dict[str, Any] | list[Any]
QuestionId = Annotated[str, StringConstraints(min_length=1)]


class _Question(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as the reference does

    instructions: Describable | None = None  # missing, null or "": the question id is used


class NoulQuestion(_Question):
    type: Literal["noul"]
    # Absent, null, {"true": d, "false": d} or one-sided; other keys are ignored.
    criteria: dict[str, Describable | None] | None = None


class ChoiceQuestion(_Question):
    type: Literal["choice"]
    criteria: dict[str, Describable | None] = Field(min_length=OPTIONS_PER_CHOICE[0], max_length=OPTIONS_PER_CHOICE[1])


def _no_null_level(levels: Any) -> Any:
    if isinstance(levels, list):
        for index, level in enumerate(levels):
            if level is None:
                raise ValueError(
                    f"score level {index} is null: each level needs a description (a string, object or array); "
                    "the official SDK rejects a null legend value"
                )
    return levels


class ScoreQuestion(_Question):
    type: Literal["score"]
    # Low to high; a map is a 422. A null level is refused before the type check, with a clear message.
    criteria: Annotated[list[Describable], BeforeValidator(_no_null_level)] = Field(
        min_length=LEVELS_PER_SCORE[0], max_length=LEVELS_PER_SCORE[1]
    )


Question = Annotated[NoulQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]


class ImageObject(BaseModel):
    """Cloudflare's object form of an image."""

    content_type: str
    base64: str


class MediaAsset(BaseModel):
    """A TypeSafe asset, an image or a video: inline (data_base64) or, in a multipart body, the name of its part."""

    model_config = ConfigDict(extra="allow")

    type: Literal["image", "video"]
    format: str | None = None
    data_base64: str | None = None
    part: str | None = None


class SystemOneRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown top-level fields are ignored

    model: str
    state: str | dict[str, Any] | list[Any]
    questions: dict[QuestionId, Question] = Field(
        min_length=QUESTIONS_PER_REQUEST[0], max_length=QUESTIONS_PER_REQUEST[1]
    )
    # Images (clef_cuda/request/media.py): data URLs, {content_type, base64} objects or plain base64 (Cloudflare,
    # ollama)...
    images: list[str | ImageObject] | None = None
    # ... or TypeSafe assets, referenced by placeholders in the text (images and videos alike).
    assets: dict[str, MediaAsset] | None = None
    # Videos (clef_cuda/request/videos.py): data URLs, {content_type, base64} objects or plain base64, MP4 or WebM.
    videos: list[Any] | None = None


def capacity_message(loc: tuple, kind: str, sent: int | None) -> str | None:
    """A refusal of too many or too few questions, options or levels in the words benchmark harnesses and
    clients read as "unsupported" (shared/specs/clients.md: "options per choice", "a choice needs at least two
    options", "a score takes 2 to 10 levels"; the kind's limit: "levels per score", "questions per request"),
    naming the kind, the limit and the value sent; None for any other error (pydantic's own message stands).
    loc: pydantic's, without "body"; sent: how many the client sent."""
    if kind not in ("too_long", "too_short") or sent is None:
        return None
    loc = tuple(loc)
    if loc == ("questions",):
        low, high = QUESTIONS_PER_REQUEST
        return f"{sent} questions sent: {low} to {high} questions per request"
    if len(loc) == 4 and loc[0] == "questions" and loc[2:] == ("choice", "criteria"):
        low, high = OPTIONS_PER_CHOICE
        fewer = "a choice needs at least two options; " if kind == "too_short" else ""
        return f"choice question {loc[1]!r} has {sent} options: {fewer}{low} to {high} options per choice"
    if len(loc) == 4 and loc[0] == "questions" and loc[2:] == ("score", "criteria"):
        low, high = LEVELS_PER_SCORE
        return f"score question {loc[1]!r} has {sent} levels: a score takes {low} to {high} levels per score"
    return None


# Question types of TypeSafe's schema that clef has no head for: a 422 saying so (not a generic tag error).
UNSUPPORTED_QUESTION_TYPES = {
    "box": "clef has no box head (box is TypeSafe's locate-in-image type): it answers noul, choice and score questions"
}


def unsupported_question_errors(body: Any) -> list[dict[str, Any]]:
    """422 items for questions of a type clef cannot answer, before the schema's own checks."""
    questions = body.get("questions") if isinstance(body, dict) else None
    if not isinstance(questions, dict):
        return []
    return [
        {
            "loc": ["body", "questions", question_id, "type"],
            "msg": UNSUPPORTED_QUESTION_TYPES[q["type"]],
            "type": "value_error",
        }
        for question_id, q in questions.items()
        if isinstance(q, dict) and isinstance(q.get("type"), str) and q["type"] in UNSUPPORTED_QUESTION_TYPES
    ]
