"""Every CUDA kernel compiles for every GPU generation we serve, sm_60 (P100) to sm_100 (B200) and sm_120
(RTX 50x0), with CUDA 12.9's NVRTC (scripts/check_archs.py): no spills, ptxas' figures within each arch's
limits, no more named barriers than a kernel names, a paged-attention tile for every head dim within the
arch's shared memory per block (tensor-core ones, v1's and v2's, from sm_70, the D = 256 ones on a T4 in
64 KB), the chunked delta rule's passes within it from sm_70, and the limit checks themselves shown to fail on
kernels over them."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def check_archs_module():
    spec = importlib.util.spec_from_file_location("check_archs", ROOT / "scripts" / "check_archs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@functools.cache
def report(arch: str):
    module = check_archs_module()
    try:
        return module.check(str(ROOT / ".cache" / "nvrtc12"), arch)
    except FileNotFoundError as missing:
        pytest.fail(f"the NVRTC 12.9 oracle is missing ({missing}); scripts/setup_env.sh puts it in .cache/nvrtc12")


ARCHS = ("sm_60", "sm_61", "sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")


def test_the_arch_table_is_the_headers_and_covers_blackwell():
    """check_archs reads each arch's shared memory from csrc/common/arch_limits.h (the simulator's table too):
    Blackwell's B200 has H100's 227 KB a block, the RTX 50x0 an RTX 40x0's 99 KB."""
    table = check_archs_module().ARCHS
    assert tuple(table) == ARCHS
    assert table["sm_100"][0] == table["sm_90"][0] == 227 * 1024
    assert table["sm_120"][0] == table["sm_89"][0] == 99 * 1024
    assert table["sm_75"][0] == 64 * 1024 and table["sm_61"][0] == 48 * 1024


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles_within_the_arch_limits_without_spills(arch):
    result = report(arch)
    assert not result.failures, "\n".join(result.failures)
    for kernel in result.kernels:
        assert kernel.threads is not None and kernel.spill_bytes == 0, kernel
        assert kernel.registers <= 255 and kernel.registers * kernel.threads <= 65536, kernel
        assert kernel.static_smem <= 48 * 1024, kernel


def tiles(arch: str) -> dict[tuple[str, int], tuple[int, int]]:
    return {(t.kernel, t.head_dim): (t.keys, t.bytes) for t in report(arch).tiles}


def test_each_card_gets_the_tiles_its_shared_memory_holds():
    """D = 256 (clef-flash): the 32-key tensor-core tile (75.75 KB) where the opt-in allows it, the
    16-key one (55 KB) in a T4's 64 KB; the SIMT kernel's 8-key tile (33.6 KB) in Pascal's 48 KB."""
    assert tiles("sm_75")[("wmma", 256)] == (16, 56320)
    for arch in ("sm_70", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120"):
        assert tiles(arch)[("wmma", 256)] == (32, 77568), arch
    for arch in ARCHS:
        limit = check_archs_module().ARCHS[arch][0]
        simt = tiles(arch)[("simt", 256)]
        assert simt == ((8, 33568) if limit == 48 * 1024 else (16, 50560)), arch
        assert all(size <= limit for _, size in tiles(arch).values()), arch
        for d in (64, 128):
            assert tiles(arch)[("wmma", d)][1] <= 48 * 1024  # no opt-in needed anywhere


def test_the_tensor_core_kernels_do_not_spill_where_they_run():
    """Eight tensor-core instantiations (f16, bf16 x D = 64, 128, 256 x32, 256 x16), 128 threads; below sm_70
    (and bf16 below sm_80) they compile to a trap the launcher never reaches."""
    for arch in ("sm_70", "sm_75", "sm_90"):
        wmma = {k.name: k for k in report(arch).kernels if "paged_attention_wmma_kernel" in k.name}
        assert len(wmma) == 8, sorted(wmma)
        for kernel in wmma.values():
            assert kernel.threads == 128 and kernel.spill_bytes == 0, kernel
        f16 = [k for name, k in wmma.items() if "__half" in name]
        assert all(k.registers > 32 for k in f16), f16  # real tensor-core code, not a trap
    assert all(k.registers < 16 for k in report("sm_60").kernels if "paged_attention_wmma_kernel" in k.name)


def test_tensor_core_v2_fits_every_tensor_core_card_without_spills():
    """v2 (kernel="wmma2", 256 threads): at D = 256 the 32-key tile (86 KB) where the opt-in allows it and
    the 16-key one (61.25 KB) in a T4's 64 KB; eight instantiations and two combine kernels, no spills; below
    sm_70 (and bf16 below sm_80) a trap the launcher never reaches."""
    assert tiles("sm_75")[("wmma2", 256)] == (16, 62720)
    for arch in ("sm_70", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120"):
        assert tiles(arch)[("wmma2", 256)] == (32, 88064), arch
    for arch in ("sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90"):
        assert tiles(arch)[("wmma2", 64)][0] == 32 and tiles(arch)[("wmma2", 128)][0] == 32, arch
    for arch in ("sm_70", "sm_75", "sm_90"):
        v2 = {k.name: k for k in report(arch).kernels if "paged_attention_wmma2_kernel" in k.name}
        assert len(v2) == 8, sorted(v2)
        for kernel in v2.values():
            assert kernel.threads == 256 and kernel.spill_bytes == 0, kernel
        assert all(k.registers > 32 for name, k in v2.items() if "__half" in name)  # real tensor-core code
        combine = [k for k in report(arch).kernels if "paged_attention_split_combine_kernel" in k.name]
        assert len(combine) == 2 and all(k.spill_bytes == 0 for k in combine), combine
    assert all(k.registers < 16 for k in report("sm_60").kernels if "paged_attention_wmma2_kernel" in k.name)


def trap_below_sm80(kernel: str) -> bool:
    """A bf16 pass, or a state pass fetching with cp.async (its last template argument): sm_80's only."""
    return "bfloat16" in kernel or kernel.replace(" ", "").endswith("true,true>")


def test_the_chunked_delta_rule_fits_every_tensor_core_arch():
    """clef-flash's head dim: the output pass takes the whole head where 84 KB fits (V100's 96 KB and up) and
    half of it on a T4's 64 KB; some state-pass variant fits every tensor-core arch, the 64-column staged one
    (75 KB) from a V100's 96 KB on, the 128-column direct one (56 KB) on a T4; the f16 passes are real
    tensor-core code on sm_70+, the bf16 ones and the state pass's cp.async fetches a trap below sm_80 (the
    dispatch rule keeps bf16 there on the serial kernel, the launcher runs the register fetches), nothing
    spills."""
    module = check_archs_module()
    for arch in ("sm_70", "sm_75", "sm_80", "sm_86", "sm_90", "sm_120"):
        limit = module.ARCHS[arch][0]
        by_dim = {t.head_dim: t for t in report(arch).delta_rule}
        assert set(by_dim) == {16, 32, 64, 128} and all(t.fits(limit) for t in by_dim.values()), arch
        assert by_dim[128].output_columns == (64 if arch == "sm_75" else 128), arch
        assert (by_dim[128].state_bytes["s64"] > 0) == (arch != "sm_75") and by_dim[128].state_bytes["d128"] > 0
        chunked = [
            k
            for k in report(arch).kernels
            if k.name.split("(")[0]
            .split("<")[0]
            .endswith(("gdr_chunk_prepare_kernel", "gdr_chunk_state_kernel", "gdr_chunk_output_kernel"))
        ]
        # per dtype: 4 prepare passes, 21 state passes (module.GDR_STATE_INSTANCES), 5 output passes
        assert len(module.GDR_STATE_INSTANCES) == 21
        assert len(chunked) == 2 * (4 + 21 + 5) and all(k.spill_bytes == 0 and k.threads == 128 for k in chunked)
        traps = [trap_below_sm80(k.name.split("(")[0]) and arch in ("sm_70", "sm_75") for k in chunked]
        assert all(k.registers > 32 for k, trap in zip(chunked, traps, strict=True) if not trap), arch
        assert all(k.registers < 16 for k, trap in zip(chunked, traps, strict=True) if trap), arch
    # below sm_70 the token-serial kernel runs: nothing to fit, nothing failed
    assert not report("sm_61").failures
    # the fit check itself: a head dim whose passes exceed the limit does not fit
    assert not module.DeltaRuleTiles(128, 59904, 64, 59776, {"s32": 60800}).fits(48 * 1024)
    assert not module.DeltaRuleTiles(128, 59904, 64, 59776, {"s16": 0, "d128": 0}).fits(227 * 1024)
    assert module.DeltaRuleTiles(128, 59904, 64, 59776, {"s64": 0, "d128": 57728}).fits(64 * 1024)
