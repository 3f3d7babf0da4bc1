"""Builds the torch extension clef_cuda._C from csrc/.

CLEF_CUDA_BUILD=auto (default) builds the CUDA kernels when torch has CUDA and nvcc is found, and a
CPU-only extension otherwise; =cuda forces CUDA (and fails, saying what is missing, without a
toolchain); =cpu forces the CPU-only build. TORCH_CUDA_ARCH_LIST is respected; by default the kernels
are built for 6.0;7.0;7.5;8.0;9.0+PTX;10.0;12.0 minus what the local nvcc cannot target (nvcc 13 cannot
target sm_60 or sm_70: build for Pascal and V100 with a CUDA 12.x toolchain, see docs/development.md; before 12.8 there
is no 10.0 or 12.0, and 9.0's PTX covers them). MAX_JOBS bounds the parallel compile jobs.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
# 6.0 runs on 6.1, 8.0 on 8.6/8.9. 9.0's PTX is embedded too, so a card newer than every SASS here (or one
# a toolchain could not target) JIT-compiles it at load instead of failing with "no kernel image"; 10.0
# (B200) and 12.0 (RTX 50x0) get their own SASS where the toolkit has them (CUDA 12.8 and newer).
DEFAULT_ARCHS = ["6.0", "7.0", "7.5", "8.0", "9.0+PTX", "10.0", "12.0"]
# The embedded default model (clef_cuda/model/default_model.py), and the torch the extension was built
# against (clef_cuda/kernels/extension.py checks it at import).
PACKAGE_DATA = {"clef_cuda": ["assets/clef-tiny/*", "BUILT_WITH_TORCH"], "app": ["static/*"]}
BUILT_WITH_TORCH = ROOT / "clef_cuda" / "BUILT_WITH_TORCH"
TORCH_FLOOR = "2.7.1"  # the V100 image's torch (Dockerfile TORCH_VERSION), tested by scripts/torch_floor_check.sh
DEPENDENCIES = [
    "numpy",
    "safetensors",
    "tokenizers",
    "tqdm",
    "psutil",
    "fastapi",
    "uvicorn",
    "prometheus-client",
    "zstandard",
    "torchvision",  # image decoding and resizing, bit-exact with the reference's processor
    "python-multipart",  # the SDK's image uploads (multipart/form-data)
    "rfc8785",  # canonical JSON of the state in the routing prefix key (X-Clef-Prefix-Key)
    "av",  # videos: PyAV, FFmpeg in its wheel
    "httpx",  # clef-serve batch drives the app in-process through httpx's ASGI transport
]


def fail(message: str) -> None:
    sys.stderr.write(f"\nclef_cuda build error: {message}\n\n")
    sys.exit(1)


def find_cuda_home() -> str | None:
    """CUDA_HOME/CUDA_PATH, else /usr/local/cuda, else the toolkit around the nvcc on PATH.

    Set before torch.utils.cpp_extension is imported: torch computes its own guess at import time and,
    with nvcc behind a wrapper in /usr/local/bin, guesses /usr/local and fails.
    """
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and Path(home, "bin", "nvcc").exists():
            return home
    if Path("/usr/local/cuda/bin/nvcc").exists():
        return "/usr/local/cuda"
    nvcc = shutil.which("nvcc")
    if nvcc:
        home = Path(nvcc).resolve().parent.parent
        if (home / "bin" / "nvcc").exists():
            return str(home)
    return None


def nvcc_info(cuda_home: str) -> tuple[str, set[str]]:
    """(version, archs as '7.5'-style strings) of the nvcc in cuda_home."""
    nvcc = str(Path(cuda_home, "bin", "nvcc"))
    version_text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"release (\d+\.\d+)", version_text)
    version = match.group(1) if match else "unknown"
    listed = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, check=True).stdout
    archs = {f"{m[:-1]}.{m[-1]}" for m in re.findall(r"compute_(\d+)", listed)}
    return version, archs


def parse_arch_list(text: str) -> list[str]:
    return [a for a in re.split(r"[;\s,]+", text.strip()) if a]


def choose_archs(version: str, supported: set[str]) -> list[str]:
    requested = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if requested:
        archs = parse_arch_list(requested)
        missing = [a for a in archs if a.removesuffix("+PTX") not in supported]
        if missing:
            fail(
                f"TORCH_CUDA_ARCH_LIST={requested!r} asks for {', '.join(missing)}, which nvcc {version} cannot "
                f"target (it supports {', '.join(sorted(supported, key=float))}). sm_70 (V100) needs a CUDA 12.x "
                "toolchain and a torch built with sm_70: see docs/development.md, 'Building for V100'."
            )
        print(f"clef_cuda: building CUDA kernels for {';'.join(archs)} (TORCH_CUDA_ARCH_LIST)")
        return archs
    archs = [a for a in DEFAULT_ARCHS if a.removesuffix("+PTX") in supported]
    for dropped in (a.removesuffix("+PTX") for a in DEFAULT_ARCHS if a.removesuffix("+PTX") not in supported):
        why = ""
        if dropped in ("6.0", "7.0"):
            why = " (use a CUDA 12.x toolchain for Pascal and V100, see docs/development.md)"
        elif dropped in ("10.0", "12.0"):
            why = " (CUDA 12.8 or newer has it; until then sm_90's embedded PTX is JIT-compiled there)"
        print(f"clef_cuda: dropping sm_{dropped.replace('.', '')}: nvcc {version} cannot target it{why}")
    if not archs:
        fail(f"nvcc {version} supports none of the default archs {DEFAULT_ARCHS}; set TORCH_CUDA_ARCH_LIST")
    print(f"clef_cuda: building CUDA kernels for {';'.join(archs)}")
    return archs


def extension_modules():
    mode = os.environ.get("CLEF_CUDA_BUILD", "auto").strip().lower()
    if mode not in ("auto", "cuda", "cpu"):
        fail(f"CLEF_CUDA_BUILD must be auto, cuda or cpu, got {mode!r}")
    cuda_home = find_cuda_home() if mode != "cpu" else None
    if cuda_home:
        os.environ["CUDA_HOME"] = cuda_home

    import torch
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    torch_cuda = torch.version.cuda
    if mode == "cuda":
        problems = []
        if torch_cuda is None:
            problems.append(f"the installed torch {torch.__version__} is a CPU-only build (install a CUDA build)")
        if cuda_home is None:
            problems.append("no nvcc was found (set CUDA_HOME, or put nvcc on PATH)")
        if problems:
            fail("CLEF_CUDA_BUILD=cuda but " + "; and ".join(problems))
    use_cuda = mode == "cuda" or (mode == "auto" and torch_cuda is not None and cuda_home is not None)

    csrc = ROOT / "csrc"
    families = ["conv1d", "gated_delta_rule", "paged_attention", "dequantize", "glue"]
    sources = ["csrc/bindings.cpp", "csrc/common/cpu_isa_ops.cpp"]
    for family in families:
        sources += [f"csrc/{family}/{family}_ops.cpp", f"csrc/{family}/{family}_cpu.cpp"]
    # -fopenmp: at::parallel_for is a header template that only runs in parallel when the including file
    # is compiled with OpenMP (it then shares torch's own libgomp thread pool).
    cxx_flags = ["-O3", "-fopenmp", "-Wno-psabi"]
    link_flags = ["-fopenmp"]
    if not use_cuda:
        print(
            f"clef_cuda: building the CPU-only extension (CLEF_CUDA_BUILD={mode}, torch CUDA={torch_cuda}, "
            f"nvcc home={cuda_home})"
        )
        return [
            CppExtension(
                "clef_cuda._C",
                sources,
                include_dirs=[str(csrc)],
                extra_compile_args={"cxx": cxx_flags},
                extra_link_args=link_flags,
            )
        ]

    version, supported = nvcc_info(cuda_home)
    archs = choose_archs(version, supported)
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(archs)
    arch_token = "_".join(a.removesuffix("+PTX").replace(".", "") for a in archs)
    ptx_token = "_".join(a.removesuffix("+PTX").replace(".", "") for a in archs if a.endswith("+PTX")) or "none"
    sources += [f"csrc/{family}/{family}_launch.cu" for family in families]
    defines = ["-DCLEF_WITH_CUDA", f"-DCLEF_CUDA_ARCH_TOKEN={arch_token}", f"-DCLEF_CUDA_PTX_TOKEN={ptx_token}"]
    return [
        CUDAExtension(
            "clef_cuda._C",
            sources,
            include_dirs=[str(csrc)],
            extra_compile_args={"cxx": cxx_flags + defines, "nvcc": ["-O3", "-lineinfo"] + defines},
            extra_link_args=link_flags,
        )
    ]


def torch_pin() -> str:
    """torch==<the installed torch>, which the extension is about to be built against; the build fails
    below the floor. Also records torch's full version (local build tag included) for the import check."""
    from importlib.metadata import version

    import torch

    installed = version("torch")

    def release(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])

    if release(installed) < release(TORCH_FLOOR):
        fail(f"torch {installed} is older than the supported floor {TORCH_FLOOR}")
    BUILT_WITH_TORCH.write_text(torch.__version__ + "\n")
    return f"torch=={installed}"


def build_ext_class():
    from torch.utils.cpp_extension import BuildExtension

    return BuildExtension.with_options(use_ninja=True)


# pip's build backend executes this file as __main__; tests import it to check the build decisions.
if __name__ == "__main__":
    setup(
        packages=find_packages(include=["clef_cuda", "clef_cuda.*", "app", "app.*"]),
        package_data=PACKAGE_DATA,
        install_requires=[torch_pin(), *DEPENDENCIES],
        ext_modules=extension_modules(),
        cmdclass={"build_ext": build_ext_class()},
    )
