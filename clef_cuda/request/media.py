"""Images and videos in a request, in every client's wire form, become one ordered list of image bytes and one of
video bytes (shared/specs/vision.md, "Wire forms"):

1. Cloudflare `images`: data URLs or {content_type, base64} objects; 2. ollama `images`: plain base64;
3. TypeSafe `assets` {placeholder: {"type": "image", "format", "data_base64"}} with the placeholders in
   the text; 4. TypeSafe multipart/form-data: part `request` is the JSON body, whose assets name the
   other parts ({"type": "image", "part": "asset-0"}), each claimed by exactly one asset.

Order: `images` first, then assets by the first appearance of their placeholder in the record's text
(state, then each question's instructions and options, in the order the record renders them), then
assets never referenced. Each placeholder is replaced in the text by `[image N]`, N the image's place
in that list. Placeholders are the SDK's `<image:` + 32 hex digits + `>` wherever they occur in a
string; any other asset name only as a whole string value (so an asset named "photo" does not rewrite
every "photo" in the state). Nothing here fetches, opens or decodes anything: bytes and their checks
only (clef_cuda.request.images decodes later, once the cheap limits passed). The byte limits are checked here, once
a request (ImageLimits: the count, each image's bytes before its base64 is decoded, their total). Errors are
ImageError: 413 over a byte limit (its message naming the image's place: "assets.<image:...>: the image is ..."),
else 422, `loc` the place in the body.

Videos take the same forms: `videos` entries (data URLs data:video/mp4 or webm;base64,..., {content_type, base64}
objects, plain base64) first, then assets {"type": "video", "format": "mp4"|"webm", "data_base64" | "part"} in the
record's order, each placeholder rewritten `[video N]`; their errors are VideoError (clef_cuda.request.videos).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from clef_cuda.request.encoding import question_options, render
from clef_cuda.request.images import ImageError, ImageLimits, base64_size, strict_base64, wire_image_bytes
from clef_cuda.request.videos import VideoError, VideoLimits, wire_video_bytes

SDK_PLACEHOLDER = re.compile(r"<image:[0-9a-f]{32}>")
ASSET_FORMATS = {"image": ("png", "jpg", "jpeg", "webp"), "video": ("mp4", "webm")}


@dataclass
class RequestMedia:
    """A request's images and videos, as collected from its wire forms, each with its place in the body."""

    images: list[bytes] = field(default_factory=list)  # in the order the record places them
    sources: list[list] = field(default_factory=list)  # each image's place in the body (an error's loc)
    videos: list[tuple[bytes, str | None]] = field(default_factory=list)  # (bytes, declared format), in order
    video_sources: list[list] = field(default_factory=list)

    def loc_of(self, error_loc: tuple) -> list:
        """An error about image (or video) i of the combined list, located where the client put it."""
        for kind, sources in (("images", self.sources), ("videos", self.video_sources)):
            if len(error_loc) >= 2 and error_loc[0] == kind and isinstance(error_loc[1], int):
                if 0 <= error_loc[1] < len(sources):
                    return sources[error_loc[1]]
        return ["body", *error_loc]


def _refuse(loc: list, error: ImageError | str, error_type: str = "value_error", kind: type = ImageError):
    """The error for the image or video at `loc` (["body", ...]): a 413 names its place in its message."""
    kind = type(error) if isinstance(error, ImageError) else kind
    if isinstance(error, ImageError) and error.status == 413:
        return kind(f"{'.'.join(str(x) for x in loc[1:])}: {error}", 413, tuple(loc[1:]))
    return kind(str(error), 422, tuple(loc[1:]), error_type)


# ---- the four forms --------------------------------------------------------------------------------
def collect_media(
    body: dict[str, Any],
    parts: dict[str, bytes] | None,
    limits: ImageLimits,
    video_limits: VideoLimits = VideoLimits(),
) -> RequestMedia:
    """The request's images and videos in record order; placeholders in `body` rewritten in place as [image N] and
    [video N]. `body` has passed the schema; `parts` are the multipart parts besides `request` (None: a JSON body)."""
    found = RequestMedia()
    entries, videos, assets = body.get("images"), body.get("videos"), body.get("assets")
    for name, value in (("images", entries), ("videos", videos)):
        if value is not None and not isinstance(value, list):
            raise _refuse(["body", name], f"{name} must be an array", "value_error")
    if assets is not None and not isinstance(assets, dict):
        raise _refuse(["body", "assets"], "assets must be an object: placeholder -> asset", "value_error")
    entries, videos, assets = entries or [], videos or [], assets or {}
    image_assets = {n: a for n, a in assets.items() if not (isinstance(a, dict) and a.get("type") == "video")}
    video_assets = {n: a for n, a in assets.items() if n not in image_assets}
    limits.check_count(len(entries) + len(image_assets), ("images" if entries else "assets",))
    try:
        video_limits.check_count(len(videos) + len(video_assets), ("videos" if videos else "assets",))
    except VideoError as error:
        raise _refuse(["body", *error.loc], error) from error
    for index, entry in enumerate(entries):
        try:
            found.images.append(wire_image_bytes(entry, limits))
        except ImageError as error:
            raise _refuse(["body", "images", index], error) from error
        found.sources.append(["body", "images", index])
    for index, entry in enumerate(videos):
        try:
            found.videos.append(wire_video_bytes(entry, video_limits))
        except VideoError as error:
            raise _refuse(["body", "videos", index], error) from error
        found.video_sources.append(["body", "videos", index])
    claimed: set[str] = set()
    image_order = _assets_in_record_order(body, image_assets)
    video_order = _assets_in_record_order(body, video_assets)
    for name in image_order:
        loc = ["body", "assets", name]
        found.images.append(_asset_bytes(assets[name], parts, claimed, loc, limits))
        found.sources.append(loc)
    for name in video_order:
        loc = ["body", "assets", name]
        data = _asset_bytes(assets[name], parts, claimed, loc, video_limits, "video")
        declared = assets[name].get("format")
        found.videos.append((data, declared.lower() if isinstance(declared, str) else None))
        found.video_sources.append(loc)
    if parts is not None and set(parts) - claimed:
        unclaimed = sorted(set(parts) - claimed)[0]
        raise _refuse(["body"], f"multipart part {unclaimed!r} is claimed by no asset", "multipart_invalid")
    limits.check_total([len(image) for image in found.images])
    if assets:
        numbers = {name: ("image", len(entries) + i + 1) for i, name in enumerate(image_order)}
        numbers |= {name: ("video", len(videos) + i + 1) for i, name in enumerate(video_order)}
        _render_placeholders(body, numbers)
    _refuse_unattached_placeholders(body)
    return found


def _refuse_unattached_placeholders(body: dict[str, Any]) -> None:
    """A placeholder left in the text names an image the request does not carry: the official SDK sends
    an f-string's image only when it is attached (client.attach_assets(img) or assets=). Answering the
    placeholder as text would decide without the image the caller meant: a 422 naming it instead."""
    places: list[tuple[list, Any]] = [(["body", "state"], body["state"])]
    for question_id, question in body["questions"].items():
        where = ["body", "questions", question_id]
        places += [(where, question_id), ([*where, "instructions"], question.get("instructions"))]
        criteria = question.get("criteria")
        if isinstance(criteria, dict):
            places += [([*where, "criteria", key], (key, value)) for key, value in criteria.items()]
        elif isinstance(criteria, list):
            places += [([*where, "criteria", index], value) for index, value in enumerate(criteria)]
    for loc, value in places:
        text = value if isinstance(value, str) else render(value)
        found = SDK_PLACEHOLDER.search(text) if "<image:" in text else None
        if found:
            raise _refuse(
                loc,
                f"{found[0]} names an image the request does not carry: no asset of that name (attach it with "
                "the SDK's client.attach_assets(image) or assets=, or remove the placeholder)",
                "value_error",
            )


def _asset_bytes(
    asset: Any, parts: dict[str, bytes] | None, claimed: set[str], loc: list, limits, kind: str = "image"
) -> bytes:
    error_kind = VideoError if kind == "video" else ImageError
    if not isinstance(asset, dict) or asset.get("type") != kind:
        raise _refuse(loc, 'an asset must be {"type": "image" or "video", ...}', "value_error")
    declared = asset.get("format")
    formats = ASSET_FORMATS[kind]
    if declared is not None and (not isinstance(declared, str) or declared.lower() not in formats):
        raise _refuse([*loc, "format"], f"format must be one of {', '.join(formats)}", "value_error", error_kind)
    if "part" in asset:
        name = asset["part"]
        if parts is None:
            raise _refuse(
                [*loc, "part"], "an asset names a multipart part, but the body is not multipart", "value_error"
            )
        if not isinstance(name, str) or name not in parts:
            raise _refuse([*loc, "part"], f"no multipart part named {str(name)[:60]!r}", "value_error")
        if name in claimed:
            raise _refuse([*loc, "part"], f"multipart part {name!r} is claimed by two assets", "value_error")
        claimed.add(name)
        data = parts[name]
        try:
            limits.check_size(len(data))
        except ImageError as error:
            raise _refuse(loc, error) from error
        return data
    encoded = asset.get("data_base64")
    if not isinstance(encoded, str):
        raise _refuse(
            loc, f"an {kind} asset needs data_base64 (or, in a multipart body, part)", "value_error", error_kind
        )
    try:
        limits.check_size(base64_size(encoded))
    except ImageError as error:
        raise _refuse(loc, error) from error
    try:
        return strict_base64(encoded, "data_base64")
    except ImageError as error:
        raise _refuse([*loc, "data_base64"], error_kind(str(error))) from error


def _record_texts(body: dict[str, Any]) -> list[str]:
    """The client strings of the record, in the order the record renders them."""
    texts = [render(body["state"])]
    for question_id, question in body["questions"].items():
        instructions = question.get("instructions")
        texts.append(render(instructions) if instructions not in (None, "") else str(question_id))
        texts += [render(description) for _, description in question_options(question) if description is not None]
    return texts


def _mentions(text: str, name: str) -> int:
    """Where `name` first appears in a rendered text as a placeholder (-1: nowhere)."""
    if SDK_PLACEHOLDER.fullmatch(name):
        return text.find(name)
    quoted = text.find(render(name))  # a whole JSON string value inside a rendered object
    return 0 if text == name else quoted


def _assets_in_record_order(body: dict[str, Any], assets: dict[str, Any]) -> list[str]:
    texts = _record_texts(body)
    first: dict[str, tuple[int, int]] = {}
    for name in assets:
        for index, text in enumerate(texts):
            at = _mentions(text, name)
            if at >= 0:
                first[name] = (index, at)
                break
    referenced = sorted(first, key=first.__getitem__)
    return referenced + [name for name in assets if name not in first]


def _render_placeholders(body: dict[str, Any], numbers: dict[str, tuple[str, int]]) -> None:
    """Every placeholder occurrence in state, instructions and option descriptions -> [image N] or [video N]."""
    sdk = {name: f"[{kind} {n}]" for name, (kind, n) in numbers.items() if SDK_PLACEHOLDER.fullmatch(name)}
    exact = {name: f"[{kind} {n}]" for name, (kind, n) in numbers.items() if name not in sdk}

    def rewrite(value: Any) -> Any:
        if isinstance(value, str):
            if value in exact:
                return exact[value]
            if "<image:" in value:
                return SDK_PLACEHOLDER.sub(lambda m: sdk.get(m[0], m[0]), value)
            return value
        if isinstance(value, dict):
            return {key: rewrite(item) for key, item in value.items()}
        if isinstance(value, list):
            return [rewrite(item) for item in value]
        return value

    body["state"] = rewrite(body["state"])
    for question in body["questions"].values():
        if "instructions" in question:
            question["instructions"] = rewrite(question["instructions"])
        criteria = question.get("criteria")
        if isinstance(criteria, dict):
            question["criteria"] = {key: rewrite(item) for key, item in criteria.items()}
        elif isinstance(criteria, list):
            question["criteria"] = [rewrite(item) for item in criteria]
