"""Loads the compiled extension clef_cuda._C, refusing one built against another torch.

The extension links against libtorch's C++ symbols, which change between torch versions: a `pip install`
that let the resolver move torch after the build (torchvision pulls its own torch) used to end in an
undefined-symbol ImportError naming a mangled C++ function. The build records the torch it compiled
against (clef_cuda/BUILT_WITH_TORCH, written by setup.py; the package metadata pins it too), and a
mismatch is a one-line ImportError saying what to do.
"""

from __future__ import annotations

from pathlib import Path

BUILT_WITH = Path(__file__).resolve().parents[1] / "BUILT_WITH_TORCH"  # beside _C, in the package's root


class ExtensionMismatchError(ImportError):
    """clef_cuda._C was built against another torch than the one running."""


def built_with_torch() -> str | None:
    """The torch version the extension was built against (None: no build record, e.g. a bare checkout)."""
    try:
        return BUILT_WITH.read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def load():
    """clef_cuda._C, after checking it was built against the running torch."""
    import torch

    built, running = built_with_torch(), torch.__version__
    if built is not None and built != running:
        raise ExtensionMismatchError(
            f"clef_cuda._C was built against torch {built}, running {running}: reinstall clef-cuda against this "
            "torch (pip install --no-build-isolation --force-reinstall --no-deps .)"
        )
    from clef_cuda import _C

    return _C


def build_info() -> dict:
    """What the compiled extension contains: {"variant": "cpu" | "cuda", "cuda_archs": ["7.5", ...] (machine
    code), "cuda_ptx": ["9.0"] (PTX the driver compiles for a card newer than every machine code)}."""
    _C = load()  # torch first: it loads libc10/libtorch, which the extension links against

    def archs(token: str) -> list[str]:
        return [] if token == "none" else [f"{a[:-1]}.{a[-1]}" for a in token.split("_")]

    return {
        "variant": _C.VARIANT,
        "cuda_archs": archs(_C.CUDA_ARCHS),
        "cuda_ptx": archs(getattr(_C, "CUDA_PTX", "none")),
    }
