"""The set-up picks the torch and toolkit for the card it finds (scripts/setup_plan.py), and `make serve` installs
no test tooling (scripts/setup_env.sh serve). Tested without a GPU: the card and the toolkits are given through
CLEF_SETUP_GPU and CLEF_SETUP_NVCC, and setup_env.sh runs with --dry-run (it prints what it would do)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CUDA12, CUDA13 = "12.6=/usr/local/cuda-12.6", "13.0=/usr/local/cuda"


def setup_plan(gpu: str, nvcc: str, mode: str = "serve", **given: str) -> subprocess.CompletedProcess:
    """The plan for these cards and toolkits; CLEF_CUDA_BUILD only where `given` (CI exports its own)."""
    env = {k: v for k, v in os.environ.items() if k != "CLEF_CUDA_BUILD"} | {"CLEF_SETUP_GPU": gpu}
    env |= {"CLEF_SETUP_NVCC": nvcc} | given
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "setup_plan.py"), "--mode", mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def assignments(result: subprocess.CompletedProcess) -> dict[str, str]:
    assert result.returncode == 0, result.stderr
    return dict(re.findall(r"^(\w+)='?([^'\n]*)'?$", result.stdout, re.M))


@pytest.mark.parametrize(
    ("gpu", "nvcc", "torch", "archs", "home"),
    [
        ("7.0 Tesla V100-SXM2-32GB", f"{CUDA13};{CUDA12}", "2.7.1", "7.0", "/usr/local/cuda-12.6"),
        ("6.0 Tesla P100-PCIE-16GB", CUDA12, "2.7.1", "6.0", "/usr/local/cuda-12.6"),
        ("7.5 Tesla T4", CUDA13, "2.14.1", "7.5", "/usr/local/cuda"),
        ("7.5 Tesla T4", CUDA12, "2.7.1", "7.5", "/usr/local/cuda-12.6"),  # no CUDA 13 here: the older stack
        ("9.0 NVIDIA H100 80GB HBM3", f"{CUDA12};{CUDA13}", "2.14.1", "9.0", "/usr/local/cuda"),
        ("12.0 NVIDIA GeForce RTX 5090", CUDA13, "2.14.1", "12.0", "/usr/local/cuda"),
        ("8.0 NVIDIA A100;8.6 NVIDIA A10", CUDA13, "2.14.1", "8.0;8.6", "/usr/local/cuda"),
    ],
)
def test_each_card_gets_a_torch_with_its_kernels_and_a_toolkit_of_that_torchs_cuda(gpu, nvcc, torch, archs, home):
    chosen = assignments(setup_plan(gpu, nvcc))
    assert (chosen["TORCH_VERSION"], chosen["TORCH_CUDA_ARCH_LIST"], chosen["CUDA_HOME"]) == (torch, archs, home)
    assert chosen["CLEF_CUDA_BUILD"] == "cuda" and chosen["TORCHVISION_VERSION"]


def test_a_cpu_box_gets_todays_torch_and_the_cpu_kernels():
    chosen = assignments(setup_plan("none", "none"))
    assert chosen["TORCH_VERSION"] == "2.14.1" and chosen["CLEF_CUDA_BUILD"] == "cpu" and "CUDA_HOME" not in chosen


def test_make_serve_without_a_card_builds_no_cuda_kernels_and_says_how_to_add_them():
    """A CPU box with a CUDA 13 nvcc on it: make serve spent 340 s of 403 compiling kernels for cards it does not
    have. Now the CPU kernels only, and the plan's line says how to build the CUDA ones too (which is kept)."""
    chosen = assignments(setup_plan("none", CUDA13))
    assert chosen["CLEF_CUDA_BUILD"] == "cpu" and "CUDA_HOME" not in chosen
    assert "CPU kernels only" in chosen["SETUP_PLAN"] and "CLEF_CUDA_BUILD=cuda make serve" in chosen["SETUP_PLAN"]
    asked = assignments(setup_plan("none", CUDA13, CLEF_CUDA_BUILD="cuda"))
    assert asked["CUDA_HOME"] == "/usr/local/cuda" and "CUDA kernels too" in asked["SETUP_PLAN"]
    assert "CLEF_CUDA_BUILD" not in asked  # the user's cuda stays in the environment


def test_make_test_without_a_card_builds_the_cuda_kernels_where_a_toolkit_of_torchs_cuda_is_here():
    chosen = assignments(setup_plan("none", CUDA13, "test"))
    assert chosen["CUDA_HOME"] == "/usr/local/cuda" and "CLEF_CUDA_BUILD" not in chosen
    assert "CUDA kernels too, with nvcc 13.0" in chosen["SETUP_PLAN"]


@pytest.mark.parametrize("mode", ["serve", "test"])
@pytest.mark.parametrize("gpu", ["none", "7.5 Tesla T4"])
def test_clef_cuda_build_cpu_is_kept_and_the_plan_says_cpu_kernels_only(mode, gpu):
    chosen = assignments(setup_plan(gpu, CUDA13, mode, CLEF_CUDA_BUILD="cpu"))
    assert "CUDA_HOME" not in chosen and "CLEF_CUDA_BUILD" not in chosen and "TORCH_CUDA_ARCH_LIST" not in chosen
    line = chosen["SETUP_PLAN"]
    assert "CPU kernels only (CLEF_CUDA_BUILD=cpu)" in line and "CUDA kernels" not in line


@pytest.mark.parametrize("mode", ["serve", "test"])
def test_without_a_card_a_toolkit_of_another_cuda_builds_the_cpu_kernels_only(mode):
    """torch 2.14.1 is CUDA 13's: with only a CUDA 12 nvcc here (a CPU box, or make test beside a V100's toolkit)
    the build is the CPU one, said in the plan's line, instead of torch's CUDA mismatch many lines into the build;
    make test with a CUDA 13 one among them uses that one (not $CUDA_HOME's); a CLEF_CUDA_BUILD the user set is
    kept."""
    only_12 = assignments(setup_plan("none", CUDA12, mode))
    assert only_12["TORCH_VERSION"] == "2.14.1" and only_12["CLEF_CUDA_BUILD"] == "cpu"
    assert "CPU kernels only" in only_12["SETUP_PLAN"] and "found nvcc 12.6" in only_12["SETUP_PLAN"]
    both = assignments(setup_plan("none", f"{CUDA12};13.0=/usr/local/cuda-13.0", "test"))
    assert both["CUDA_HOME"] == "/usr/local/cuda-13.0" and "CLEF_CUDA_BUILD" not in both
    assert "CLEF_CUDA_BUILD" not in assignments(setup_plan("none", CUDA12, mode, CLEF_CUDA_BUILD="cuda"))


def test_a_python_newer_than_the_cards_torch_stops_with_one_line():
    """torch 2.7.1 (Pascal, Volta) has wheels up to Python 3.13: a V100 set up with 3.14 stops naming the Python to
    use; a card today's torch covers goes on with it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("setup_plan", ROOT / "scripts" / "setup_plan.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    cuda12, cuda13 = module.Toolkit("12.6", "/usr/local/cuda-12.6"), module.Toolkit("13.0", "/usr/local/cuda")
    v100, t4 = module.Card(7.0, "Tesla V100-SXM2-32GB"), module.Card(7.5, "Tesla T4")
    variables, line = module.plan([v100], [cuda12], python=(3, 14))
    assert variables is None and "torch 2.7.1 has wheels up to Python 3.13, this is 3.14" in line, line
    assert "PYTHON=python3.13" in line
    assert module.plan([v100], [cuda12], python=(3, 13))[0]["TORCH_VERSION"] == "2.7.1"
    assert module.plan([t4], [cuda12, cuda13], python=(3, 14))[0]["TORCH_VERSION"] == "2.14.1"


@pytest.mark.parametrize(
    ("gpu", "nvcc", "says"),
    [
        ("7.0 Tesla V100-SXM2-16GB", CUDA13, "needs a CUDA 12.x toolkit (for torch 2.7.1); found nvcc 13.0"),
        ("6.1 Tesla P40", "none", "needs a CUDA 12.x toolkit (for torch 2.7.1); found no nvcc"),
        ("10.0 NVIDIA B200", CUDA12, "needs a CUDA 13.x toolkit (for torch 2.14.1); found nvcc 12.6"),
        ("7.0 Tesla V100;12.0 NVIDIA RTX 5090", f"{CUDA12};{CUDA13}", "no torch wheel covers these cards together"),
    ],
)
def test_a_card_without_its_toolkit_stops_with_one_line_naming_it(gpu, nvcc, says):
    result = setup_plan(gpu, nvcc)
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("clef-cuda set-up: ") and says in line, line
    if "V100" in gpu and "RTX" not in gpu:
        assert "docker build --build-arg TORCH_CUDA_ARCH_LIST=7.0" in line


def dry_run(mode: str, tmp_path: Path, gpu: str, nvcc: str) -> subprocess.CompletedProcess:
    env = os.environ | {"CLEF_SETUP_GPU": gpu, "CLEF_SETUP_NVCC": nvcc, "VENV": str(tmp_path / "venv")}
    env.pop("CUDA_HOME", None)
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup_env.sh"), mode, "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
    )


TEST_TOOLING = ("requirements-dev.txt", "clef-finetune", "fla-core", "nvidia-cuda-nvrtc", "apt-get")


def test_make_serve_on_a_v100_installs_its_torch_and_builds_for_it_and_nothing_of_the_tests(tmp_path):
    result = dry_run("serve", tmp_path, "7.0 Tesla V100-SXM2-32GB", CUDA12)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "torch==2.7.1" in out and "torchvision==0.22.1" in out and "-r requirements-serve.txt" in out
    assert "TORCH_CUDA_ARCH_LIST=7.0" in out and "CLEF_CUDA_BUILD=cuda" in out and "pip install -q --no-build" in out
    assert not [word for word in TEST_TOOLING if word in out], out
    assert not (tmp_path / "venv").exists()  # a dry run changes nothing


def test_make_serve_on_a_v100_without_cuda_12_stops_before_installing_anything(tmp_path):
    result = dry_run("serve", tmp_path, "7.0 Tesla V100-SXM2-32GB", CUDA13)
    assert result.returncode == 2 and "would run" not in result.stdout
    assert "needs a CUDA 12.x toolkit" in result.stderr.strip().splitlines()[-1]


def test_make_test_installs_the_test_tooling(tmp_path):
    result = dry_run("test", tmp_path, "none", "none")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "-r requirements-dev.txt" in result.stdout and "clef-finetune==0.1.0" in result.stdout
    # the Debian packages: the line that installs the missing ones, or, all present, the one a fresh machine runs
    (apt,) = [line for line in result.stdout.splitlines() if "apt-get install" in line]
    assert {"haproxy", "prometheus", "chromium", "chromium-driver"} <= set(apt.replace(")", " ").split()), apt


def pins(path: Path) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name = re.split(r"[=<>\[ ]", line, maxsplit=1)[0].lower()
            found[name] = line
    return found


def test_the_servers_pins_are_the_tests_and_cover_the_packages_dependencies():
    serve, dev = pins(ROOT / "requirements-serve.txt"), pins(ROOT / "requirements-dev.txt")
    assert {name: line for name, line in serve.items() if name in dev} == {
        name: dev[name] for name in serve if name in dev
    }
    sys.path.insert(0, str(ROOT))
    try:
        import setup  # setup.py's DEPENDENCIES (importing it builds nothing: setup() runs under __main__)
    finally:
        sys.path.remove(str(ROOT))
    dependencies = {re.split(r"[=<>\[ ]", d, maxsplit=1)[0].lower() for d in setup.DEPENDENCIES}
    assert dependencies - {"torchvision"} <= set(serve), dependencies - set(serve)


def _imported_top_level_modules(*rooms: str) -> dict[str, set[str]]:
    """Every module name imported anywhere in these folders (module- and function-level), its top level -> files."""
    import ast

    found: dict[str, set[str]] = {}
    for room in rooms:
        for path in (ROOT / room).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                for name in names:
                    found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


def _with_what_they_require(distributions: set[str]) -> set[str]:
    """The distributions and everything they require unconditionally (no extra, no marker that is false here)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    seen, todo = set(), [d.lower() for d in distributions]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name.lower().replace("_", "-"))
    return seen


def test_every_module_the_server_imports_is_a_declared_dependency():
    """clef-serve batch died with ModuleNotFoundError: httpx where make serve had installed (only the test venv had
    it): every third-party import in app/ and clef_cuda/ comes from setup.py's DEPENDENCIES (so also the image's
    pip install . and requirements-serve.txt, which the test above holds to them), from what they require, from
    torch, or from an optional extra (the [otel] traces). scripts/serve_install_check.sh runs the commands in a venv
    of the serve set-up alone."""
    from importlib import metadata

    sys.path.insert(0, str(ROOT))
    try:
        import setup
    finally:
        sys.path.remove(str(ROOT))
    project = tomllib_load(ROOT / "pyproject.toml")["project"]
    declared = {re.split(r"[=<>\[ ]", d, maxsplit=1)[0].lower() for d in setup.DEPENDENCIES} | {"torch"}
    extras = {re.split(r"[=<>\[ ]", d, maxsplit=1)[0].lower() for d in project["optional-dependencies"]["otel"]}
    allowed = _with_what_they_require(declared) | _with_what_they_require(extras)
    distributions = metadata.packages_distributions()
    undeclared = {}
    for module, files in _imported_top_level_modules("app", "clef_cuda").items():
        if module in sys.stdlib_module_names or module in ("app", "clef_cuda"):
            continue
        owners = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
        if not owners & allowed:
            undeclared[module] = sorted(files)
    assert not undeclared, f"imported but not a declared dependency: {undeclared}"


def tomllib_load(path: Path) -> dict:
    import tomllib

    return tomllib.loads(path.read_text())
