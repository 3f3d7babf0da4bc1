"""benchmarks/cpu_peers.py's command line: a bad shape, and llama.cpp or its converter missing, are one-line
errors with exit 2, before anything is built (llama-cpp-python is an optional benchmark dependency: CI has none,
a developer machine may)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "cpu_peers.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_an_unknown_shape_is_one_line_naming_it():
    result = run("--ours-only", "--shapes", "mid,huge")
    assert result.returncode == 2 and result.stderr.strip() == (
        "cpu_peers: --shapes: unknown shape 'huge' (of mid, hidden-2048)"
    ), result.stderr


def test_llama_cpp_or_its_converter_missing_is_one_line(tmp_path):
    result = run("--llama-cpp-src", str(tmp_path))
    (line,) = result.stderr.strip().splitlines()
    assert result.returncode == 2 and line in (
        "cpu_peers: llama_cpp is not installed (pip install llama-cpp-python; or --ours-only)",
        f"cpu_peers: --llama-cpp-src: no convert_hf_to_gguf.py in {tmp_path}",
    ), result.stderr


def test_a_llama_cpp_build_without_its_library_is_one_line(tmp_path):
    result = run("--llama-cpp-src", str(tmp_path), "--llama-cpp-lib", str(tmp_path))
    assert result.returncode == 2 and result.stderr.strip() == (
        f"cpu_peers: --llama-cpp-lib: no libllama.so in {tmp_path}"
    ), result.stderr
