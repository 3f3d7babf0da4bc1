"""Test images made at test time (seeded), in every form the processor must get right: sizes that upscale,
downscale and stretch, RGBA, EXIF rotation, grayscale, palette with transparency, WebP; and hostile
ones (16-bit, animated, a header that declares 20000 x 20000 pixels, truncated data)."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np


def _pil():
    from PIL import Image

    return Image


def _encode(image, fmt: str, **save) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **save)
    return out.getvalue()


def noise(width: int, height: int, seed: int = 0, channels: int = 3) -> np.ndarray:
    """Smooth-ish random pixels (a blurred noise field: resizing it is not trivially uniform)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(1, height // 4 + 1), max(1, width // 4 + 1), channels), dtype=np.uint8)
    big = np.repeat(np.repeat(small, 4, axis=0), 4, axis=1)[:height, :width]
    return (big.astype(np.int16) + rng.integers(-20, 21, big.shape)).clip(0, 255).astype(np.uint8)


def png(width: int, height: int, seed: int = 0) -> bytes:
    return _encode(_pil().fromarray(noise(width, height, seed)), "PNG")


def jpeg(width: int, height: int, seed: int = 0, orientation: int | None = None) -> bytes:
    image = _pil().fromarray(noise(width, height, seed))
    if orientation is None:
        return _encode(image, "JPEG", quality=92)
    exif = image.getexif()
    exif[0x0112] = orientation  # 6: rotate 90 degrees clockwise to display
    return _encode(image, "JPEG", quality=92, exif=exif.tobytes())


def rgba_png(width: int, height: int, seed: int = 0) -> bytes:
    return _encode(_pil().fromarray(noise(width, height, seed, channels=4), "RGBA"), "PNG")


def gray_png(width: int, height: int, seed: int = 0) -> bytes:
    return _encode(_pil().fromarray(noise(width, height, seed, channels=1)[..., 0], "L"), "PNG")


def palette_png(width: int, height: int, seed: int = 0) -> bytes:
    image = _pil().fromarray(noise(width, height, seed)).convert("P", palette=1, colors=16)  # 1: adaptive
    return _encode(image, "PNG", transparency=3)


def webp(width: int, height: int, seed: int = 0) -> bytes:
    return _encode(_pil().fromarray(noise(width, height, seed)), "WEBP", quality=90)


def png16(width: int, height: int) -> bytes:
    return _encode(_pil().fromarray(np.full((height, width), 40000, dtype=np.uint16)), "PNG")


def animated_png(width: int, height: int) -> bytes:
    frames = [_pil().fromarray(noise(width, height, seed)) for seed in range(2)]
    out = io.BytesIO()
    frames[0].save(out, "PNG", save_all=True, append_images=frames[1:])
    return out.getvalue()


def png_bomb(width: int = 20000, height: int = 20000) -> bytes:
    """A valid PNG header declaring width x height pixels, with a few bytes of (compressed) data: decoding
    it would take width * height * 3 bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0" * 1000))
        + chunk(b"IEND", b"")
    )


def data_url(blob: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(blob).decode()


def b64(blob: bytes) -> str:
    return base64.b64encode(blob).decode()


# The processor's awkward cases: name -> bytes.
def processor_cases() -> dict[str, bytes]:
    return {
        "one": png(300, 200, 1),
        "upscale 10x10": png(10, 10, 2),
        "downscale 2000x1500": jpeg(2000, 1500, 3),
        "strip 1x150": png(1, 150, 4),
        "rgba": rgba_png(64, 48, 5),
        "exif-rotated jpeg": jpeg(120, 60, 6, orientation=6),
        "grayscale": gray_png(70, 33, 7),
        "palette with transparency": palette_png(40, 40, 8),
        "webp": webp(90, 61, 9),
    }
