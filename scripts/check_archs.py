#!/usr/bin/env python3
"""Compiles every CUDA kernel instantiation for every GPU generation we serve, sm_60 (P100) to sm_100 (B200)
and sm_120 (RTX 50x0), with CUDA 12.9's NVRTC; exits 1 on any error, spill or limit exceeded.

nvcc 13 cannot target sm_60..sm_70, so this is how CI proves the kernels still build for Pascal and V100
(and checks the others' resources). It compiles the device-code headers (csrc/*/*_kernels.cuh) to a cubin
(ptxas included) for the same instantiations the launchers dispatch, prints ptxas' resource usage per
kernel and arch (registers, registers x the block size its __launch_bounds__ declares, static shared
memory, spills, the named barriers it reserves) and, per arch, which paged-attention tile each head dim
gets and its dynamic shared memory (v1's and v2's tensor-core tiles, the SIMT one), computed by the
launchers' own functions (csrc/paged_attention/paged_attention.h) against the arch's per-block limit
(csrc/common/arch_limits.h: the table the simulator reads too). It fails when a kernel spills, exceeds 255
registers a thread, 64 K registers a block or 48 KB of static shared memory, reserves all 16 named
barriers (an id that is not an immediate), or when a head dim has no tile that fits an arch (tensor-core
tiles from sm_70 on; the SIMT one everywhere), or when the chunked delta rule's three passes do not fit a
tensor-core arch's shared memory for some head dim (csrc/gated_delta_rule/gated_delta_rule.h's layouts).
`--arch sm_70` checks one (make check-sm70). tests/test_check_archs.py runs it.

Needs the PyPI packages nvidia-cuda-nvrtc-cu12, nvidia-cuda-nvcc-cu12 (crt/ headers),
nvidia-cuda-cccl-cu12 (cuda/std) and nvidia-cuda-runtime-cu12 (cuda_fp16.h), all 12.9, either in this
environment or under --packages DIR (a `pip install --target DIR` tree, as .ci/run does).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import functools
import hashlib
import json
import os
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

# Limits per kernel on every arch below (CUDA C++ Programming Guide, "Compute Capabilities").
MAX_REGISTERS_PER_THREAD = 255
MAX_REGISTERS_PER_BLOCK = 64 * 1024
MAX_STATIC_SMEM = 48 * 1024
DEFAULT_DYNAMIC_SMEM = 48 * 1024  # without cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize)
MAX_NAMED_BARRIERS = 16  # per CTA, __syncthreads' barrier 0 included


def compile_probe(source: str, directory: Path) -> Path:
    """`source` (C++20, csrc/ on the include path) compiled for this machine into `directory`: the executable."""
    exe = Path(directory) / "probe"
    subprocess.run(
        ["c++", "-std=c++20", f"-I{ROOT / 'csrc'}", "-x", "c++", "-", "-o", str(exe)],
        input=source,
        text=True,
        check=True,
        capture_output=True,
    )
    return exe


def host_probe(source: str, *args: str) -> str:
    """Compile `source` (C++20, csrc/ on the include path) for this machine, run it with `args`, return what it
    printed: how the launchers' own torch- and CUDA-free headers are read from Python."""
    with tempfile.TemporaryDirectory() as tmp:
        exe = compile_probe(source, Path(tmp))
        return subprocess.run([str(exe), *args], capture_output=True, text=True, check=True).stdout


def arch_table() -> dict[str, tuple[int, str]]:
    """sm_XY -> (the most shared memory a block may have with the opt-in, the cards): the table the simulator
    reads too (csrc/common/arch_limits.h), so a new card is added in one place."""
    probe = r"""
#include <cstdio>
#include "common/arch_limits.h"
int main() {
  for (const auto& a : clef::kCheckedArchs)
    std::printf("%d %d %s\n", a.compute_capability, clef::arch_max_smem_per_block(a.compute_capability), a.cards);
}
"""
    table = {}
    for line in host_probe(probe).splitlines():
        cc, smem, cards = line.split(" ", 2)
        table[f"sm_{cc}"] = (int(smem), cards)
    return table


ARCHS = arch_table()
HEAD_DIMS = (16, 32, 64, 128, 256)
WMMA_HEAD_DIMS = (64, 128, 256)


def delta_rule_state_variants() -> list[tuple[int, int, bool]]:
    """(head dim, state columns a CTA, staged) of every state-pass variant the chunked delta rule compiles
    (gated_delta_rule.h gdr_state_variants, read through a host probe: the launcher dispatches exactly these)."""
    probe = r"""
#include <cstdio>
#include <initializer_list>
#include "gated_delta_rule/gated_delta_rule.h"
int main() {
  for (int d : {16, 32, 64, 128}) {
    const clef::GdrStateVariants v = clef::gdr_state_variants(d);
    for (int i = 0; i < v.count; ++i) std::printf("%d %d %d\n", d, v.list[i].columns, v.list[i].staged ? 1 : 0);
  }
}
"""
    return [
        (int(d), int(bv), staged == "1") for d, bv, staged in (line.split() for line in host_probe(probe).splitlines())
    ]


# The chunked delta rule's state-pass variants, each staged one with its cp.async (sm_80 on) and register
# fetches, and its (head dim, output columns a pass).
GDR_STATE_VARIANTS = delta_rule_state_variants()
GDR_STATE_INSTANCES = [
    (d, bv, staged, fetch) for d, bv, staged in GDR_STATE_VARIANTS for fetch in ((False, True) if staged else (False,))
]
GDR_OUTPUT_COLUMNS = ((16, 16), (32, 32), (64, 64), (128, 128), (128, 64))

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
        ]
        + [
            f"template __global__ void clef::gdr_chunk_prepare_kernel<{t}, {d}>(clef::GatedDeltaRuleParams);"
            for t in DTYPES[1:]
            for d in (16, 32, 64, 128)
        ]
        + [
            f"template __global__ void clef::gdr_chunk_state_kernel<{t}, {d}, {bv}, {str(staged).lower()}, "
            f"{str(fetch).lower()}>(clef::GatedDeltaRuleParams);"
            for t in DTYPES[1:]
            for d, bv, staged, fetch in GDR_STATE_INSTANCES
        ]
        + [
            f"template __global__ void clef::gdr_chunk_output_kernel<{t}, {d}, {oc}>(clef::GatedDeltaRuleParams);"
            for t in DTYPES[1:]
            for d, oc in GDR_OUTPUT_COLUMNS
        ],
        # the serial kernel's head dims (and the chunked one's); the state pass's columns a CTA
        [16, 32, 64, 128],
    ),
    "paged_attention": (
        "paged_attention/paged_attention_kernels.cuh",
        "paged_attention/paged_attention_launch.cu",
        [f"template __global__ void clef::reshape_and_cache_kernel<{t}>(clef::CacheWriteParams);" for t in DTYPES]
        + [
            f"template __global__ void clef::paged_attention_kernel<{t}, {d}, {k}>(clef::PagedAttentionParams);"
            for t in DTYPES
            for d, k in ((16, 32), (32, 32), (64, 32), (128, 32), (256, 16), (256, 8))
        ]
        + [
            f"template __global__ void clef::paged_attention_wmma_kernel<{t}, {d}, {k}>(clef::PagedAttentionParams);"
            for t in DTYPES[1:]
            for d, k in ((64, 64), (128, 32), (256, 32), (256, 16))
        ]
        + [
            f"template __global__ void clef::paged_attention_wmma2_kernel<{t}, {d}, {k}>(clef::PagedAttentionParams);"
            for t in DTYPES[1:]
            for d, k in ((64, 32), (128, 32), (256, 32), (256, 16))
        ]
        + [
            f"template __global__ void clef::paged_attention_split_combine_kernel<{t}>"
            "(clef::PagedAttentionParams, int);"
            for t in DTYPES[1:]
        ],
        # the launchers' switch cases: head_dim * 1000 + keys per tile
        [16032, 32032, 64032, 128032, 256016, 256008, 64064, 256032],
    ),
    "glue": (
        "glue/glue_kernels.cuh",
        "glue/glue_launch.cu",
        [
            f"template __global__ void clef::{k}_kernel<{t}>(clef::{P}Params);"
            for t in DTYPES
            for k, P in (
                ("add_rms_norm", "AddRmsNorm"),
                ("silu_mul", "SiluMul"),
                ("gated_rms_norm", "GatedRmsNorm"),
                ("sigmoid_gate", "SigmoidGate"),
            )
        ]
        + [
            f"template __global__ void clef::rms_norm_rope_kernel<{t}, {n}>(clef::RmsNormRopeParams);"
            for t in DTYPES
            for n in (8, 32)
        ],
        [],
    ),
    "dequantize": (
        "dequantize/dequantize_kernels.cuh",
        "dequantize/dequantize_launch.cu",
        [
            f"template __global__ void clef::dequantize_int8_kernel<{t}, {v}>(clef::DequantizeParams);"
            for t in DTYPES
            for v in ("true", "false")
        ]
        + [f"template __global__ void clef::int8_linear_kernel<{t}>(clef::Int8LinearParams);" for t in DTYPES],
        [],
    ),
}


def find_nvidia_dirs(packages: str | None) -> list[Path]:
    roots = [Path(packages)] if packages else []
    roots += [Path(p) for p in site.getsitepackages() + [site.getusersitepackages()]]
    # Absolute: the include options are part of the compile cache's key, and CI passes a relative --packages
    # where tests/test_check_archs.py passes an absolute one.
    return [r.resolve() / "nvidia" for r in roots if (r / "nvidia" / "cuda_nvrtc" / "lib" / "libnvrtc.so.12").exists()]


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


# NVRTC's output for inputs it has compiled before: CI runs this script, then the suite's test_check_archs.py
# asks for the same ten archs again (about five minutes of compiling on 2 cores). The key is every input of a
# compile: the source, the options, NVRTC's library file and version, and every file under csrc/ (the kernels'
# headers); a change to any one of them compiles again. What is done with the output (the limits, the tiles) is
# not cached. CLEF_CHECK_ARCHS_CACHE=off turns it off.
COMPILE_CACHE = ROOT / ".cache" / "check_archs"


@functools.cache  # one read of csrc/ a run, not one a compile
def _sources_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted((ROOT / "csrc").rglob("*")):
        if path.is_file():
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def compile_cached(nvrtc: Nvrtc, source: str, name: str, options: list[str]) -> tuple[bool, str, int, str]:
    if os.environ.get("CLEF_CHECK_ARCHS_CACHE", "on") == "off":
        return nvrtc.compile(source, name, options)
    lib = Path(nvrtc.lib._name).resolve()
    key = hashlib.sha256(
        json.dumps([source, name, options, nvrtc.version, str(lib), lib.stat().st_size, _sources_digest()]).encode()
    ).hexdigest()
    entry = COMPILE_CACHE / f"{key}.json"
    try:
        ok, log, cubin, ptx = json.loads(entry.read_text())
        return ok, log, cubin, ptx
    except (OSError, ValueError):
        pass
    result = nvrtc.compile(source, name, options)
    COMPILE_CACHE.mkdir(parents=True, exist_ok=True)
    partial = entry.with_suffix(f".{os.getpid()}.tmp")  # written whole, then renamed: two runs may race here
    partial.write_text(json.dumps(result))
    os.replace(partial, entry)
    return result


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
    barriers: int = 0  # named barriers ptxas reserves (__syncthreads' included); 16 when an id is not an immediate

    def violations(self) -> list[str]:
        """What exceeds the per-kernel limits, or spills (empty: it fits)."""
        problems = []
        if self.spill_bytes:
            problems.append(f"{self.spill_bytes} B of register spills")
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
        if self.barriers >= MAX_NAMED_BARRIERS:
            problems.append(
                f"{self.barriers} barriers reserved: a named barrier's id is not an immediate (cuda_utils.cuh "
                "bar_sync<ID>), so ptxas keeps all 16 and fewer CTAs fit an SM"
            )
        return problems


@dataclass
class Tile:
    """The paged-attention tile an arch gets for a head dim: keys per tile and its dynamic shared memory
    (0 keys: no tile fits)."""

    kernel: str  # "wmma" | "wmma2" | "simt"
    head_dim: int
    keys: int
    bytes: int

    @property
    def opt_in(self) -> bool:
        return self.bytes > DEFAULT_DYNAMIC_SMEM


@dataclass
class Report:
    arch: str
    nvrtc_version: str
    kernels: list[KernelUsage] = field(default_factory=list)
    tiles: list[Tile] = field(default_factory=list)
    delta_rule: list[DeltaRuleTiles] = field(default_factory=list)
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
            barriers = re.search(r"(\d+) barriers?\b", line)
            name = demangle(mangled).replace("clef::", "")
            usage.append(
                KernelUsage(
                    name,
                    int(registers.group(1)),
                    int(smem.group(1)) if smem else 0,
                    spills,
                    threads.get(mangled),
                    int(barriers.group(1)) if barriers else 0,
                )
            )
            mangled = None
    return usage


def attention_tiles(smem_limit: int) -> list[Tile]:
    """The tile each head dim gets on a device with `smem_limit` bytes of shared memory a block, from the
    launchers' own functions (csrc/paged_attention/paged_attention.h is torch- and CUDA-free), compiled
    into a host probe."""
    probe = r"""
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include "paged_attention/paged_attention.h"
int main(int, char** argv) {
  const int limit = std::atoi(argv[1]);
  for (int d : {16, 32, 64, 128, 256}) {
    const int keys = clef::paged_attention_simt_keys(d, limit);
    std::printf("simt %d %d %d\n", d, keys, keys ? 4 * clef::paged_attention_smem_floats(d, keys) : 0);
  }
  for (int d : {64, 128, 256}) {
    const int keys = clef::paged_attention_wmma_keys(d, limit);
    std::printf("wmma %d %d %d\n", d, keys, keys ? clef::paged_attention_wmma_smem_bytes(d, keys) : 0);
  }
  for (int d : {64, 128, 256}) {
    const int keys = clef::paged_attention_wmma2_keys(d, limit);
    std::printf("wmma2 %d %d %d\n", d, keys, keys ? clef::paged_attention_wmma2_smem_bytes(d, keys) : 0);
  }
}
"""
    out = host_probe(probe, str(smem_limit))
    return [
        Tile(kind, int(d), int(keys), int(size)) for kind, d, keys, size in (line.split() for line in out.splitlines())
    ]


@dataclass
class DeltaRuleTiles:
    """The chunked delta rule's passes on an arch for a head dim: the dynamic shared memory of each (the prepare
    pass; each state-pass variant, "s32" or "d128", 0 where it does not fit; the output pass at its columns a
    pass, 0 columns: none fits)."""

    head_dim: int
    prepare_bytes: int
    output_columns: int
    output_bytes: int
    state_bytes: dict[str, int] = field(default_factory=dict)

    def fits(self, limit: int) -> bool:
        return (
            self.output_columns > 0
            and any(0 < b <= limit for b in self.state_bytes.values())
            and max(self.prepare_bytes, self.output_bytes) <= limit
        )


def delta_rule_tiles(smem_limit: int) -> list[DeltaRuleTiles]:
    """What each head dim's chunked delta rule gets with `smem_limit` bytes a block, from the dispatch rule's own
    functions (csrc/gated_delta_rule/gated_delta_rule.h), compiled into a host probe."""
    probe = r"""
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include "gated_delta_rule/gated_delta_rule.h"
int main(int, char** argv) {
  const int limit = std::atoi(argv[1]);
  for (int d : {16, 32, 64, 128}) {
    const int oc = clef::gdr_output_columns(d, limit);
    std::printf("%d %d %d %d", d, clef::gdr_prepare_layout(d).bytes, oc, oc ? clef::gdr_output_layout(d, oc).bytes : 0);
    const clef::GdrStateVariants v = clef::gdr_state_variants(d);
    for (int i = 0; i < v.count; ++i) {
      const int bytes = clef::gdr_state_layout(d, v.list[i].columns, v.list[i].staged).bytes;
      std::printf(" %c%d=%d", v.list[i].staged ? 's' : 'd', v.list[i].columns, bytes <= limit ? bytes : 0);
    }
    std::printf("\n");
  }
}
"""
    tiles = []
    for line in host_probe(probe, str(smem_limit)).splitlines():
        d, prepare, oc, output, *variants = line.split()
        state = {name: int(size) for name, size in (v.split("=") for v in variants)}
        tiles.append(DeltaRuleTiles(int(d), int(prepare), int(oc), int(output), state))
    return tiles


def nvrtc_for(packages: str | None) -> tuple[Nvrtc, list[Path]]:
    """NVRTC 12 and its include dirs; FileNotFoundError (saying what to install) without them."""
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
    return Nvrtc(nvidia / "cuda_nvrtc" / "lib" / "libnvrtc.so.12"), includes


def check(packages: str | None = None, arch: str = "sm_70") -> Report:
    """Compile every family for `arch` (one of ARCHS) and check its limits and attention tiles."""
    nvrtc, includes = nvrtc_for(packages)
    options = [f"--gpu-architecture={arch}", "-std=c++20", "--ptxas-options=-v", f"-I{ROOT / 'csrc'}"]
    options += [f"-I{i}" for i in includes]
    report = Report(arch, nvrtc.version)
    for family, (header, launcher, instantiations, sizes) in FAMILIES.items():
        dispatched = launcher_sizes(ROOT / "csrc" / launcher)
        if not dispatched <= set(sizes):
            extra = sorted(dispatched - set(sizes))
            report.failures.append(f"{family}: {launcher} dispatches sizes {extra} that this check does not compile")
        source = f'#include "{header}"\n' + "\n".join(instantiations) + "\n"
        ok, log, cubin, ptx = compile_cached(nvrtc, source, f"{family}_{arch}.cu", options)
        log_lines = [line for line in log.splitlines() if "are deprecated" not in line and line.strip()]
        if not ok:
            report.failures.append(f"{family} does not compile:\n" + "\n".join("     " + line for line in log_lines))
            continue
        kernels = kernel_usage(log_lines, ptx)
        if len(kernels) != len(instantiations):
            report.failures.append(f"{family}: ptxas reported {len(kernels)} kernels for {len(instantiations)}")
        report.kernels += kernels
        report.failures += [f"{k.name}: {problem}" for k in kernels for problem in k.violations()]
    limit = ARCHS[arch][0]
    report.tiles = attention_tiles(limit)
    tensor_cores = int(arch.removeprefix("sm_")) >= 70
    for tile in report.tiles:
        if tile.keys == 0 and (tile.kernel == "simt" or tensor_cores):
            report.failures.append(f"{tile.kernel} attention, head dim {tile.head_dim}: no tile fits {limit} B")
        if tile.bytes > limit:
            report.failures.append(f"{tile.kernel} attention, head dim {tile.head_dim}: {tile.bytes} B > {limit} B")
    report.delta_rule = delta_rule_tiles(limit)
    for tiles in report.delta_rule:
        if tensor_cores and not tiles.fits(limit):
            report.failures.append(f"chunked delta rule, head dim {tiles.head_dim}: no passes fit {limit} B ({tiles})")
    return report


def print_report(report: Report, quiet: bool) -> None:
    limit, cards = ARCHS[report.arch]
    print(f"check_archs: NVRTC {report.nvrtc_version}, target {report.arch} ({cards}; {limit // 1024} KB a block)")
    if quiet:
        return
    print(f"     {'kernel':78s} {'regs':>4s} {'x threads':>9s} {'static smem':>11s} {'spills':>6s} {'barriers':>8s}")
    for k in report.kernels:
        per_block = f"{k.registers * k.threads}" if k.threads else "?"
        print(
            f"     {k.name[:78]:78s} {k.registers:>4d} {per_block:>9s} {k.static_smem:>9d} B {k.spill_bytes:>4d} B"
            f" {k.barriers:>8d}"
        )
    print("     paged-attention tiles (keys per tile, dynamic shared memory):")
    tensor_cores = int(report.arch.removeprefix("sm_")) >= 70
    for t in report.tiles:
        if t.kernel != "simt" and not tensor_cores:
            continue
        where = f"     {t.kernel:5s} D={t.head_dim:<3d}"
        if t.keys:
            how = "opt-in" if t.opt_in else "48 KB default"
            print(f"{where} {t.keys:>2d} keys {t.bytes:>6d} B ({t.bytes / 1024:.2f} KB, {how})")
        else:
            print(f"{where} none fits: {'FAIL' if t.kernel == 'simt' else 'the SIMT kernel runs'}")
    if not tensor_cores:
        print("     wmma: no tensor cores before sm_70 (the SIMT kernel runs; f16 activations, or f32 on sm_61)")
        print("     chunked delta rule: no tensor cores before sm_70 (the token-serial kernel runs)")
        return
    print(
        "     chunked delta rule passes (dynamic shared memory: prepare, each state-pass variant that fits, output at"
        " its columns):"
    )
    for t in report.delta_rule:
        states = ", ".join(f"{name} {size} B" for name, size in t.state_bytes.items() if size)
        print(
            f"     D={t.head_dim:<3d} prepare {t.prepare_bytes:>6d} B, state {states}, output {t.output_columns:>3d} "
            f"columns {t.output_bytes:>6d} B"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--packages", help="a `pip install --target` dir holding the nvidia-*-cu12 12.9 packages")
    parser.add_argument("--arch", action="append", choices=sorted(ARCHS), help="target(s) (default: every arch)")
    parser.add_argument("--quiet", action="store_true", help="do not print the resource usage")
    args = parser.parse_args()
    archs = args.arch or list(ARCHS)
    # One process an arch (NVRTC compiles on one core): CI's 2 cores check the ten archs in about half the time.
    # Each process loads its own NVRTC, so nothing is shared but the compile cache, whose entries are renamed into
    # place whole. The reports print in arch order, whichever finishes first.
    workers = max(1, min(len(archs), int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)))
    failures = 0
    with concurrent.futures.ProcessPoolExecutor(workers) as pool:
        try:
            reports = list(pool.map(check, [args.packages] * len(archs), archs))
        except FileNotFoundError as missing:
            print(f"check_archs: {missing}\nand pass --packages .cache/nvrtc12", file=sys.stderr)
            return 1
    for report in reports:
        print_report(report, args.quiet)
        for failure in report.failures:
            print(f"FAIL {report.arch} {failure}")
        failures += len(report.failures)
        if not report.failures:
            kernels = len(report.kernels)
            print(f"check_archs: every kernel compiles for {report.arch} within its limits ({kernels} kernels)")
    if failures:
        print(f"check_archs: {failures} failure(s)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
