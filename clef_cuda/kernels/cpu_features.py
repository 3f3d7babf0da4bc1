"""What this CPU's GEMMs can use beyond fp32 FMAs, as torch's oneDNN runs them: bf16 dot products (AVX512-BF16,
AMX-BF16) and int8 dot products (AVX512-VNNI, AVX-VNNI, AMX-INT8), read from the kernel's CPU flags (Linux).

Our own CPU kernels pick their variant by clef_cuda.kernels.ops' CPU ISA (CLEF_CPU_ISA pins it); the GEMMs are torch's.
So that a pin means the same for both, CLEF_CPU_ISA=avx2 or baseline also caps oneDNN and MKL (their
ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS, unless set: clef_cuda.kernels.ops.apply_cpu_isa_env, before the first
GEMM), and cpu_gemm_features() reports what is left: an AVX-512 machine pinned to AVX2 reports, and runs, what an
AVX2-only CPU would."""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# The flags each capability needs (any one of them), and the instruction-set level each belongs to.
BF16_FLAGS = {"avx512_bf16": "avx512", "amx_bf16": "avx512"}
INT8_FLAGS = {"avx512_vnni": "avx512", "amx_int8": "avx512", "avx_vnni": "avx2"}
# The caps CLEF_CPU_ISA sets for the libraries' GEMMs (oneDNN's and MKL's names for the same levels).
LIBRARY_CAPS = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "baseline": {"ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}
LEVELS = ("baseline", "avx2", "avx512")
# ONEDNN_MAX_CPU_ISA values that leave out some of the flags above: the ones oneDNN may still use under each.
ONEDNN_ALLOWS = {
    "SSE41": frozenset(),
    "AVX": frozenset(),
    "AVX2": frozenset(),
    "AVX2_VNNI": frozenset({"avx_vnni"}),
    "AVX2_VNNI_2": frozenset({"avx_vnni"}),
    "AVX512_CORE": frozenset(),
    "AVX512_CORE_VNNI": frozenset({"avx512_vnni", "avx_vnni"}),
    "AVX512_CORE_BF16": frozenset({"avx512_bf16", "avx512_vnni", "avx_vnni"}),
}


@dataclass(frozen=True)
class CpuGemmFeatures:
    bf16: str | None  # the flag that gives native bf16 dot products, or None (bf16 GEMMs convert in software)
    int8: str | None  # the flag that gives int8 dot products (u8 x s8 -> s32), or None

    def describe(self) -> str:
        bf16 = f"bf16 dot products ({self.bf16})" if self.bf16 else "no bf16 dot products"
        int8 = f"int8 dot products ({self.int8})" if self.int8 else "no int8 dot products"
        return f"{bf16}, {int8}"


@functools.cache
def first_processor() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ("flags", "model name", ...); empty where there is none."""
    fields: dict[str, str] = {}
    try:
        for line in CPUINFO.read_text().splitlines():
            if not line.strip() and fields:
                break
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_flags() -> frozenset[str]:
    """The first processor's flags; empty where there is no /proc/cpuinfo (not Linux)."""
    return frozenset(first_processor().get("flags", "").split())


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC ..."), else what platform says."""
    return first_processor().get("model name") or platform.processor()


def cpu_gemm_features(kernel_isa: str, flags: frozenset[str] | None = None) -> CpuGemmFeatures:
    """What the GEMMs can use on this CPU at our kernels' instruction set `kernel_isa`
    (clef_cuda.kernels.ops.cpu_isa()), within ONEDNN_MAX_CPU_ISA when that is set."""
    flags = cpu_flags() if flags is None else flags
    level = LEVELS.index(kernel_isa if kernel_isa in LEVELS else "avx512")
    onednn = ONEDNN_ALLOWS.get(os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper())

    def usable(flag: str, needs: str) -> bool:
        return flag in flags and LEVELS.index(needs) <= level and (onednn is None or flag in onednn)

    def first(wanted: dict[str, str]) -> str | None:
        return next((flag for flag, needs in wanted.items() if usable(flag, needs)), None)

    return CpuGemmFeatures(bf16=first(BF16_FLAGS), int8=first(INT8_FLAGS))


def cap_library_gemms(kernel_isa: str, environ: dict = os.environ) -> dict[str, str]:
    """Set oneDNN's and MKL's caps for a pinned `kernel_isa` where they are not set already; returns what was set.
    They take effect if no GEMM has run yet in the process."""
    applied = {}
    for name, value in LIBRARY_CAPS.get(kernel_isa, {}).items():
        if name not in environ:
            environ[name] = applied[name] = value
    return applied
