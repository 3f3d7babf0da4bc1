#!/usr/bin/env python3
"""Compiles every CUDA kernel instantiation for sm_70 (V100) with CUDA 12.9's NVRTC; exits 1 on any error.

nvcc 13 cannot target sm_70, so this is how CI proves the kernels still build for V100. It compiles the
device-code headers (csrc/*/*_kernels.cuh) to a cubin (ptxas included, so register and shared-memory
limits are checked too) for the same instantiations the launchers dispatch, and prints ptxas' resource
usage per kernel.

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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("float", "__half", "__nv_bfloat16")

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
        ],
        [16, 32, 64, 128, 256],
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

    def compile(self, source: str, name: str, options: list[str]) -> tuple[bool, str, int]:
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None))
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        result = self.lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        self.lib.nvrtcGetProgramLog(prog, log)
        cubin_size = ctypes.c_size_t()
        if result == 0:
            self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(cubin_size))
        self.lib.nvrtcDestroyProgram(ctypes.byref(prog))
        return result == 0, log.value.decode(errors="replace"), cubin_size.value

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


def print_resource_usage(log_lines: list[str]) -> None:
    """One line per kernel: the instantiation and ptxas' registers / static shared memory."""
    kernel = None
    for line in log_lines:
        entry = re.search(r"Compiling entry function '([^']+)'", line)
        if entry:
            kernel = demangle(entry.group(1)).replace("clef::", "")
            continue
        registers = re.search(r"Used (\d+) registers", line)
        if registers and kernel:
            smem = re.search(r"(\d+) bytes smem", line)
            print(f"     {kernel[:78]:78s} {registers.group(1):>4s} regs {smem.group(1) if smem else '0':>6s} B smem")
            kernel = None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--packages", help="a `pip install --target` dir holding the nvidia-*-cu12 12.9 packages")
    parser.add_argument("--arch", default="sm_70", help="target (default sm_70)")
    parser.add_argument("--quiet", action="store_true", help="do not print ptxas resource usage")
    args = parser.parse_args()

    dirs = find_nvidia_dirs(args.packages)
    if not dirs:
        print(
            "check_sm70: libnvrtc.so.12 not found. Install the CUDA 12.9 NVRTC packages, e.g.\n"
            "  pip install --target .cache/nvrtc12 'nvidia-cuda-nvrtc-cu12==12.9.*' 'nvidia-cuda-nvcc-cu12==12.9.*' "
            "'nvidia-cuda-cccl-cu12==12.9.*' 'nvidia-cuda-runtime-cu12==12.9.*'\n"
            "and pass --packages .cache/nvrtc12",
            file=sys.stderr,
        )
        return 1
    nvidia = dirs[0]
    includes = [nvidia / "cuda_runtime" / "include", nvidia / "cuda_nvcc" / "include", nvidia / "cuda_cccl" / "include"]
    missing = [str(i) for i in includes if not i.exists()]
    if missing:
        print(
            f"check_sm70: missing header dirs {missing}: install nvidia-cuda-{{runtime,nvcc,cccl}}-cu12==12.9.*",
            file=sys.stderr,
        )
        return 1
    nvrtc = Nvrtc(nvidia / "cuda_nvrtc" / "lib" / "libnvrtc.so.12")
    options = [f"--gpu-architecture={args.arch}", "-std=c++17", "--ptxas-options=-v", f"-I{ROOT / 'csrc'}"]
    options += [f"-I{i}" for i in includes]
    print(f"check_sm70: NVRTC {nvrtc.version} from {nvidia}, target {args.arch}")

    failures = 0
    for family, (header, launcher, instantiations, sizes) in FAMILIES.items():
        dispatched = launcher_sizes(ROOT / "csrc" / launcher)
        if not dispatched <= set(sizes):
            print(
                f"FAIL {family}: {launcher} dispatches sizes {sorted(dispatched - set(sizes))} "
                "that this check does not compile"
            )
            failures += 1
        source = f'#include "{header}"\n' + "\n".join(instantiations) + "\n"
        ok, log, cubin = nvrtc.compile(source, f"{family}_{args.arch}.cu", options)
        log_lines = [line for line in log.splitlines() if "are deprecated" not in line and line.strip()]
        if ok:
            print(f"ok   {family}: {len(instantiations)} kernels, cubin {cubin} bytes")
            if not args.quiet:
                print_resource_usage(log_lines)
        else:
            failures += 1
            print(f"FAIL {family}:")
            print("\n".join("     " + line for line in log_lines))
    if failures:
        print(f"check_sm70: {failures} failure(s)")
        return 1
    print(f"check_sm70: every kernel compiles for {args.arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
