"""The prefix key: a routing hint that sends requests with the same state to the same replica, where its
prefix-cache entry lives (shared/specs/scale-out.md). Clients may compute it themselves before their
first call; clef-serve returns it on every 200 as `X-Clef-Prefix-Key`, with `X-Clef-Prefix-Cache:
hit|miss`. It is only a hint for load balancers: the server never uses a client's key for its own cache
lookups (those compare the tokens themselves).

    key = "c1-" + sha256(model, 0x00, JCS(state), 0x00, sha256(image 1) sha256(image 2) ...
                         [, 0x00, sha256(video 1) sha256(video 2) ...])[:32 hex]

- model: the request's `model` string as sent, UTF-8;
- JCS(state): the state's canonical JSON, RFC 8785 (PyPI `rfc8785`), UTF-8; a state holding NaN, an
  infinity or an integer beyond 2^53 (which RFC 8785 cannot represent) uses Python's
  `json.dumps(state, sort_keys=True, separators=(",", ":"), ensure_ascii=False)` instead;
- the images: the raw 32-byte SHA-256 of each image's file bytes (as uploaded, base64 decoded), in the
  order the record places them (`images` first, then assets), nothing when there are none;
- the videos, which the record places after the images and before the state: nothing when there are none
  (so a request without videos keeps the key it had before videos were taken), else one 0x00 byte and the raw
  32-byte SHA-256 of each video's file bytes (as uploaded, base64 decoded), in the record's order (`videos`
  first, then assets).

Pinned values (tests/test_routing.py) let clients in other languages check their implementation.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import rfc8785

VERSION = "c1"


def canonical_state(state: Any) -> bytes:
    """RFC 8785 canonical JSON of the state (see the module docstring for what it cannot represent)."""
    if isinstance(state, str):
        # A string's RFC 8785 form is ECMAScript's JSON.stringify: exactly json.dumps(ensure_ascii=False)
        # (", \ and control characters escaped, \u00xx lowercase, the rest literal), in C.
        return json.dumps(state, ensure_ascii=False).encode("utf-8")
    try:
        return rfc8785.dumps(state)
    except rfc8785.CanonicalizationError:  # NaN, infinities, integers past 2^53
        return json.dumps(state, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def prefix_key(model: str, state: Any, images: Sequence[bytes] = (), videos: Sequence[bytes] = ()) -> str:
    """The X-Clef-Prefix-Key of a request with this model, state, image files and video files."""
    digest = hashlib.sha256()
    digest.update(model.encode("utf-8"))
    digest.update(b"\x00")
    digest.update(canonical_state(state))
    digest.update(b"\x00")
    for image in images:
        digest.update(hashlib.sha256(image).digest())
    if videos:  # the 0x00 keeps an image and a video of the same bytes apart
        digest.update(b"\x00")
        for video in videos:
            digest.update(hashlib.sha256(video).digest())
    return f"{VERSION}-{digest.hexdigest()[:32]}"
