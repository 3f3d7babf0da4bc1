"""setup.py's build decisions: which archs, CPU or CUDA, and the messages when it cannot comply."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def setup_module(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.delenv("CLEF_CUDA_BUILD", raising=False)
    spec = importlib.util.spec_from_file_location("clef_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # __name__ != "__main__": defines the functions, builds nothing
    return module


NVCC13 = {"7.5", "8.0", "8.6", "8.7", "8.9", "9.0", "10.0", "12.0"}
NVCC12 = NVCC13 | {"6.0", "6.1", "6.2", "7.0", "7.2"}


def test_default_archs_drop_what_nvcc_cannot_target(setup_module, capsys):
    """nvcc 13: Turing to Blackwell as machine code, sm_90's PTX embedded for any newer card."""
    assert setup_module.choose_archs("13.0", NVCC13) == ["7.5", "8.0", "9.0+PTX", "10.0", "12.0"]
    printed = capsys.readouterr().out
    assert "dropping sm_60: nvcc 13.0 cannot target it" in printed
    assert "dropping sm_70: nvcc 13.0 cannot target it" in printed
    assert "CUDA 12.x" in printed


def test_default_archs_with_a_cuda12_toolchain_include_pascal_and_v100(setup_module):
    assert setup_module.choose_archs("12.9", NVCC12) == ["6.0", "7.0", "7.5", "8.0", "9.0+PTX", "10.0", "12.0"]


def test_before_cuda_12_8_blackwell_runs_sm_90s_ptx(setup_module, capsys):
    """A CUDA 12.6 toolchain (the V100 image's) has no sm_100 or sm_120: they are dropped, saying that the
    embedded PTX covers them, and never the PTX itself."""
    nvcc126 = NVCC12 - {"10.0", "12.0"}
    assert setup_module.choose_archs("12.6", nvcc126) == ["6.0", "7.0", "7.5", "8.0", "9.0+PTX"]
    printed = capsys.readouterr().out
    assert "dropping sm_100: nvcc 12.6 cannot target it (CUDA 12.8 or newer has it; until then sm_90's" in printed
    assert "dropping sm_120" in printed


def test_torch_cuda_arch_list_is_respected(setup_module, monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    assert setup_module.choose_archs("13.0", NVCC13) == ["8.0", "9.0+PTX"]


def test_an_arch_nvcc_cannot_target_fails_with_the_fix(setup_module, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.0")
    with pytest.raises(SystemExit):
        setup_module.choose_archs("13.0", NVCC13)
    err = capsys.readouterr().err
    assert "asks for 7.0, which nvcc 13.0 cannot target" in err
    assert "CUDA 12.x" in err


def test_forcing_cuda_without_a_toolchain_says_what_is_missing(setup_module, monkeypatch, capsys):
    monkeypatch.setenv("CLEF_CUDA_BUILD", "cuda")
    monkeypatch.setattr(setup_module, "find_cuda_home", lambda: None)
    import torch

    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(SystemExit):
        setup_module.extension_modules()
    err = capsys.readouterr().err
    assert "CPU-only build" in err and "no nvcc was found" in err


def test_forcing_cpu_builds_the_cpu_extension(setup_module, monkeypatch):
    monkeypatch.setenv("CLEF_CUDA_BUILD", "cpu")
    (ext,) = setup_module.extension_modules()
    assert ext.name == "clef_cuda._C"
    assert not any(src.endswith(".cu") for src in ext.sources)


def test_unknown_build_mode_is_rejected(setup_module, monkeypatch, capsys):
    monkeypatch.setenv("CLEF_CUDA_BUILD", "gpu")
    with pytest.raises(SystemExit):
        setup_module.extension_modules()
    assert "must be auto, cuda or cpu" in capsys.readouterr().err


def test_local_nvcc_is_read_correctly(setup_module):
    home = setup_module.find_cuda_home()
    if home is None:
        pytest.skip("no nvcc on this machine")  # CI has nvcc 13 at /usr/local/cuda
    version, archs = setup_module.nvcc_info(home)
    assert version[0].isdigit() and "9.0" in archs
    if float(version) >= 13:
        assert "7.0" not in archs
    assert os.path.exists(Path(home, "bin", "nvcc"))


def test_the_embedded_model_ships_in_the_wheel(setup_module):
    """Every file of the default release is package data (a non-editable install, e.g. the Docker image,
    would otherwise serve without it and fail at start-up)."""
    from fnmatch import fnmatch

    from clef_cuda.model import default_model

    package = ROOT / "clef_cuda"
    files = [p.relative_to(package).as_posix() for p in default_model.RELEASE.rglob("*") if p.is_file()]
    assert "model.safetensors" in {Path(f).name for f in files}
    for name in files:
        assert any(fnmatch(name, pattern) for pattern in setup_module.PACKAGE_DATA["clef_cuda"]), name


def test_the_status_pages_files_ship_in_the_wheel(setup_module):
    """GET / and its assets are served from app/static/: package data, or an installed server's page is a 500."""
    from fnmatch import fnmatch

    from app.routes.status_page import ASSETS, STATIC

    for name in ["status.html", *ASSETS]:
        assert (STATIC / name).is_file(), name
        assert any(fnmatch(f"static/{name}", pattern) for pattern in setup_module.PACKAGE_DATA["app"]), name


def test_the_torch_floor_is_the_v100_images_torch(setup_module):
    """setup.py's torch floor is the Dockerfile's TORCH_VERSION, which scripts/torch_floor_check.sh
    (run by .ci/run) installs and tests the package under."""
    import re

    dockerfile = (ROOT / "Dockerfile").read_text()
    (image_torch,) = re.findall(r"^ARG TORCH_VERSION=(\S+)$", dockerfile, re.M)
    assert setup_module.TORCH_FLOOR == image_torch
    script = (ROOT / "scripts" / "torch_floor_check.sh").read_text()
    assert "ARG TORCH_VERSION=" in script and "ARG TORCHVISION_VERSION=" in script  # reads both from it
    assert re.findall(r"^ARG TORCHVISION_VERSION=\S+$", dockerfile, re.M)
    assert "scripts/torch_floor_check.sh" in (ROOT / ".ci" / "run").read_text()


def test_the_installed_metadata_pins_the_torch_it_was_built_against():
    """So a resolver cannot move torch under a built extension (torchvision pulls its own torch)."""
    from importlib.metadata import requires, version

    import torch

    from clef_cuda.kernels import extension

    assert f"torch=={version('torch')}" in requires("clef-cuda")
    assert extension.built_with_torch() == torch.__version__


def test_an_extension_built_against_another_torch_is_a_one_line_import_error():
    """The import of the ops under another torch than the build's (here a torch reporting another version)
    names both versions and the fix, instead of an undefined C++ symbol; clef-serve says it in one line."""
    import subprocess
    import sys

    pretend = "import torch; torch.__version__ = '2.99.0+other'; "
    result = subprocess.run(
        [sys.executable, "-c", pretend + "import clef_cuda.kernels.ops"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "built against torch" in last and "running 2.99.0+other: reinstall" in last, result.stderr
    serve = subprocess.run(
        [sys.executable, "-c", pretend + "import sys; from app.cli import main; sys.exit(main(['--d', 'cpu']))"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert serve.returncode == 2, serve.stderr
    (line,) = serve.stderr.strip().splitlines()
    assert line.startswith("clef-serve: error: clef_cuda._C was built against torch") and "reinstall" in line
