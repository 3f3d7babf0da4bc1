#!/usr/bin/env python3
"""Which torch and which toolkit this machine's set-up uses, from the GPU it finds: the decision scripts/setup_env.sh
acts on, printed as shell assignments (eval'd there), or one line saying what the card needs and exit 2.

Two stacks are known to work (each built and tested in CI or on a card):
- torch 2.14.1 (PyPI's wheel, CUDA 13) with a CUDA 13 toolkit: Turing (sm_75) to Blackwell (sm_120), and the CPU;
- torch 2.7.1 (PyPI's wheel, CUDA 12.6: the Dockerfile's) with a CUDA 12 toolkit: Pascal (sm_60) to Hopper (sm_90).
  PyTorch's CUDA 12.8+ and 13 wheels dropped Pascal and Volta, and CUDA 13's nvcc cannot target them: a V100 needs
  this one.
The kernels are built for the cards found (TORCH_CUDA_ARCH_LIST), with the toolkit whose major version is torch's.

The card comes from nvidia-smi, the toolkit from $CUDA_HOME, /usr/local/cuda, /usr/local/cuda-* and the nvcc on PATH.
Tests give them instead: CLEF_SETUP_GPU ("none", or "7.0 Tesla V100-SXM2-32GB" per card, ";"-separated) and
CLEF_SETUP_NVCC ("none", or "VERSION=CUDA_HOME" per toolkit, ";"-separated)."""

from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

EXIT_NO_TOOLKIT = 2


@dataclass(frozen=True)
class Stack:
    torch: str
    torchvision: str
    cuda_major: int  # the toolkit's major version torch's extensions must be built with
    oldest: float  # compute capabilities the wheel carries kernels for
    newest: float
    where: str  # where it is tested
    newest_python: tuple[int, int] | None = None  # the last Python PyPI has its wheels for (None: today's)


STACKS = (
    Stack("2.14.1", "0.29.1", 13, 7.5, 12.1, "CI and the development machines"),
    Stack("2.7.1", "0.22.1", 12, 6.0, 9.0, "the Dockerfile's; CI's torch-floor check", newest_python=(3, 13)),
)
DEFAULT = STACKS[0]  # a CPU box, and make test everywhere


@dataclass(frozen=True)
class Card:
    capability: float
    name: str


@dataclass(frozen=True)
class Toolkit:
    version: str  # "13.0"
    home: str

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])


def detect_cards() -> list[Card]:
    given = os.environ.get("CLEF_SETUP_GPU")
    if given is not None:
        if given.strip() in ("", "none"):
            return []
        cards = []
        for item in given.split(";"):
            capability, _, name = item.strip().partition(" ")
            cards.append(Card(float(capability), name or "a GPU"))
        return cards
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap,name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    cards = []
    for line in out.splitlines():
        capability, _, name = line.partition(",")
        try:
            cards.append(Card(float(capability), name.strip()))
        except ValueError:
            continue  # a line nvidia-smi prints on a driver problem, not a card
    return cards


def nvcc_version(home: str) -> str | None:
    nvcc = Path(home) / "bin" / "nvcc"
    if not nvcc.is_file():
        return None
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+\.\d+)", out)
    return found.group(1) if found else None


def detect_toolkits() -> list[Toolkit]:
    """Every CUDA toolkit here, the preferred first ($CUDA_HOME, then /usr/local/cuda, then the versioned ones)."""
    given = os.environ.get("CLEF_SETUP_NVCC")
    if given is not None:
        if given.strip() in ("", "none"):
            return []
        return [Toolkit(*item.strip().split("=", 1)) for item in given.split(";")]
    homes = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
    on_path = shutil.which("nvcc")
    if on_path:
        homes.append(str(Path(on_path).resolve().parents[1]))
    found, seen = [], set()
    for home in homes:
        if not home or not Path(home).is_dir() or Path(home).resolve() in seen:
            continue
        seen.add(Path(home).resolve())
        version = nvcc_version(home)
        if version is not None:
            found.append(Toolkit(version, home))
    return found


def arch(capability: float) -> str:
    return f"sm_{round(capability * 10)}"


def without_a_card(toolkits: list[Toolkit], why: str, cuda_kernels: bool) -> tuple[dict[str, str], str]:
    """Today's torch on a machine whose card is not the point (a CPU box, make test), with the CPU kernels, and the
    CUDA kernels too where `cuda_kernels` (make test, whose compile of every kernel CI relies on; make serve only
    when the user asks with CLEF_CUDA_BUILD=cuda) and a toolkit of torch's CUDA major is here (that toolkit, whatever
    $CUDA_HOME says). Building against a toolkit of another major would fail on torch's CUDA check, many lines
    deep: the CPU kernels only, said. A CLEF_CUDA_BUILD=cpu the user set is kept and said."""
    variables = _variables(DEFAULT, None, [])
    requested = os.environ.get("CLEF_CUDA_BUILD")
    if requested == "cpu":
        return variables, f"{why}; the CPU kernels only (CLEF_CUDA_BUILD=cpu)"
    toolkit = next((t for t in toolkits if t.major == DEFAULT.cuda_major), None)
    if toolkit is not None and (cuda_kernels or requested == "cuda"):
        return variables | {"CUDA_HOME": toolkit.home}, f"{why}; CUDA kernels too, with nvcc {toolkit.version}"
    if requested:  # cuda, auto: the build says what it finds
        return variables, why
    if toolkit is not None:  # make serve on a machine with no card: kernels it cannot run cost minutes to compile
        return variables | {"CLEF_CUDA_BUILD": "cpu"}, (
            f"{why}; the CPU kernels only, no card to run CUDA ones on (to build them too, for a card added later: "
            "CLEF_CUDA_BUILD=cuda make serve)"
        )
    if toolkits:
        found = ", ".join(f"nvcc {t.version} at {t.home}" for t in toolkits)
        return variables | {"CLEF_CUDA_BUILD": "cpu"}, (
            f"{why}; the CPU kernels only: the CUDA kernels of torch {DEFAULT.torch} need a CUDA "
            f"{DEFAULT.cuda_major}.x toolkit, found {found}"
        )
    return variables | {"CLEF_CUDA_BUILD": "cpu"}, f"{why}; the CPU kernels only (no nvcc here)"


def python_fits(stack: Stack, python: tuple[int, int]) -> bool:
    return stack.newest_python is None or python <= stack.newest_python


def plan(
    cards: list[Card], toolkits: list[Toolkit], python: tuple[int, int] = sys.version_info[:2]
) -> tuple[dict[str, str] | None, str]:
    """(the shell variables, a line saying what was chosen) or (None, the line saying what the card needs)."""
    if not cards:
        return without_a_card(toolkits, f"no NVIDIA GPU found: torch {DEFAULT.torch}", cuda_kernels=False)
    if os.environ.get("CLEF_CUDA_BUILD") == "cpu":  # the user's choice, on any card
        return _variables(DEFAULT, None, []), f"torch {DEFAULT.torch}, the CPU kernels only (CLEF_CUDA_BUILD=cpu)"
    capabilities = sorted({card.capability for card in cards})
    described = ", ".join(f"{card.name} ({arch(card.capability)})" for card in cards)
    for stack in STACKS:
        if not all(stack.oldest <= c <= stack.newest for c in capabilities) or not python_fits(stack, python):
            continue
        toolkit = next((t for t in toolkits if t.major == stack.cuda_major), None)
        if toolkit is not None:
            return _variables(stack, toolkit, capabilities), (
                f"{described}: torch {stack.torch} (CUDA {stack.cuda_major}: {stack.where}), kernels for "
                f"{' '.join(arch(c) for c in capabilities)} with nvcc {toolkit.version} at {toolkit.home}"
            )
    covering = [s for s in STACKS if all(s.oldest <= c <= s.newest for c in capabilities)]
    fitting = [s for s in covering if python_fits(s, python)]
    found = ", ".join(f"nvcc {t.version} at {t.home}" for t in toolkits) or "no nvcc"
    if not covering:
        return None, f"{described}: no torch wheel covers these cards together; serve each kind on its own machine"
    if not fitting:
        newest = max(s.newest_python for s in covering if s.newest_python is not None)
        older = f"python{newest[0]}.{newest[1]}"
        return None, (
            f"{described}: torch {covering[0].torch} has wheels up to Python {newest[0]}.{newest[1]}, this is "
            f"{python[0]}.{python[1]}: run the set-up with an older one (make serve PYTHON={older})"
        )
    needs = " or ".join(f"a CUDA {s.cuda_major}.x toolkit (for torch {s.torch})" for s in fitting)
    archs = ";".join(f"{c:.1f}" for c in capabilities)
    docker = f" or build the Docker image (docker build --build-arg TORCH_CUDA_ARCH_LIST={archs} -t clef-serve .)"
    return None, (
        f"{described}: building its kernels needs {needs}; found {found}: install it and set "
        f"CUDA_HOME{docker if min(capabilities) < 7.5 else ''} (docs/operations.md#serve-on-your-card)"
    )


def _variables(stack: Stack, toolkit: Toolkit | None, capabilities: list[float]) -> dict[str, str]:
    variables = {"TORCH_VERSION": stack.torch, "TORCHVISION_VERSION": stack.torchvision}
    if toolkit is not None:
        variables |= {
            "CUDA_HOME": toolkit.home,
            "CLEF_CUDA_BUILD": "cuda",
            "TORCH_CUDA_ARCH_LIST": ";".join(f"{c:.1f}" for c in capabilities),
        }
    return variables


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("serve", "test"), default="serve")
    args = parser.parse_args(argv)
    if args.mode == "test":  # the suite's stack everywhere: CI's, whatever card the machine has
        variables, why = without_a_card(
            detect_toolkits(), f"make test: torch {DEFAULT.torch} ({DEFAULT.where})", cuda_kernels=True
        )
    else:
        variables, why = plan(detect_cards(), detect_toolkits())
    if variables is None:
        print(f"clef-cuda set-up: {why}", file=sys.stderr)
        return EXIT_NO_TOOLKIT
    for name, value in variables.items():
        print(f"{name}={shlex.quote(value)}")
    print(f"SETUP_PLAN={shlex.quote(why)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
