"""Images: bytes from a client -> the vision tower's input, exactly as the reference's processor makes it
(shared/specs/vision.md, "Decoding and preprocessing").

Hostile uploads are refused cheaply before anything is decoded: the format is read from the magic bytes
(PNG, JPEG, WebP, whatever the client declared), and the width, height, bit depth and frame count from
the header alone, so a 60-byte PNG that declares 20000 x 20000 pixels costs microseconds, not 1.2 GB.
Only then does torchvision decode it (RGB, alpha dropped, EXIF orientation applied: what the reference
does with a data URL), and the release's image processor settings resize, normalise and patchify it.
Nothing here opens a path or a URL: the input is always bytes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clef_cuda.errors import ClefError, ReleaseError

Tensor = torch.Tensor
FORMATS = ("png", "jpeg", "webp")
# data:image/<type>;base64,<data> (the reference's form; "data:" matched case-insensitively).
_DATA_URL = re.compile(r"data:image/(png|jpeg|jpg|webp);base64,", re.IGNORECASE)
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")


class ImageError(ClefError, ValueError):
    """An image a client sent cannot be used: `status` 413 when it is over a byte or pixel limit, else 422;
    `loc` points into the body (("images", 2), ("assets", "<image:...>")); `error_type` names the kind of 422
    ("value_error"; "multipart_invalid" for a multipart part no asset claims)."""

    def __init__(self, message: str, status: int = 422, loc: tuple = ("images",), error_type: str = "value_error"):
        super().__init__(message)
        self.status, self.loc, self.error_type = status, loc, error_type


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may be (the server's --max-images and the documented fixed limits). Each rule
    is checked once a request, where its images are collected from the body (request_images; the HTTP forms:
    clef_cuda.request.media), bytes before any decoding; the header's rules as they are loaded (load_images)."""

    max_images: int = 4
    max_bytes: int = 4 * 2**20  # each, decoded from base64
    max_total_bytes: int = 8 * 2**20
    max_pixels: int = 16 * 2**20  # 16 megapixels, read from the header before decoding
    max_aspect: float = 200.0  # the processor's own limit

    def check_count(self, count: int, loc: tuple = ("images",)) -> None:
        if count > self.max_images:
            raise ImageError(
                f"{count} images sent: at most {self.max_images} images per request (--max-images)", loc=loc
            )

    def check_size(self, size: int) -> None:
        """One image's bytes (decoded from base64: known from its length before decoding)."""
        if size > self.max_bytes:
            raise ImageError(
                f"the image is {size / 2**20:.1f} MiB: at most {self.max_bytes / 2**20:g} MiB per image", status=413
            )

    def check_total(self, sizes: list[int]) -> None:
        total = sum(sizes)
        if total > self.max_total_bytes:
            raise ImageError(
                f"the images add up to {total / 2**20:.1f} MiB: at most {self.max_total_bytes / 2**20:g} MiB of "
                "images per request",
                status=413,
            )


@dataclass(frozen=True)
class ImageHeader:
    format: str  # png | jpeg | webp
    width: int
    height: int
    bits: int  # per channel
    animated: bool


# ---- wire forms that carry base64 ----------------------------------------------------------------
def strict_base64(text: str, what: str) -> bytes:
    """Standard base64 with padding, nothing else (no whitespace, no URL-safe alphabet)."""
    if len(text) % 4 or not _BASE64.fullmatch(text):
        raise ImageError(f"{what} is not strict standard base64")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ImageError(f"{what} is not strict standard base64 ({error})") from error


def wire_image_bytes(item: Any, limits: ImageLimits) -> bytes:
    """One entry of a request's `images` (Cloudflare: a data URL or {content_type, base64}; ollama: plain
    base64) -> its bytes. Anything else, URLs and paths included, is refused: never fetched or opened."""
    if isinstance(item, dict):
        content_type, data = item.get("content_type"), item.get("base64")
        if not isinstance(content_type, str) or not isinstance(data, str):
            raise ImageError("an image object needs string 'content_type' and 'base64' fields")
        if content_type.lower() not in ("image/png", "image/jpeg", "image/jpg", "image/webp"):
            raise ImageError(f"content_type {content_type[:40]!r} is not image/png, image/jpeg or image/webp")
        encoded = data
    elif isinstance(item, str):
        match = _DATA_URL.match(item)
        if match:
            encoded = item[match.end() :]
        elif item[:5].lower() == "data:":
            raise ImageError("a data URL must be data:image/(png|jpeg|webp);base64,<data>")
        elif re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", item):  # a scheme (":" is not base64)
            raise ImageError("images must be data URLs or base64: URLs and paths are never fetched or opened")
        elif not _BASE64.fullmatch(item) or len(item) % 4:
            # JPEG's base64 starts with "/9j/": only what is not base64 is judged a path
            if item.startswith(("/", ".", "~", "\\")):
                raise ImageError("images must be data URLs or base64: URLs and paths are never fetched or opened")
            raise ImageError("the image is neither a data URL nor strict standard base64")
        else:
            encoded = item
    else:
        raise ImageError("an image must be a data URL, a base64 string or a {content_type, base64} object")
    limits.check_size(base64_size(encoded))  # known from the base64 before decoding anything
    return strict_base64(encoded, "the image data")


def base64_size(encoded: str) -> int:
    """The bytes standard base64 `encoded` decodes to (its padding counted), without decoding it."""
    padding = len(encoded) - len(encoded.rstrip("="))
    return len(encoded) // 4 * 3 - min(padding, 2)


def request_images(request: dict[str, Any], limits: ImageLimits) -> list[bytes]:
    """The bytes of a request's `images` (the reference's field; Cloudflare and ollama forms), within the limits:
    what the in-process Decider and clef-serve batch take (the HTTP server's forms: clef_cuda.request.media).
    ImageError for a bad entry, naming it (a request's `videos`: clef_cuda.request.videos.request_videos)."""
    entries = request.get("images") or []
    if not isinstance(entries, list):
        raise ImageError("images must be an array", loc=("images",))
    limits.check_count(len(entries))
    blobs = []
    for index, entry in enumerate(entries):
        try:
            blobs.append(wire_image_bytes(entry, limits))
        except ImageError as error:
            raise ImageError(f"image {index + 1}: {error}", error.status, ("images", index)) from error
    limits.check_total([len(b) for b in blobs])
    return blobs


# ---- headers ------------------------------------------------------------------------------------------
def inspect_image(data: bytes) -> ImageHeader:
    """Format, size, bit depth and animation from the first bytes (no decoding). ImageError if unknown."""
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return _png_header(data)
    if data[:3] == b"\xff\xd8\xff":
        return _jpeg_header(data)
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return _webp_header(data)
    raise ImageError("not a PNG, JPEG or WebP image (by its first bytes)")


def _png_header(data: bytes) -> ImageHeader:
    if len(data) < 33 or data[12:16] != b"IHDR":
        raise ImageError("a truncated PNG (no IHDR header)")
    width, height, bits, color = struct.unpack(">IIBB", data[16:26])
    # Scan chunk headers (not their data) for acTL: an animated PNG. Bounded by the image's size.
    animated, offset = False, 8
    while offset + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[offset : offset + 8])
        if kind == b"acTL":
            animated = True
        if kind in (b"IDAT", b"IEND"):
            break
        offset += 12 + length
    if color not in (0, 2, 3, 4, 6):
        raise ImageError(f"a PNG with an invalid colour type {color}")
    return ImageHeader("png", width, height, bits, animated)


_JPEG_FRAMES = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg_header(data: bytes) -> ImageHeader:
    offset = 2
    while offset + 4 <= len(data):
        if data[offset] != 0xFF:
            raise ImageError("a corrupt JPEG (bad marker)")
        marker = data[offset + 1]
        if marker == 0xFF:  # fill byte
            offset += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # markers without a length
            offset += 2
            continue
        (length,) = struct.unpack(">H", data[offset + 2 : offset + 4])
        if marker in _JPEG_FRAMES:
            if offset + 9 > len(data):
                break
            bits, height, width = struct.unpack(">BHH", data[offset + 4 : offset + 9])
            return ImageHeader("jpeg", width, height, bits, False)
        if marker in (0xDA, 0xD9) or length < 2:  # scan data or the end before any frame header
            break
        offset += 2 + length
    raise ImageError("a truncated or corrupt JPEG (no frame header)")


def _webp_header(data: bytes) -> ImageHeader:
    chunk = data[12:16]
    body = data[20:]
    if chunk == b"VP8 " and len(body) >= 10 and body[3:6] == b"\x9d\x01\x2a":
        width, height = struct.unpack("<HH", body[6:10])
        return ImageHeader("webp", width & 0x3FFF, height & 0x3FFF, 8, False)
    if chunk == b"VP8L" and len(body) >= 5 and body[0] == 0x2F:
        (bits,) = struct.unpack("<I", body[1:5])
        return ImageHeader("webp", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1, 8, False)
    if chunk == b"VP8X" and len(body) >= 10:
        flags = body[0]
        width = int.from_bytes(body[4:7], "little") + 1
        height = int.from_bytes(body[7:10], "little") + 1
        return ImageHeader("webp", width, height, 8, bool(flags & 0x02))
    raise ImageError("a truncated or corrupt WebP (no frame header)")


def check_header(header: ImageHeader, limits: ImageLimits) -> None:
    """The limits a header alone decides: pixels, aspect, bits, frames."""
    if header.width <= 0 or header.height <= 0:
        raise ImageError(f"a {header.format} image of {header.width}x{header.height} pixels")
    if header.width * header.height > limits.max_pixels:
        raise ImageError(
            f"a {header.width}x{header.height} image is {header.width * header.height / 2**20:.1f} megapixels: at "
            f"most {limits.max_pixels / 2**20:g} megapixels per image",
            status=413,
        )
    if max(header.width, header.height) / min(header.width, header.height) > limits.max_aspect:
        raise ImageError(f"a {header.width}x{header.height} image is more than {limits.max_aspect:.0f}:1")
    if header.bits > 8:
        raise ImageError(f"a {header.bits}-bit {header.format} image: only 8 bits per channel are supported")
    if header.animated:
        raise ImageError(f"an animated {header.format}: only single-frame images are supported")


def decode_image(data: bytes, header: ImageHeader) -> Tensor:
    """uint8 [3, H, W] RGB, as the reference decodes a data URL (torchvision: alpha dropped, not matted;
    EXIF orientation applied)."""
    from torchvision.io import ImageReadMode
    from torchvision.io import decode_image as tv_decode

    try:
        pixels = tv_decode(
            torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB, apply_exif_orientation=True
        )
    except (RuntimeError, ValueError) as error:
        raise ImageError(
            f"the {header.format} image could not be decoded ({str(error).splitlines()[0][:200]})"
        ) from error
    if pixels.dtype != torch.uint8 or pixels.dim() != 3 or pixels.shape[0] != 3:
        raise ImageError(f"the {header.format} image decoded to {tuple(pixels.shape)} {pixels.dtype}, not 8-bit RGB")
    return pixels


# ---- the release's image processor ------------------------------------------------------------------
@dataclass(frozen=True)
class ImageProcessorConfig:
    """processor_config.json["image_processor"] (or preprocessor_config.json) of the release."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale_factor: float
    resample: str  # "bicubic" | "bilinear"

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def with_max_pixels(self, max_pixels: int | None) -> ImageProcessorConfig:
        """--image-max-pixels: a tighter budget than the release's (the hosted service's sizing)."""
        if max_pixels is None:
            return self
        from dataclasses import replace

        return replace(self, max_pixels=max_pixels, min_pixels=min(self.min_pixels, max_pixels))


_RESAMPLE = {2: "bilinear", 3: "bicubic"}  # PIL's codes, as the config stores them


def processor_section(model_dir: str | Path, key: str, alone: str) -> tuple[dict, str] | None:
    """A processor's settings in a release, (the section, where it was for errors): processor_config.json[key], else
    the file `alone` holding it by itself (older saves); None when neither has it."""
    model_dir = Path(model_dir)
    for name, field in (("processor_config.json", key), (alone, None)):
        path = model_dir / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ReleaseError(f"{path}: not readable JSON ({error})") from error
        section = data.get(field) if field else data
        if isinstance(section, dict):
            return section, f"{path}{'[' + repr(field) + ']' if field else ''}"
    return None


def load_processor_config(model_dir: str | Path) -> ImageProcessorConfig | None:
    """The release's image processor settings, or None when the release has no processor file."""
    found = processor_section(model_dir, "image_processor", "preprocessor_config.json")
    return processor_config(*found) if found is not None else None


def processor_config(d: dict, where: str) -> ImageProcessorConfig:
    def number(name: str, default=None, kind=(int, float)):
        value = d.get(name, default)
        if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
            raise ReleaseError(f"{where}: field '{name}' must be a positive number, got {value!r}")
        return value

    for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if d.get(flag, True) is not True:
            raise ReleaseError(f"{where}: field '{flag}' is {d.get(flag)!r}; clef-flash's processor sets it")
    size = d.get("size") or {}
    min_pixels = d.get("min_pixels", size.get("shortest_edge"))
    max_pixels = d.get("max_pixels", size.get("longest_edge"))
    resample = _RESAMPLE.get(d.get("resample", 3))
    if resample is None:
        raise ReleaseError(f"{where}: field 'resample' is {d.get('resample')!r}; supported: 2 (bilinear), 3 (bicubic)")
    mean, std = d.get("image_mean"), d.get("image_std")
    for name, value in (("image_mean", mean), ("image_std", std)):
        if not (isinstance(value, list) and len(value) == 3 and all(isinstance(v, int | float) for v in value)):
            raise ReleaseError(f"{where}: field '{name}' must be three numbers, got {value!r}")
    return ImageProcessorConfig(
        patch_size=number("patch_size", kind=int),
        merge_size=number("merge_size", kind=int),
        temporal_patch_size=number("temporal_patch_size", kind=int),
        min_pixels=int(number("min_pixels", min_pixels, kind=int)),
        max_pixels=int(number("max_pixels", max_pixels, kind=int)),
        mean=tuple(float(v) for v in mean),
        std=tuple(float(v) for v in std),
        rescale_factor=float(number("rescale_factor", 1 / 255)),
        resample=resample,
    )


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The processor's target size: both sides multiples of `factor`, the area within [min, max]."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"a {width}x{height} image is more than 200:1")
    h, w = round(height / factor) * factor, round(width / factor) * factor  # Python's round: half to even
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True)
class PreparedImage:
    """One image ready for the tower: its patches, grid and a content digest (decoded pixels + settings)."""

    pixel_values: Tensor  # [gh * gw, C * T * patch * patch] fp32, rows in merge-block order
    grid: tuple[int, int]  # (gh, gw) patches
    digest: bytes
    merge_size: int

    @property
    def num_patches(self) -> int:
        """Rows of pixel_values: what the tower's step is sized by."""
        return self.grid[0] * self.grid[1]

    @property
    def num_tokens(self) -> int:
        """<|image_pad|> tokens: one per merged 2x2 block of patches."""
        return self.num_patches // (self.merge_size * self.merge_size)

    @property
    def merged_grid(self) -> tuple[int, int]:
        return self.grid[0] // self.merge_size, self.grid[1] // self.merge_size


def prepare_image(pixels: Tensor, config: ImageProcessorConfig) -> PreparedImage:
    """uint8 [3, H, W] -> patches, bit-exact with transformers' Qwen2VLImageProcessor (torchvision)."""
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as tvF

    _, height, width = pixels.shape
    target = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
    mode = InterpolationMode.BICUBIC if config.resample == "bicubic" else InterpolationMode.BILINEAR
    resized = tvF.resize(pixels.unsqueeze(0), list(target), interpolation=mode, antialias=True)[0]  # always, as it does
    # Rescale and normalise fused, as the reference: (x - mean / r) / (std / r) with r the rescale factor.
    mean = torch.tensor(config.mean) * (1.0 / config.rescale_factor)
    std = torch.tensor(config.std) * (1.0 / config.rescale_factor)
    normalised = tvF.normalize(resized.to(torch.float32), mean.tolist(), std.tolist())
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    gh, gw = target[0] // p, target[1] // p
    patches = normalised.reshape(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    rows = patches.unsqueeze(5).expand(-1, -1, -1, -1, -1, t, -1, -1).reshape(gh * gw, 3 * t * p * p)
    settings = json.dumps([target, config.mean, config.std, config.rescale_factor, config.resample, p, m, t])
    digest = hashlib.blake2b(settings.encode(), digest_size=16)
    digest.update(resized.contiguous().numpy().tobytes())
    return PreparedImage(rows.contiguous(), (gh, gw), digest.digest(), m)


def load_images(blobs: list[bytes], config: ImageProcessorConfig, limits: ImageLimits) -> list[PreparedImage]:
    """A request's images, collected within the byte limits (request_images, clef_cuda.request.media), decoded and
    prepared: every image's header checked against the limits first (so a bad fourth image costs no decoding of
    the first three), then each decoded. ImageError names the image (1-based)."""
    headers = []
    for number, blob in enumerate(blobs, start=1):
        try:
            header = inspect_image(blob)
            check_header(header, limits)
        except ImageError as error:
            raise ImageError(f"image {number}: {error}", error.status, ("images", number - 1)) from error
        headers.append(header)
    prepared = []
    for number, (blob, header) in enumerate(zip(blobs, headers, strict=True), start=1):
        try:
            pixels = decode_image(blob, header)
            if (pixels.shape[1], pixels.shape[2]) not in ((header.height, header.width), (header.width, header.height)):
                raise ImageError(
                    f"the image decoded to {pixels.shape[2]}x{pixels.shape[1]}, its header says "
                    f"{header.width}x{header.height}"
                )
            prepared.append(prepare_image(pixels, config))
        except ImageError as error:
            raise ImageError(f"image {number}: {error}", error.status, ("images", number - 1)) from error
    return prepared
