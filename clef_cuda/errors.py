"""One exception type per kind of failure; the HTTP layer maps each to a status code in one place."""

from __future__ import annotations


class ClefError(Exception):
    """Base class of every error this package raises on purpose."""


class ReleaseError(ClefError):
    """The model directory is not a usable clef-flash release (missing/corrupt file, wrong shape, bad
    config). The message names the file and, where there is one, the field or tensor."""


class RequestError(ClefError, ValueError):
    """The request is not a valid System One request (HTTP 422). `loc` points into the body."""

    def __init__(self, message: str, loc: tuple = ()) -> None:
        super().__init__(message)
        self.loc = loc


class RequestTooLongError(ClefError):
    """The encoded record does not fit the token budget (HTTP 413). Carries the counts."""

    def __init__(
        self, message: str, *, input_tokens: int, max_tokens: int, fixed_tokens: int, at_least: bool = False
    ) -> None:
        super().__init__(message)
        self.input_tokens = input_tokens  # a lower bound when at_least (tokenisation stopped early)
        self.at_least = at_least
        self.max_tokens = max_tokens
        self.fixed_tokens = fixed_tokens


class NumericalOverflowError(ClefError):
    """Non-finite hidden states: the serving dtype overflowed (f16 tops out at 65504). A server fault."""
