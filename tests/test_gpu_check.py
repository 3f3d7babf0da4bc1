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


def test_the_gpu_check_gates_on_the_self_check_at_clef_flash_shapes():
    """clef-tiny's head dim 32 never reaches the tensor-core attention: the check must fail when the
    self-check at clef-flash's shapes fails (it ended in `|| true`), in f16, bf16 where there is bf16, and
    with int8 weights; and it times attention at 16k with one record and runs Nsight Compute when present."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    flash = [line for line in script.splitlines() if "selfcheck_cost.py" in line]
    assert len(flash) == 2 and all("--only-flash" in line for line in flash), flash
    body = script.split("selfcheck_cost.py", 1)[1].split('step "shadow verification', 1)[0]
    assert "|| true" not in body and body.count("|| selfcheck_status=1") == 2
    assert "--quantize int8 --only-flash" in script and "--records 1 --contexts 16384 --no-trunk" in script
    assert 'if [ -x "$ncu" ]' in script and "--kernel-name regex:paged_attention_wmma" in script
    assert script.rstrip().endswith('[ "$selfcheck_status" = 0 ]')


def load_selfcheck_cost():
    import importlib.util

    spec = importlib.util.spec_from_file_location("selfcheck_cost", ROOT / "benchmarks" / "selfcheck_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_flash_shape_self_check_exits_1_when_a_check_fails(monkeypatch, capsys):
    from dataclasses import replace

    from clef_cuda.serving.selfcheck import Check, SelfCheckReport

    module = load_selfcheck_cost()
    small = replace(
        module.FLASH_LAYERS,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        rotary_dim=16,
    )
    monkeypatch.setattr(module, "FLASH_LAYERS", small)
    monkeypatch.setattr(sys, "argv", ["selfcheck_cost.py", "--only-flash", "--repeats", "1", "--quantize", "int8"])
    assert module.main() == 0  # healthy, with int8 weights at these shapes
    failing = SelfCheckReport("cpu", "float32", 0.0, (Check("paged_attention.prefill", 1.0, 1e-5),))
    monkeypatch.setattr(module, "run_selfcheck", lambda *a, **k: failing)
    assert module.main() == 1
    assert "SELF-CHECK FAILED: clef-flash layer shapes" in capsys.readouterr().out
