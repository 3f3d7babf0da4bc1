"""clef-cuda: a self-hosted System One server for clef-flash.

Kernels: ``clef_cuda.ops`` (the fast ops, CPU and CUDA) beside ``clef_cuda.reference`` (pure torch, the
arbiter). The compiled extension is ``clef_cuda._C``; it is imported by ``clef_cuda.ops`` only, so the
references work without a build.
"""

__version__ = "0.1.0"


def build_info() -> dict:
    """What the compiled extension contains: {"variant": "cpu" | "cuda", "cuda_archs": ["7.5", ...]}."""
    from clef_cuda import extension

    _C = extension.load()  # torch first: it loads libc10/libtorch, which the extension links against

    archs = [] if _C.CUDA_ARCHS == "none" else [f"{a[:-1]}.{a[-1]}" for a in _C.CUDA_ARCHS.split("_")]
    return {"variant": _C.VARIANT, "cuda_archs": archs}


def __getattr__(name: str):
    # Lazy: `import clef_cuda` stays cheap and works without the compiled extension.
    if name == "Decider":
        from clef_cuda.decider import Decider

        return Decider
    raise AttributeError(name)
