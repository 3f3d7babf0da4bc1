"""Pydantic models of the System One contract (shared/specs/systemone-api.md): what gets a 422 before
anything deeper sees the request. The validated body is then passed on as the client sent it (the
encoder renders the client's own JSON values, not pydantic's re-serialisation)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

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
    criteria: dict[str, Describable | None] = Field(min_length=2, max_length=255)


class ScoreQuestion(_Question):
    type: Literal["score"]
    criteria: list[Describable | None] = Field(min_length=2, max_length=10)  # low to high; a map is a 422


Question = Annotated[NoulQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]


class SystemOneRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown top-level fields are ignored

    model: str
    state: str | dict[str, Any] | list[Any]
    questions: dict[QuestionId, Question] = Field(min_length=1, max_length=64)
