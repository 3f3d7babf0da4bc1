"""Shared fixtures: the op backends under test and the upstream oracles.

Backends: ``cpu-avx512``, ``cpu-avx2``, ``cpu-baseline`` (clef_cuda._C on CPU tensors, each CPU kernel
variant this machine can run: an AVX-512 machine tests the AVX2 code too), ``cuda`` (clef_cuda._C on the
GPU, where one exists and the extension was built with CUDA) and ``sim`` (the same CUDA kernels and
launchers, run on the CPU by the test-only simulator in tests/cuda_sim; small shapes only, every CUDA
thread a fiber on one core). ``backend.kind`` is "cpu", "cuda" or "sim", for shape tables.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FLA_NAIVE = ROOT / ".oracles" / "fla" / "fla" / "ops" / "gated_delta_rule" / "naive.py"


@dataclass
class Backend:
    name: str  # "cpu-avx2", "cuda", "sim"
    ops: object  # clef_cuda.kernels.ops.OpLibrary
    device: torch.device

    @property
    def kind(self) -> str:
        return self.name.split("-")[0]

    def __repr__(self) -> str:
        return self.name


# Under pytest-xdist (`make test` runs two workers) each worker gets its share of the cores, so the workers'
# torch thread pools do not fight over them; so do the processes a worker starts (clef-serve, kernel trials,
# training runs), through OMP_NUM_THREADS: a clef-serve with the whole pool beside the other worker served the
# 2,000-request load 16% slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    WORKER_THREADS = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    torch.set_num_threads(WORKER_THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(WORKER_THREADS))

# scripts/gpu_check.sh --dry-run collects the GPU cases on a machine without a GPU (pytest --collect-only,
# nothing runs) to check that the gate's selection names them: this makes the cuda backend appear.
ASSUME_CUDA = os.environ.get("CLEF_ASSUME_CUDA") == "1"


def cuda_available() -> bool:
    if ASSUME_CUDA:
        return True
    if not torch.cuda.is_available():
        return False
    import clef_cuda

    return clef_cuda.build_info()["variant"] == "cuda"


def pytest_configure(config):
    # Registered here as well as in pyproject.toml: the torch-floor run passes `-c /dev/null`.
    config.addinivalue_line("markers", "simulator: builds the CUDA simulator from csrc/ (tests/cuda_sim)")


def pytest_collection_modifyitems(config, items):
    """Every test that reaches the simulator, directly or through a parametrised backend, is marked
    `simulator`, so a run without the sources (scripts/torch_floor_check.sh) deselects it by marker
    instead of by a name that a new test might not carry."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        # a backend fixture parametrised "sim" fetches sim_ops at run time, so it is not in fixturenames
        params = callspec.params.values() if callspec is not None else ()
        uses_sim = "sim_ops" in item.fixturenames or any(isinstance(p, str) and p == "sim" for p in params)
        if uses_sim:
            item.add_marker(pytest.mark.simulator)
        # A case on the GPU (the cuda backend) is marked `cuda`, as GPU-only tests are by hand: the GPU check's
        # gate selects `-m cuda`, so no GPU case can hide behind a test id that does not say "cuda".
        if any(isinstance(p, str) and p == "cuda" for p in params):
            item.add_marker(pytest.mark.cuda)


@pytest.fixture(scope="session")
def sim_ops():
    sys.path.insert(0, str(ROOT / "tests" / "cuda_sim"))
    from build import load_cuda_sim

    return load_cuda_sim()


@contextlib.contextmanager
def simulated(
    compute_capability: int | None = None,
    fault: str | None = None,
    block_order: str | None = None,
    multiprocessors: int | None = None,
    fault_band: tuple[int, int] | None = None,
    finite_check: bool | None = None,
):
    """The simulator's device set to a compute capability (and SM count), with a test-only fault on (a band fault:
    over channels fault_band = [lo, hi)), and/or running a grid's blocks in another order ("first-last"; the
    default "last-first"); finite_check=False: the kernels' CLEF_CHECK_FINITE points off (judged only by what a
    GPU would show); then restored."""
    sim = torch.ops.clef_sim
    saved_cc = sim.set_compute_capability(compute_capability) if compute_capability else None
    saved_sms = sim.set_multiprocessor_count(multiprocessors) if multiprocessors else None
    saved_fault = sim.set_fault(fault) if fault else None
    saved_order = sim.set_block_order(block_order) if block_order else None
    saved_band = sim.set_fault_band(*fault_band) if fault_band else None
    saved_finite = sim.set_finite_check(finite_check) if finite_check is not None else None
    try:
        yield
    finally:
        if saved_finite is not None:
            sim.set_finite_check(saved_finite)
        if saved_band is not None:
            sim.set_fault_band(*saved_band)
        if saved_cc is not None:
            sim.set_compute_capability(saved_cc)
        if saved_sms is not None:
            sim.set_multiprocessor_count(saved_sms)
        if saved_fault is not None:
            sim.set_fault(saved_fault)
        if saved_order is not None:
            sim.set_block_order(saved_order)


def simulated_cards() -> dict[int, tuple[str, int]]:
    """Compute capability -> (a card of that arch, its SMs): csrc/common/arch_limits.h's table, through the
    simulator (call after sim_ops has loaded it)."""
    cards = {}
    for line in torch.ops.clef_sim.checked_archs():
        cc, card_sms = line.split(" ", 1)
        card, sms = card_sms.rsplit(" ", 1)
        cards[int(cc)] = (card, int(sms))
    return cards


def cpu_isas() -> list[str]:
    """The CPU kernel variants this machine runs (clef_cuda.kernels.ops.supported_cpu_isas), best first."""
    from clef_cuda.kernels import ops

    return ops.supported_cpu_isas()


CPU_BACKENDS = [f"cpu-{isa}" for isa in cpu_isas()]
BACKENDS = CPU_BACKENDS + ["sim"] + (["cuda"] if cuda_available() else [])


def _make_backend(request, name: str):
    """The backend `name`; a cpu-ISA one runs that variant for the test's duration (then restores)."""
    from clef_cuda.kernels import ops

    if name == "sim":
        yield Backend("sim", request.getfixturevalue("sim_ops"), torch.device("cpu"))
    elif name == "cuda":
        yield Backend("cuda", ops._default, torch.device("cuda"))
    else:
        with ops.using_cpu_isa(name.removeprefix("cpu-")):
            yield Backend(name, ops._default, torch.device("cpu"))


@pytest.fixture(params=BACKENDS)
def backend(request):
    yield from _make_backend(request, request.param)


@pytest.fixture(params=[b for b in BACKENDS if b != "sim"])
def fast_backend(request):
    """Backends that can take full-size shapes (the simulator cannot)."""
    yield from _make_backend(request, request.param)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double().cpu(), expected.double().cpu()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def load_fla_naive():
    """FLA's naive.py, loaded by file path (importing the fla package would make transformers route its
    Qwen3.5 fallbacks to FLA's Triton kernels, which do not run on the CPU)."""
    if not FLA_NAIVE.exists():
        pytest.fail(
            f"FLA oracle missing at {FLA_NAIVE}; install it with "
            "`pip install --no-deps --target .oracles/fla fla-core==0.6.0` (.ci/run does)"
        )
    spec = importlib.util.spec_from_file_location("fla_naive_oracle", FLA_NAIVE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def qwen35_module():
    """transformers' Qwen3.5 modelling code, checked to be using its pure-torch fallbacks."""
    if importlib.util.find_spec("fla") is not None or importlib.util.find_spec("causal_conv1d") is not None:
        pytest.fail("fla or causal_conv1d is importable: transformers would not use its torch fallbacks as oracles")
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5
