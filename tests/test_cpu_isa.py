"""The CPU kernels' instruction-set variants (csrc/common/cpu_kernel.h): which ones this machine runs, the
switch (clef_cuda.ops.set_cpu_isa, CLEF_CPU_ISA) and its errors, and decisions under every variant.

The kernel tests run each op under every variant this machine can run (tests/conftest.py: the
cpu-avx512 / cpu-avx2 / cpu-baseline backends), so CI on an AVX-512 machine covers the AVX2 register
blocks too, and one on an AVX2 machine covers AVX2 and baseline."""

from __future__ import annotations

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
