"""Every CUDA kernel fits sm_70 (V100): compiled with CUDA 12.9's NVRTC by scripts/check_sm70.py, whose
ptxas figures are checked against compute capability 7.0's limits here, and the limit check itself is
shown to fail on kernels over them."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def check_sm70_module():
    spec = importlib.util.spec_from_file_location("check_sm70", ROOT / "scripts" / "check_sm70.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@functools.cache
def sm70_report():
    module = check_sm70_module()
    try:
        return module.check(str(ROOT / ".cache" / "nvrtc12"), "sm_70")
    except FileNotFoundError as missing:
        pytest.fail(f"the sm_70 oracle is missing ({missing}); scripts/setup_env.sh installs it into .cache/nvrtc12")


def test_every_kernel_compiles_for_sm70_within_its_limits():
    report = sm70_report()
    assert not report.failures, "\n".join(report.failures)
    for kernel in report.kernels:
        assert kernel.threads is not None, kernel.name
        assert kernel.registers <= 255 and kernel.registers * kernel.threads <= 65536, kernel
        assert kernel.static_smem <= 48 * 1024, kernel


def test_the_tensor_core_kernels_and_their_shared_memory():
    """Six tensor-core instantiations (f16, bf16 x D = 64, 128, 256), 128 threads, no spills in f16 (bf16
    compiles to a trap below sm_80); dynamic shared memory within the default 48 KB for D = 64 and 128,
    the 96 KB opt-in for D = 256."""
    report = sm70_report()
    wmma = {k.name: k for k in report.kernels if "paged_attention_wmma_kernel" in k.name}
    assert len(wmma) == 6, sorted(wmma)
    for kernel in wmma.values():
        assert kernel.threads == 128 and kernel.spill_bytes == 0, kernel
    limits = {c.config: c.limit for c in report.dynamic_smem if "wmma" in c.config}
    assert [limits[f"paged_attention_wmma_kernel<f16|bf16, {d}>"] for d in (64, 128, 256)] == [
        "48 KB default",
        "48 KB default",
        "96 KB opt-in (cudaFuncSetAttribute)",
    ]


def test_the_limit_check_fails_kernels_over_sm70s_limits():
    usage = check_sm70_module().KernelUsage
    assert not usage("fits", 255, 48 * 1024, 0, 256).violations()
    assert usage("too many registers per block", 168, 0, 0, 512).violations()
    assert usage("too many registers per thread", 256, 0, 0, 32).violations()
    assert usage("too much static shared memory", 32, 48 * 1024 + 1, 0, 128).violations()
    assert usage("no launch bounds", 32, 0, 0, None).violations()
