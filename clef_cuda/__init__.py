"""clef-cuda: a self-hosted System One server for Cloudflare's Clef decision models (clef-flash 9B, clef 27B).

The package in rooms, each importing only the ones listed before it (docs/development.md; tests/test_layout.py):
errors; kernels (the fast ops beside pure-torch references, the compiled extension clef_cuda._C loaded by
kernels.extension only, so the references work without a build); request (what a request becomes); runtime (CUDA
errors, child processes); model (what a release is: weights, trunk, head, vision); decider (one request in process);
compare (two serving configurations on your requests); verification (self-check, shadow, guarded ops); tuning
(autotune, kernel trials); parallel (tensor parallel); serving (the batching engine, its cache and memory plan);
lifecycle (whether the server may answer). The HTTP app (app/) stands on top.
"""

__version__ = "0.1.0"


def build_info() -> dict:
    """What the compiled extension contains (clef_cuda.kernels.extension.build_info)."""
    from clef_cuda.kernels.extension import build_info

    return build_info()


def __getattr__(name: str):
    # Lazy: `import clef_cuda` stays cheap and works without the compiled extension.
    if name == "Decider":
        from clef_cuda.decider import Decider

        return Decider
    raise AttributeError(name)
