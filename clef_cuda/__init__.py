"""clef-cuda: a self-hosted System One server for clef-flash.

Kernels: ``clef_cuda.kernels.ops`` (the fast ops, CPU and CUDA) beside ``clef_cuda.kernels.reference`` (pure torch, the
arbiter). The compiled extension is ``clef_cuda._C``; it is imported by ``clef_cuda.kernels.ops`` only, so the
references work without a build.
"""

__version__ = "0.1.0"


def build_info() -> dict:
    """What the compiled extension contains: {"variant": "cpu" | "cuda", "cuda_archs": ["7.5", ...] (machine
    code), "cuda_ptx": ["9.0"] (PTX the driver compiles for a card newer than every machine code)}."""
    from clef_cuda.kernels import extension

    _C = extension.load()  # torch first: it loads libc10/libtorch, which the extension links against

    def archs(token: str) -> list[str]:
        return [] if token == "none" else [f"{a[:-1]}.{a[-1]}" for a in token.split("_")]

    return {
        "variant": _C.VARIANT,
        "cuda_archs": archs(_C.CUDA_ARCHS),
        "cuda_ptx": archs(getattr(_C, "CUDA_PTX", "none")),
    }


def __getattr__(name: str):
    # Lazy: `import clef_cuda` stays cheap and works without the compiled extension.
    if name == "Decider":
        from clef_cuda.decider import Decider

        return Decider
    raise AttributeError(name)
