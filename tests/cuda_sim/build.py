"""Builds the test-only CUDA simulator module (torch.ops.clef_sim): the extension's own sources with
CLEF_CUDA_SIM defined, so every op runs the CUDA launcher and kernels, via tests/cuda_sim/cuda_sim.h
(and wmma_sim.h for tensor cores), on CPU tensors, plus the simulator's controls (sim_controls.cpp: the
simulated compute capability, test-only faults). Compiled once into .cache/cuda_sim and reused while the
sources are unchanged."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("conv1d", "gated_delta_rule", "paged_attention", "dequantize", "glue")
NAMESPACE = "clef_sim"


def sources() -> list[str]:
    csrc = ROOT / "csrc"
    files = [csrc / "bindings.cpp", csrc / "common" / "cpu_isa_ops.cpp"]
    for family in FAMILIES:
        files += [csrc / family / f"{family}_ops.cpp", csrc / family / f"{family}_cpu.cpp"]
        files.append(ROOT / "tests" / "cuda_sim" / f"{family}_launch_sim.cpp")
    files.append(ROOT / "tests" / "cuda_sim" / "sim_controls.cpp")
    return [str(f) for f in files]


def load_cuda_sim():
    """Compile (if needed) and import the simulator module; returns an OpLibrary bound to clef_sim."""
    import torch
    from torch.utils.cpp_extension import load

    build_dir = ROOT / ".cache" / "cuda_sim"
    build_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 2))
    load(
        name="clef_cuda_sim",
        sources=sources(),
        extra_include_paths=[str(ROOT / "csrc"), str(ROOT / "tests" / "cuda_sim")],
        # -fno-strict-aliasing: the kernels copy f16 tiles as 16-byte words, as GPUs do.
        extra_cflags=["-O2", "-DCLEF_CUDA_SIM", "-fopenmp", "-Wno-psabi", "-fno-strict-aliasing"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        with_cuda=False,
        verbose=False,
    )
    from clef_cuda.kernels.ops import OpLibrary, _register_fake_kernels

    if not getattr(torch.ops, NAMESPACE, None) or not hasattr(torch.ops.clef_sim, "causal_conv1d_fwd"):
        raise RuntimeError("the CUDA simulator module loaded but registered no clef_sim ops")
    _register_fake_kernels(NAMESPACE)
    return OpLibrary(NAMESPACE)


if __name__ == "__main__":
    load_cuda_sim()
    print("clef_cuda_sim built in", ROOT / ".cache" / "cuda_sim")
