"""The CPU kernels' instruction-set variants (csrc/common/cpu_kernel.h): which ones this machine runs, the
switch (clef_cuda.ops.set_cpu_isa, CLEF_CPU_ISA) and its errors, and decisions under every variant.

The kernel tests run each op under every variant this machine can run (tests/conftest.py: the
cpu-avx512 / cpu-avx2 / cpu-baseline backends), so CI on an AVX-512 machine covers the AVX2 register
blocks too, and one on an AVX2 machine covers AVX2 and baseline."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
from random_requests import random_request
from releases import mid_release

from clef_cuda import Decider, ops

ISAS = ("avx512", "avx2", "baseline")
# Variants sum in other orders (register blocks of other widths): fp32 probabilities differ by rounding.
CROSS_VARIANT_BOUND = 1e-5


def test_the_supported_variants_are_ordered_and_the_default_is_the_best():
    supported = ops.supported_cpu_isas()
    assert supported == [isa for isa in ISAS if isa in supported] and supported[-1] == "baseline"
    pinned = os.environ.get(ops.CPU_ISA_ENV, "").strip().lower()  # a whole-suite run may pin one
    assert ops.cpu_isa() == (supported[0] if pinned in ("", "auto") else pinned)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
def test_switching_variants_and_back(isa):
    if isa not in ops.supported_cpu_isas():
        with pytest.raises(ValueError, match=f"this CPU cannot run the {isa} kernels"):
            ops.set_cpu_isa(isa)
        return
    before = ops.cpu_isa()
    with ops.using_cpu_isa(isa):
        assert ops.cpu_isa() == isa
    assert ops.cpu_isa() == before
    assert ops.set_cpu_isa("auto") == before and ops.cpu_isa() == ops.supported_cpu_isas()[0]
    ops.set_cpu_isa(before)


@pytest.mark.parametrize("name", ["sse4", "AVX2 ", "", "avx-512"])
def test_an_unknown_variant_is_a_value_error_naming_it(name):
    with pytest.raises(ValueError, match="must be auto, avx512, avx2 or baseline"):
        ops.set_cpu_isa(name)


def _python(code: str, isa: str) -> subprocess.CompletedProcess:
    env = os.environ | {"CLEF_CPU_ISA": isa}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_the_environment_variable_pins_the_variant_for_the_process():
    result = _python("from clef_cuda import ops; print(ops.cpu_isa())", "baseline")
    assert result.returncode == 0 and result.stdout.strip() == "baseline", result.stderr


# A decision in a fresh process: the per-variant call counters of every CPU kernel call it made.
DECIDE_AND_COUNT = """
import json, random, sys
sys.path.insert(0, sys.argv[2])
from random_requests import random_request
from clef_cuda import Decider, ops
mid = Decider.from_release(sys.argv[1], device="cpu", progress=False, chunk_size=128)
before = ops.cpu_isa_calls()
mid.probabilities(mid.encode(random_request(random.Random(1), state_words=(200, 300))))
print(json.dumps({isa: n - before[isa] for isa, n in ops.cpu_isa_calls().items()}))
"""


@pytest.mark.parametrize("isa", ["avx2", "baseline"])
def test_the_environment_variable_reaches_the_kernels(isa):
    """CLEF_CPU_ISA pins the code that runs, not only what cpu_isa() reports: every CPU kernel call of a whole
    decision picked the pinned variant (the kernels' per-variant call counters), none the machine's best."""
    import json
    from pathlib import Path

    if isa not in ops.supported_cpu_isas():
        pytest.skip(f"this CPU cannot run the {isa} kernels")
    env = os.environ | {"CLEF_CPU_ISA": isa}
    code = [sys.executable, "-c", DECIDE_AND_COUNT, str(mid_release()), str(Path(__file__).parent)]
    result = subprocess.run(code, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    calls = json.loads(result.stdout.strip().splitlines()[-1])
    assert calls[isa] > 20 and sum(calls.values()) == calls[isa], calls


def test_clef_serve_refuses_a_bad_variable_in_one_line_with_exit_2():
    result = _python("import sys; from app.cli import main; sys.exit(main(['--d', 'cpu']))", "sse4")
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("clef-serve: error: CLEF_CPU_ISA=sse4:") and "avx2" in line


# ---- the GEMMs' features (clef_cuda.cpu_features): what torch's oneDNN may use beside our kernels -------------
AVX512_BF16_VNNI = frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"})


def test_the_gemm_features_follow_the_flags_and_the_pinned_level(monkeypatch):
    from clef_cuda import cpu_features
    from clef_cuda.cpu_features import cpu_gemm_features

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    found = cpu_gemm_features("avx512", AVX512_BF16_VNNI)
    assert (found.bf16, found.int8) == ("avx512_bf16", "avx512_vnni")
    assert cpu_gemm_features("avx512", frozenset({"avx2", "avx512f"})).describe() == (
        "no bf16 dot products, no int8 dot products"
    )
    # Pinned to AVX2, an AVX-512 machine reports what an AVX2-only CPU has: AVX-VNNI at most.
    assert (cpu_gemm_features("avx2", AVX512_BF16_VNNI).bf16, cpu_gemm_features("avx2", AVX512_BF16_VNNI).int8) == (
        None,
        None,
    )
    assert cpu_gemm_features("avx2", AVX512_BF16_VNNI | {"avx_vnni"}).int8 == "avx_vnni"
    assert cpu_gemm_features("baseline", AVX512_BF16_VNNI | {"avx_vnni"}).int8 is None
    assert cpu_gemm_features("avx512", frozenset({"amx_bf16", "amx_int8"})) == cpu_gemm_features(
        "avx512", frozenset({"amx_bf16", "amx_int8"})
    )
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")  # oneDNN's own cap, set by hand, counts too
    assert cpu_gemm_features("avx512", AVX512_BF16_VNNI).bf16 is None
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI")  # AVX-512 with VNNI, without its bf16
    assert cpu_gemm_features("avx512", AVX512_BF16_VNNI) == cpu_features.CpuGemmFeatures(None, "avx512_vnni")


def test_a_pinned_level_caps_the_libraries_unless_they_are_set():
    from clef_cuda.cpu_features import cap_library_gemms

    environ = {"MKL_ENABLE_INSTRUCTIONS": "AVX512"}
    assert cap_library_gemms("avx2", environ) == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert environ == {"MKL_ENABLE_INSTRUCTIONS": "AVX512", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert cap_library_gemms("avx512", {}) == {} and cap_library_gemms("auto", {}) == {}


def test_the_cpu_serves_f32_unless_told_and_says_what_bf16_does_there(monkeypatch):
    """f32 stays the CPU's default; the log line says bf16 is faster where the GEMMs have bf16 dot products and
    slower where they convert in software; bf16 is served where asked either way."""
    import torch

    from clef_cuda import cpu_features
    from clef_cuda.decider import serving_dtype

    cpu = torch.device("cpu")
    with_bf16 = cpu_features.CpuGemmFeatures(bf16="avx512_bf16", int8="avx512_vnni")
    without = cpu_features.CpuGemmFeatures(bf16=None, int8=None)
    monkeypatch.setattr(cpu_features, "cpu_gemm_features", lambda isa: with_bf16)
    dtype, why = serving_dtype(cpu)
    assert dtype == torch.float32 and "--dtype bf16 runs them at about 2.5x" in why and "avx512_bf16" in why
    assert serving_dtype(cpu, torch.bfloat16) == (torch.bfloat16, None)
    assert serving_dtype(cpu, torch.float32) == (torch.float32, None)
    monkeypatch.setattr(cpu_features, "cpu_gemm_features", lambda isa: without)
    assert serving_dtype(cpu) == (torch.float32, None)
    dtype, why = serving_dtype(cpu, torch.bfloat16)
    assert dtype == torch.bfloat16 and "slower than f32" in why and "no bf16 dot products" in why


# A bf16 GEMM in a fresh process, with oneDNN saying which code ran it (ONEDNN_VERBOSE).
BF16_GEMM = """
import json, torch
from clef_cuda import ops
from clef_cuda.cpu_features import cpu_gemm_features
torch.nn.functional.linear(torch.randn(64, 64).bfloat16(), torch.randn(64, 64).bfloat16())
print(json.dumps({"isa": ops.cpu_isa(), "bf16": cpu_gemm_features(ops.cpu_isa()).bf16}))
"""


def test_the_pin_reaches_the_gemms():
    """CLEF_CPU_ISA=avx2 caps oneDNN too: no bf16 GEMM runs AVX-512 code, and the features say no bf16 dot
    products. Unpinned on a CPU with them, oneDNN's AVX512-BF16 matmul runs (the control)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")}
    runs = {}
    for pin in ("avx2", ""):
        run_env = env | {"ONEDNN_VERBOSE": "1", "CLEF_CPU_ISA": pin}
        result = subprocess.run(
            [sys.executable, "-c", BF16_GEMM], capture_output=True, text=True, env=run_env, timeout=120
        )
        assert result.returncode == 0, result.stderr
        lines = result.stdout.strip().splitlines()
        runs[pin] = (json.loads(lines[-1]), [line for line in lines if ",exec," in line and "matmul" in line])
    pinned, pinned_gemms = runs["avx2"]
    assert pinned == {"isa": "avx2", "bf16": None} and not [g for g in pinned_gemms if "avx512" in g], pinned_gemms
    free, free_gemms = runs[""]
    if free["bf16"] is not None:
        assert [g for g in free_gemms if "avx512_core_bf16" in g or "amx" in g], free_gemms


@pytest.fixture(scope="module")
def mid():
    return Decider.from_release(mid_release(), device="cpu", progress=False, chunk_size=128)


def test_every_variant_decides_alike(mid):
    """The same records under each variant: probabilities within fp32 rounding of each other, and the
    self-check passes under each and names the variant it checked."""
    from clef_cuda.serving.selfcheck import run_selfcheck

    records = [mid.encode(random_request(random.Random(seed), state_words=(200, 400))) for seed in range(3)]
    by_isa = {}
    for isa in ops.supported_cpu_isas():
        with ops.using_cpu_isa(isa):
            by_isa[isa] = [mid.probabilities(r) for r in records]
            report = run_selfcheck(mid.trunk)
            assert report.passed and report.cpu_isa == isa and f"({isa} kernels)" in report.summary(), report.table()
    best = by_isa[ops.supported_cpu_isas()[0]]
    for isa, probabilities in by_isa.items():
        worst = max(
            abs(a - b)
            for ours, theirs in zip(probabilities, best, strict=True)
            for x, y in zip(ours, theirs, strict=True)
            for a, b in zip(x, y, strict=True)
        )
        assert worst < CROSS_VARIANT_BOUND, (isa, worst)
