#!/usr/bin/env python3
"""Compiles every CUDA kernel instantiation for sm_70 (V100) with CUDA 12.9's NVRTC; exits 1 on any error.

nvcc 13 cannot target sm_70, so this is how CI proves the kernels still build for V100. It compiles the
device-code headers (csrc/*/*_kernels.cuh) to a cubin (ptxas included) for the same instantiations the
launchers dispatch, prints ptxas' resource usage per kernel (registers, static shared memory, spills, the
block size its __launch_bounds__ declares) and the dynamic shared memory of each paged-attention launch
config, and fails when a kernel exceeds sm_70's limits: 255 registers per thread, 64 K registers per
block (registers x threads), 48 KB of static shared memory, 96 KB of dynamic shared memory (above 48 KB
only with the launcher's cudaFuncSetAttribute opt-in, which the CUDA simulator's launches check).
tests/test_check_sm70.py runs it.

Needs the PyPI packages nvidia-cuda-nvrtc-cu12, nvidia-cuda-nvcc-cu12 (crt/ headers),
nvidia-cuda-cccl-cu12 (cuda/std) and nvidia-cuda-runtime-cu12 (cuda_fp16.h), all 12.9, either in this
environment or under --packages DIR (a `pip install --target DIR` tree, as .ci/run does).
"""

from __future__ import annotations

import argparse
import ctypes
import re
import site
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("float", "__half", "__nv_bfloat16")
INSTALL_HINT = (
    "pip install --target .cache/nvrtc12 'nvidia-cuda-nvrtc-cu12==12.9.*' 'nvidia-cuda-nvcc-cu12==12.9.*' "
    "'nvidia-cuda-cccl-cu12==12.9.*' 'nvidia-cuda-runtime-cu12==12.9.*'"
)

# Compute capability 7.0's limits per kernel (CUDA C++ Programming Guide, "Compute Capabilities").
MAX_REGISTERS_PER_THREAD = 255
MAX_REGISTERS_PER_BLOCK = 64 * 1024
MAX_STATIC_SMEM = 48 * 1024
DEFAULT_DYNAMIC_SMEM = 48 * 1024  # without cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize)
MAX_DYNAMIC_SMEM = 96 * 1024  # with it (static + dynamic)

# (kernels header, launcher, explicit instantiations). The launcher is read to make sure every size it
# dispatches is compiled here too.
FAMILIES = {
    "conv1d": (
        "conv1d/conv1d_kernels.cuh",
        "conv1d/conv1d_launch.cu",
        [f"template __global__ void clef::conv1d_fwd_kernel<{t}, 4>(clef::Conv1dParams);" for t in DTYPES]
        + [f"template __global__ void clef::conv1d_save_state_kernel<{t}, 4>(clef::Conv1dParams);" for t in DTYPES],
        [4],
    ),
    "gated_delta_rule": (
        "gated_delta_rule/gated_delta_rule_kernels.cuh",
        "gated_delta_rule/gated_delta_rule_launch.cu",
        [
            f"template __global__ void clef::gated_delta_rule_kernel<{t}, {d}, {d}>(clef::GatedDeltaRuleParams);"
            for t in DTYPES
            for d in (16, 32, 64, 128)
        ],
        [16, 32, 64, 128],
    ),
    "paged_attention": (
        "paged_attention/paged_attention_kernels.cuh",
        "paged_attention/paged_attention_launch.cu",
        [f"template __global__ void clef::reshape_and_cache_kernel<{t}>(clef::CacheWriteParams);" for t in DTYPES]
        + [
            f"template __global__ void clef::paged_attention_kernel<{t}, {d}>(clef::PagedAttentionParams);"
            for t in DTYPES
            for d in (16, 32, 64, 128, 256)
        ]
        + [
            f"template __global__ void clef::paged_attention_wmma_kernel<{t}, {d}>(clef::PagedAttentionParams);"
            for t in DTYPES[1:]
            for d in (64, 128, 256)
        ],
        [16, 32, 64, 128, 256],
    ),
    "dequantize": (
        "dequantize/dequantize_kernels.cuh",
        "dequantize/dequantize_launch.cu",
        [
            f"template __global__ void clef::dequantize_int8_kernel<{t}, {v}>(clef::DequantizeParams);"
            for t in DTYPES
            for v in ("true", "false")
        ],
        [],
    ),
}


def find_nvidia_dirs(packages: str | None) -> list[Path]:
    roots = [Path(packages)] if packages else []
    roots += [Path(p) for p in site.getsitepackages() + [site.getusersitepackages()]]
    return [r / "nvidia" for r in roots if (r / "nvidia" / "cuda_nvrtc" / "lib" / "libnvrtc.so.12").exists()]


class Nvrtc:
    def __init__(self, lib_path: Path) -> None:
        self.lib = ctypes.CDLL(str(lib_path))
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        self.version = f"{major.value}.{minor.value}"
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def compile(self, source: str, name: str, options: list[str]) -> tuple[bool, str, int, str]:
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None))
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        result = self.lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        self.lib.nvrtcGetProgramLog(prog, log)
        cubin_size, ptx = ctypes.c_size_t(), ""
        if result == 0:
            self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(cubin_size))
            ptx_size = ctypes.c_size_t()
            self._check(self.lib.nvrtcGetPTXSize(prog, ctypes.byref(ptx_size)))
            ptx_buffer = ctypes.create_string_buffer(ptx_size.value)
            self._check(self.lib.nvrtcGetPTX(prog, ptx_buffer))
            ptx = ptx_buffer.value.decode(errors="replace")
        self.lib.nvrtcDestroyProgram(ctypes.byref(prog))
        return result == 0, log.value.decode(errors="replace"), cubin_size.value, ptx

    def _check(self, code: int) -> None:
        if code != 0:
            raise RuntimeError(f"NVRTC call failed: {self.lib.nvrtcGetErrorString(code).decode()}")


def launcher_sizes(launcher: Path) -> set[int]:
    return {int(n) for n in re.findall(r"case (\d+):", launcher.read_text())} | {
        int(n) for n in re.findall(r"p\.width != (\d+)", launcher.read_text())
    }


def demangle(name: str) -> str:
    try:
        return subprocess.run(["c++filt", name], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return name


@dataclass
class KernelUsage:
    """ptxas' resource usage of one kernel, with the block size its __launch_bounds__ declares."""

    name: str  # demangled, without the clef:: prefix
    registers: int
    static_smem: int  # bytes
    spill_bytes: int  # stores + loads
    threads: int | None  # None: no __launch_bounds__ (then the launch could use up to 1024 threads)

    def violations(self) -> list[str]:
        """What exceeds sm_70's limits (empty: it fits)."""
        problems = []
        if self.registers > MAX_REGISTERS_PER_THREAD:
            problems.append(f"{self.registers} registers per thread > {MAX_REGISTERS_PER_THREAD}")
        if self.threads is None:
            problems.append("no __launch_bounds__: its registers x threads cannot be checked")
        elif self.registers * self.threads > MAX_REGISTERS_PER_BLOCK:
            problems.append(
                f"{self.registers} registers x {self.threads} threads = {self.registers * self.threads} "
                f"> {MAX_REGISTERS_PER_BLOCK} per block"
            )
        if self.static_smem > MAX_STATIC_SMEM:
            problems.append(f"{self.static_smem} B of static shared memory > {MAX_STATIC_SMEM}")
        return problems


@dataclass
class DynamicSmem:
    """A launch config's dynamic shared memory, as the launcher computes it."""

    config: str
    bytes: int

    @property
    def limit(self) -> str:
        if self.bytes > MAX_DYNAMIC_SMEM:
            return f"over sm_70's {MAX_DYNAMIC_SMEM // 1024} KB"
        return "48 KB default" if self.bytes <= DEFAULT_DYNAMIC_SMEM else "96 KB opt-in (cudaFuncSetAttribute)"


@dataclass
class Report:
    arch: str
    nvrtc_version: str
    kernels: list[KernelUsage] = field(default_factory=list)
    dynamic_smem: list[DynamicSmem] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def block_sizes(ptx: str) -> dict[str, int]:
    """Mangled kernel name -> threads per block its __launch_bounds__ declares (PTX .maxntid)."""
    sizes = {}
    for chunk in ptx.split(".entry ")[1:]:
        name = chunk.split("(", 1)[0].strip()
        directives = chunk.split("{", 1)[0]
        maxntid = re.search(r"\.maxntid\s+(\d+),\s*(\d+),\s*(\d+)", directives)
        if maxntid:
            x, y, z = (int(v) for v in maxntid.groups())
            sizes[name] = x * y * z
    return sizes


def kernel_usage(log_lines: list[str], ptx: str) -> list[KernelUsage]:
    """One entry per kernel from ptxas' -v log (registers, static shared memory, spills)."""
    threads = block_sizes(ptx)
    usage, mangled, spills = [], None, 0
    for line in log_lines:
        entry = re.search(r"Compiling entry function '([^']+)'", line)
        if entry:
            mangled, spills = entry.group(1), 0
            continue
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if spill:
            spills = int(spill.group(1)) + int(spill.group(2))
        registers = re.search(r"Used (\d+) registers", line)
        if registers and mangled:
            smem = re.search(r"(\d+) bytes smem", line)
            name = demangle(mangled).replace("clef::", "")
            usage.append(
                KernelUsage(
                    name, int(registers.group(1)), int(smem.group(1)) if smem else 0, spills, threads.get(mangled)
                )
            )
            mangled = None
    return usage


def dynamic_smem_configs() -> list[DynamicSmem]:
    """The dynamic shared memory of every paged-attention launch config, computed by the launchers' own
    functions (csrc/paged_attention/paged_attention.h is torch- and CUDA-free) in a host-compiled probe."""
    probe = r"""
#include <cstdio>
#include <initializer_list>
#include "paged_attention/paged_attention.h"
int main() {
  for (int d : {64, 128, 256})
    std::printf("paged_attention_wmma_kernel<f16|bf16, %d> %d\n", d, clef::paged_attention_wmma_smem_bytes(d));
  std::printf("paged_attention_kernel<*, 16> %d\n", 4 * clef::paged_attention_smem_floats<16>());
  std::printf("paged_attention_kernel<*, 32> %d\n", 4 * clef::paged_attention_smem_floats<32>());
  std::printf("paged_attention_kernel<*, 64> %d\n", 4 * clef::paged_attention_smem_floats<64>());
  std::printf("paged_attention_kernel<*, 128> %d\n", 4 * clef::paged_attention_smem_floats<128>());
  std::printf("paged_attention_kernel<*, 256> %d\n", 4 * clef::paged_attention_smem_floats<256>());
}
"""
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "probe"
        subprocess.run(
            ["c++", "-std=c++17", f"-I{ROOT / 'csrc'}", "-x", "c++", "-", "-o", str(exe)],
            input=probe,
            text=True,
            check=True,
            capture_output=True,
        )
        lines = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines()
    return [DynamicSmem(config, int(size)) for config, size in (line.rsplit(" ", 1) for line in lines)]


def check(packages: str | None = None, arch: str = "sm_70") -> Report:
    """Compile every family for `arch`; FileNotFoundError (saying what to install) without NVRTC 12."""
    dirs = find_nvidia_dirs(packages)
    if not dirs:
        raise FileNotFoundError(
            f"libnvrtc.so.12 not found. Install the CUDA 12.9 NVRTC packages, e.g.\n  {INSTALL_HINT}"
        )
    nvidia = dirs[0]
    includes = [nvidia / "cuda_runtime" / "include", nvidia / "cuda_nvcc" / "include", nvidia / "cuda_cccl" / "include"]
    missing = [str(i) for i in includes if not i.exists()]
    if missing:
        raise FileNotFoundError(
            f"missing header dirs {missing}: install nvidia-cuda-{{runtime,nvcc,cccl}}-cu12==12.9.*"
        )
    nvrtc = Nvrtc(nvidia / "cuda_nvrtc" / "lib" / "libnvrtc.so.12")
    options = [f"--gpu-architecture={arch}", "-std=c++17", "--ptxas-options=-v", f"-I{ROOT / 'csrc'}"]
    options += [f"-I{i}" for i in includes]
    report = Report(arch, nvrtc.version)
    for family, (header, launcher, instantiations, sizes) in FAMILIES.items():
        dispatched = launcher_sizes(ROOT / "csrc" / launcher)
        if not dispatched <= set(sizes):
            extra = sorted(dispatched - set(sizes))
            report.failures.append(f"{family}: {launcher} dispatches sizes {extra} that this check does not compile")
        source = f'#include "{header}"\n' + "\n".join(instantiations) + "\n"
        ok, log, cubin, ptx = nvrtc.compile(source, f"{family}_{arch}.cu", options)
        log_lines = [line for line in log.splitlines() if "are deprecated" not in line and line.strip()]
        if not ok:
            report.failures.append(f"{family} does not compile:\n" + "\n".join("     " + line for line in log_lines))
            continue
        kernels = kernel_usage(log_lines, ptx)
        if len(kernels) != len(instantiations):
            report.failures.append(f"{family}: ptxas reported {len(kernels)} kernels for {len(instantiations)}")
        report.kernels += kernels
        report.failures += [f"{k.name}: {problem}" for k in kernels for problem in k.violations()]
    report.dynamic_smem = dynamic_smem_configs()
    report.failures += [
        f"{c.config}: {c.bytes} B of dynamic shared memory, {c.limit}"
        for c in report.dynamic_smem
        if c.bytes > MAX_DYNAMIC_SMEM
    ]
    return report


def print_report(report: Report, quiet: bool) -> None:
    print(f"check_sm70: NVRTC {report.nvrtc_version}, target {report.arch}")
    if not quiet:
        print(f"     {'kernel':78s} {'regs':>4s} {'x threads':>9s} {'static smem':>11s} {'spills':>6s}")
        for k in report.kernels:
            per_block = f"{k.registers * k.threads}" if k.threads else "?"
            print(
                f"     {k.name[:78]:78s} {k.registers:>4d} {per_block:>9s} {k.static_smem:>9d} B {k.spill_bytes:>4d} B"
            )
        print("     dynamic shared memory per paged-attention launch config (sm_70: 48 KB default, 96 KB opt-in):")
        for c in report.dynamic_smem:
            print(f"     {c.config:44s} {c.bytes:>6d} B ({c.bytes / 1024:.2f} KB)  {c.limit}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--packages", help="a `pip install --target` dir holding the nvidia-*-cu12 12.9 packages")
    parser.add_argument("--arch", default="sm_70", help="target (default sm_70)")
    parser.add_argument("--quiet", action="store_true", help="do not print the resource usage")
    args = parser.parse_args()
    try:
        report = check(args.packages, args.arch)
    except FileNotFoundError as missing:
        print(f"check_sm70: {missing}\nand pass --packages .cache/nvrtc12", file=sys.stderr)
        return 1
    print_report(report, args.quiet)
    for failure in report.failures:
        print(f"FAIL {failure}")
    if report.failures:
        print(f"check_sm70: {len(report.failures)} failure(s)")
        return 1
    print(f"check_sm70: every kernel compiles for {args.arch} within its limits ({len(report.kernels)} kernels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
