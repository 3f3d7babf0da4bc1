"""scripts/gpu_check.sh only runs where a GPU is lent, which is rare and short (about 15 minutes, 10 a
command), so what can run here does: the script parses; its dry run (which CI runs too) resolves every module
the check imports from the GPU image's package list and the carried wheels, and fails, naming it, when one is
missing; the gate is two stages with their own budgets, gating on every check and not swallowing failures;
the attention benchmark runs its own dry run; the flash-shape self-check exits 1 when a check fails."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_the_gpu_check_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def dry_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check_dry_run.py"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )


def test_the_dry_run_passes_and_selects_every_gpu_test():
    result = dry_run()
    assert result.returncode == 0, result.stdout[-3000:]
    selected = int(re.search(r"the gate selects (\d+) GPU cases over 10 files", result.stdout).group(1))
    assert selected >= 50, result.stdout


def test_the_dry_run_fails_naming_a_module_missing_from_both_lists(tmp_path):
    """The first GPU run of the old check would have died at `import fastapi`: the machine's image has none of
    the server's packages. With fastapi taken out of the carried wheels the dry run fails, naming it and who
    imports it; with a wheel's own requirement missing (pydantic's pydantic-core) it names that too."""
    wheels = (ROOT / "scripts" / "gpu_check_requirements.txt").read_text()
    without = tmp_path / "without-fastapi.txt"
    without.write_text("\n".join(line for line in wheels.splitlines() if not line.startswith("fastapi")))
    result = dry_run("--no-collect", "--wheels", str(without))
    assert result.returncode == 1
    assert "FAIL module fastapi (distribution fastapi, imported by app/auth.py" in result.stdout, result.stdout
    without_core = tmp_path / "without-pydantic-core.txt"
    without_core.write_text("\n".join(line for line in wheels.splitlines() if not line.startswith("pydantic-core")))
    result = dry_run("--no-collect", "--wheels", str(without_core))
    assert result.returncode == 1 and "carried wheel pydantic needs pydantic-core" in result.stdout, result.stdout
    assert dry_run("--no-collect").returncode == 0


def test_the_gate_is_two_stages_that_never_swallow_a_failure():
    """Stage 1 (the gate) with its budget and verdict, then the tables until the total budget; every gate step
    runs through `gate` (a time limit each, a failure or timeout fails the gate: no `|| true`); CUDA_LAUNCH_BLOCKING
    on the op tests, selected by the `cuda` marker (an id need not say "cuda"); all four sanitizer tools; the
    self-check at clef-flash's shapes in f16, bf16 and int8 and the shadow tolerance, gating; at most 8 files."""
    script = SCRIPT.read_text()
    stage1, stage2 = script.split("# ---- stage 2: the tables", 1)
    assert "GATE_BUDGET=${GATE_BUDGET:-420}" in script and "TOTAL_BUDGET=${TOTAL_BUDGET:-560}" in script
    assert "|| true" not in stage1
    assert re.search(r'gate "op tests on the GPU, CUDA_LAUNCH_BLOCKING=1" \d+ env CUDA_LAUNCH_BLOCKING=1', stage1)
    assert "-m cuda" in stage1 and "-k " not in stage1
    for tool in ("memcheck", "racecheck", "synccheck", "initcheck"):
        step = rf"""gate "compute-sanitizer {tool}[^"]*" \d+ bash -c 'sanitize "\$@"' _ {tool}"""
        assert re.search(step, stage1), tool
    assert 'scripts/sanitizer_verdict.py "$SANITIZER_LOG" "$status"' in stage1 and "$OUT/sanitizer" not in script
    assert stage1.count("benchmarks/selfcheck_cost.py") == 2 and "--quantize int8 --only-flash" in stage1
    assert 'flash_dtypes="f16 bf16"' in stage1 and "--dtypes f16,bf16 --records 10 --gate" in stage1
    for needed in ("test_paged_attention_v2.py", "test_glue.py", "test_quantize.py", "test_kernel_trials.py"):
        assert needed in stage1, needed
    assert 'echo "GATE $gate_verdict' in stage1 and script.rstrip().endswith('[ "$gate_failed" = 0 ]')
    outputs = set(re.findall(r"\$OUT/([\w.]+)", script)) | set(re.findall(r"\b(\w+\.md)\b", stage2))
    assert len(outputs) <= 8, outputs
    for table in (
        "kernel_table.py",
        "attention_table.py --device cuda --contexts 2048,16384",
        "--rows 64,256,1024,4096",
        "benchmarks/delta_rule_table.py --device cuda",
        "decision_split.py --device cuda --dtype f16 --tokens 2048",
        "decision_split.py --device cuda --dtype f16 --quantize int8 --tokens 2048",
    ):
        assert table in stage2, table
    # the delta rule's tables come first: the ones a short window must not lose
    assert stage2.index("delta_rule_table.py") < stage2.index("kernel_table.py")
    # --tables-only: the build, then stage 2 (every other gate step inside the skipped block)
    build, rest = stage1.split('gate "build for', 1)
    assert 'if [ "$tables_only" = 0 ]; then' in rest and rest.index("tables_only") < rest.index("op tests on the GPU")
    assert rest.rstrip().endswith("fi  # tables_only") or "fi  # tables_only" in rest


def test_the_delta_rule_benchmarks_run_on_the_cpu():
    """Their command lines and tables (the GPU columns need a GPU: a CPU run times the CPU op, and one small
    decision split by op)."""
    table = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "delta_rule_table.py"), "--device", "cpu", "--tokens", "64"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert table.returncode == 0, table.stderr[-2000:]
    assert "| 64 | - |" in table.stdout and "(CPU, wall)" in table.stdout
    bad = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "delta_rule_table.py"),
            "--device",
            "cpu",
            "--tokens",
            "2",
            "--batch",
            "4",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert bad.returncode == 2 and "--batch must be at least 1" in bad.stderr.splitlines()[-1]
    split = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "decision_split.py"),
            *("--device", "cpu", "--shape", "mid", "--tokens", "96", "--repeats", "1", "--autotune", "off"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert split.returncode == 0, split.stderr[-2000:]
    row = next(line for line in split.stdout.splitlines() if line.startswith("| mid none |"))
    shares = [float(cell.strip().rstrip("%")) for cell in row.split("|")[4:11]]
    assert abs(sum(shares) - 100) < 0.5 and shares[5] > 0 and shares[0] > 0, row  # GEMMs and the delta rule seen


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


def load_selfcheck_cost():
    import importlib.util

    spec = importlib.util.spec_from_file_location("selfcheck_cost", ROOT / "benchmarks" / "selfcheck_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_flash_shape_self_check_exits_1_when_a_check_fails(monkeypatch, capsys):
    from dataclasses import replace

    from clef_cuda.verification.selfcheck import Check, SelfCheckReport

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


# Excerpts of the H200's logs (2026-12-04), backtraces left out as gpu_check.sh has the tool leave them out;
# a report ends at a bare "========= " line (its trailing space is the tool's).
END = "========= "
NVJET_RACE = "\n".join(
    [
        "========= COMPUTE-SANITIZER",
        "========= Error: Race reported between Read access at nvjet_sm90_hsh_128x80_64x8_4x1_v_bz_TNT+0xa60",
        "=========     and Write access at nvjet_sm90_hsh_128x80_64x8_4x1_v_bz_TNT+0x3900 [400 hazards]",
        END,
        "self-check torch.float16 none: passed (23 checks on cuda:0 float16, 33.93 s)",
        "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)",
    ]
)
TORCH_READS_A_GEMMS_OUTPUT = "\n".join(
    [
        "========= COMPUTE-SANITIZER",
        "========= Uninitialized __global__ memory read of size 2 bytes",
        "=========     at void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda("
        "at::TensorIteratorBase &)>(int, T1)+0x3b0",
        "=========     by thread (64,0,0) in block (8,0,0)",
        "=========     Address 0x7f5b60882080",
        END,
        "========= ERROR SUMMARY: 1 error",
    ]
)
OURS_READS_UNWRITTEN = "\n".join(
    [
        "========= COMPUTE-SANITIZER",
        "========= Uninitialized __global__ memory read of size 2 bytes",
        "=========     at float clef::conv_input<__half>(const clef::Conv1dParams &, const clef::PackedSeq &, int, int)"
        "+0x980 in conv1d.h:59",
        "=========     by thread (0,0,0) in block (28,1,0)",
        "=========     Address 0x7fc282177b00",
        "=========     Device Frame: void clef::conv1d_fwd_kernel<__half, (int)4>(clef::Conv1dParams)+0x870 in "
        "conv1d_kernels.cuh:26",
        END,
        "========= ERROR SUMMARY: 1 error",
    ]
)
TOOL_CRASH = "\n".join(
    [
        "========= COMPUTE-SANITIZER",
        "========= Internal Sanitizer Error: The Sanitizer failed to handle a hardware exception.",
        END,
        "========= Error: process didn't terminate successfully",
    ]
)


def test_the_sanitizer_verdict_gates_on_our_kernels_the_tool_and_the_program():
    """cuBLAS's sm_90 GEMMs draw racecheck hazards and initcheck reads of their outputs that are not ours: shown,
    not gated. A report with a clef:: frame fails, so does the tool's own crash, so does the program's exit."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from sanitizer_verdict import verdict

    passed, says = verdict(NVJET_RACE, 0)
    assert passed and "not ours, not gated: 1 report(s) in nvjet_sm90_hsh_128x80_64x8_4x1_v_bz_TNT" in says
    passed, says = verdict(TORCH_READS_A_GEMMS_OUTPUT, 0)
    assert passed and any("at::native::unrolled_elementwise_kernel" in line for line in says)
    passed, says = verdict(OURS_READS_UNWRITTEN, 0)
    assert not passed and says[0].startswith("OURS: Uninitialized __global__ memory read") and "conv1d.h:59" in says[0]
    assert not verdict(TOOL_CRASH, 0)[0]
    assert not verdict(NVJET_RACE, 1)[0]  # the program's own check failed (a mismatch), reports or not
