"""scripts/gpu_check.sh only runs where a GPU is lent, which is rare, so what can run here does: the script
parses, and the attention benchmark it ends with runs its dry run (every case and the trunk-step profile
at toy sizes on the CPU, untimed), so the first GPU run does not fail on a typo."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], check=True)


def test_the_attention_benchmark_runs_its_dry_run():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "attention_table.py"), "--dry-run", "--device", "cpu"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| B=2 ctx=80 | SDPA math |" in result.stdout
    assert "| B=2 ctx=80 | (auto picks) | - | - | - | cpu |" in result.stdout
    assert "One trunk step, 4 layers" in result.stdout and "| GEMMs (cuBLAS) |" in result.stdout
