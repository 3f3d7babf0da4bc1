"""The CPU kernels' instruction-set variants (csrc/common/cpu_kernel.h): which ones this machine runs, the
switch (clef_cuda.kernels.ops.set_cpu_isa, CLEF_CPU_ISA) and its errors, and decisions under every variant.

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

from clef_cuda import Decider
from clef_cuda.kernels import ops

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
    result = _python("from clef_cuda.kernels import ops; print(ops.cpu_isa())", "baseline")
    assert result.returncode == 0 and result.stdout.strip() == "baseline", result.stderr


# A decision in a fresh process: the per-variant call counters of every CPU kernel call it made.
DECIDE_AND_COUNT = """
import json, random, sys
sys.path.insert(0, sys.argv[2])
from random_requests import random_request
from clef_cuda import Decider
from clef_cuda.kernels import ops
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


# ---- the GEMMs' features (clef_cuda.kernels.cpu_features): what torch's oneDNN may use beside our kernels --------
# /proc/cpuinfo's first processor as three server CPUs and a desktop one print it (flags verbatim, wrapped here).
SAPPHIRE_RAPIDS_FLAGS = """fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush dts acpi mmx
fxsr sse sse2 ss ht tm pbe syscall nx pdpe1gb rdtscp lm constant_tsc art arch_perfmon pebs bts rep_good nopl xtopology
nonstop_tsc cpuid aperfmperf tsc_known_freq pni pclmulqdq dtes64 monitor ds_cpl vmx smx est tm2 ssse3 sdbg fma cx16
xtpr pdcm pcid dca sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand lahf_lm abm
3dnowprefetch cpuid_fault epb cat_l3 cat_l2 cdp_l3 invpcid_single intel_ppin cdp_l2 ssbd mba ibrs ibpb stibp
ibrs_enhanced tpr_shadow flexpriority ept vpid ept_ad fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid cqm rdt_a
avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb intel_pt avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec
xgetbv1 xsaves cqm_llc cqm_occup_llc cqm_mbm_total cqm_mbm_local split_lock_detect avx_vnni avx512_bf16 wbnoinvd
dtherm ida arat pln pts hfi vnmi avx512vbmi umip pku ospke waitpkg avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni
avx512_bitalg tme avx512_vpopcntdq la57 rdpid bus_lock_detect cldemote movdiri movdir64b enqcmd fsrm md_clear
serialize tsxldtrk pconfig arch_lbr ibt amx_bf16 avx512_fp16 amx_tile amx_int8 flush_l1d arch_capabilities"""
EPYC_GENOA_FLAGS = """fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2
ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid extd_apicid
tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx
f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw topoext cpuid_fault
vmmcall fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid avx512f avx512dq rdseed adx smap avx512ifma clflushopt
clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx512_bf16 clzero xsaveerptr arat avx512vbmi
umip avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid fsrm"""
EPYC_MILAN_FLAGS = """fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2
ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid extd_apicid
aperfmperf rapl pni pclmulqdq monitor ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand
lahf_lm cmp_legacy svm extapic cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw ibs skinit wdt tce topoext
perfctr_core perfctr_nb bpext perfctr_llc mwaitx cpb cat_l3 cdp_l3 invpcid_single hw_pstate ssbd mba ibrs ibpb stibp
vmmcall fsgsbase bmi1 avx2 smep bmi2 erms invpcid cqm rdt_a rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec
xgetbv1 xsaves cqm_llc cqm_occup_llc cqm_mbm_total cqm_mbm_local clzero irperf xsaveerptr rdpru wbnoinvd amd_ppin arat
npt lbrv svm_lock nrip_save tsc_scale vmcb_clean flushbyasid decodeassists pausefilter pfthreshold v_vmsave_vmload vgif
v_spec_ctrl umip pku ospke vaes vpclmulqdq rdpid overflow_recov succor smca fsrm"""
ALDER_LAKE_FLAGS = """fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush dts acpi mmx fxsr
sse sse2 ss ht tm pbe syscall nx pdpe1gb rdtscp lm constant_tsc art arch_perfmon pebs bts rep_good nopl xtopology
nonstop_tsc cpuid aperfmperf tsc_known_freq pni pclmulqdq dtes64 monitor ds_cpl vmx smx est tm2 ssse3 sdbg fma cx16
xtpr pdcm pcid sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand lahf_lm abm 3dnowprefetch
cpuid_fault epb ssbd ibrs ibpb stibp ibrs_enhanced tpr_shadow flexpriority ept vpid ept_ad fsgsbase tsc_adjust bmi1
avx2 smep bmi2 erms invpcid rdseed adx smap clflushopt clwb intel_pt sha_ni xsaveopt xsavec xgetbv1 xsaves
split_lock_detect avx_vnni dtherm ida arat pln pts hwp hwp_notify hwp_act_window hwp_epp hwp_pkg_req hfi vnmi umip pku
ospke waitpkg gfni vaes vpclmulqdq tme rdpid movdiri movdir64b fsrm md_clear serialize pconfig arch_lbr ibt flush_l1d
arch_capabilities"""
# No CPU sold has AMX without AVX512-BF16 and AVX512-VNNI (which come first in the features); Sapphire Rapids without
# them is the machine on which AMX alone is what oneDNN has.
AMX_ONLY_FLAGS = " ".join(
    f for f in SAPPHIRE_RAPIDS_FLAGS.split() if f not in ("avx512_bf16", "avx512_vnni", "avx_vnni")
)
MACHINES = {
    "sapphire rapids": ("Intel(R) Xeon(R) Platinum 8480+", SAPPHIRE_RAPIDS_FLAGS),
    "epyc genoa": ("AMD EPYC 9654 96-Core Processor", EPYC_GENOA_FLAGS),
    "epyc milan": ("AMD EPYC 7763 64-Core Processor", EPYC_MILAN_FLAGS),
    "alder lake": ("12th Gen Intel(R) Core(TM) i9-12900K", ALDER_LAKE_FLAGS),
    "amx only": ("Intel(R) Xeon(R) Platinum 8480+", AMX_ONLY_FLAGS),
}


def cpuinfo_text(model: str, flags: str) -> str:
    """/proc/cpuinfo with two processors: the first one's block as `model` with `flags`, a second one after the
    blank line with other fields (only the first is read)."""
    first = f"processor\t: 0\nvendor_id\t: x\nmodel name\t: {model}\nflags\t\t: {' '.join(flags.split())}\n"
    return first + "\nprocessor\t: 1\nmodel name\t: another\nflags\t\t: fpu sse2\n"


@pytest.fixture
def cpuinfo(tmp_path, monkeypatch):
    """use(machine): clef_cuda.kernels.cpu_features reads that machine's /proc/cpuinfo (a file of ours) from then on."""
    from clef_cuda.kernels import cpu_features

    def use(machine: str) -> None:
        path = tmp_path / "cpuinfo"
        path.write_text(cpuinfo_text(*MACHINES[machine]))
        monkeypatch.setattr(cpu_features, "CPUINFO", path)
        cpu_features.first_processor.cache_clear()

    yield use
    cpu_features.first_processor.cache_clear()


# machine, our kernels' ISA, ONEDNN_MAX_CPU_ISA (None: unset) -> (bf16 flag, int8 flag) the GEMMs may use, worked out
# by hand from each machine's flags: avx512_bf16 / amx_bf16 and avx512_vnni / amx_int8 need the AVX-512 level,
# avx_vnni the AVX2 level; oneDNN's cap allows VNNI from AVX2_VNNI / AVX512_CORE_VNNI up, bf16 from AVX512_CORE_BF16
# up (AMX only above that, at AVX512_CORE_AMX, which caps nothing here).
GEMM_FEATURES = [
    ("sapphire rapids", "avx512", None, ("avx512_bf16", "avx512_vnni")),
    ("sapphire rapids", "avx512", "AVX512_CORE_AMX", ("avx512_bf16", "avx512_vnni")),
    ("sapphire rapids", "avx512", "avx512_core_bf16", ("avx512_bf16", "avx512_vnni")),
    ("sapphire rapids", "avx512", "AVX512_CORE_VNNI", (None, "avx512_vnni")),
    ("sapphire rapids", "avx512", "AVX512_CORE", (None, None)),
    ("sapphire rapids", "avx512", "AVX2_VNNI", (None, "avx_vnni")),
    ("sapphire rapids", "avx2", None, (None, "avx_vnni")),
    ("sapphire rapids", "baseline", None, (None, None)),
    ("amx only", "avx512", None, ("amx_bf16", "amx_int8")),
    ("amx only", "avx512", "AVX512_CORE_AMX", ("amx_bf16", "amx_int8")),
    ("amx only", "avx512", "AVX512_CORE_BF16", (None, None)),
    ("amx only", "avx2", None, (None, None)),
    ("epyc genoa", "avx512", None, ("avx512_bf16", "avx512_vnni")),
    ("epyc genoa", "avx512", "AVX512_CORE_VNNI", (None, "avx512_vnni")),
    ("epyc genoa", "avx2", None, (None, None)),
    ("epyc milan", "avx512", None, (None, None)),
    ("epyc milan", "avx2", None, (None, None)),
    ("alder lake", "avx2", None, (None, "avx_vnni")),
    ("alder lake", "avx2", "AVX2", (None, None)),
    ("alder lake", "baseline", None, (None, None)),
]


@pytest.mark.parametrize(("machine", "isa", "onednn_cap", "expected"), GEMM_FEATURES)
def test_the_gemm_features_of_known_cpus(cpuinfo, monkeypatch, machine, isa, onednn_cap, expected):
    from clef_cuda.kernels.cpu_features import cpu_flags, cpu_gemm_features

    cpuinfo(machine)
    if onednn_cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", onednn_cap)
    assert "avx2" in cpu_flags()  # the first processor's flags line, split (the second has "fpu sse2")
    found = cpu_gemm_features(isa)
    assert (found.bf16, found.int8) == expected


def test_the_first_processor_names_the_model_and_describes_its_features(cpuinfo, monkeypatch):
    from clef_cuda.kernels.cpu_features import cpu_gemm_features, cpu_model

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    cpuinfo("amx only")
    assert cpu_model() == "Intel(R) Xeon(R) Platinum 8480+"
    assert cpu_gemm_features("avx512").describe() == "bf16 dot products (amx_bf16), int8 dot products (amx_int8)"
    cpuinfo("epyc milan")
    assert cpu_model() == "AMD EPYC 7763 64-Core Processor"
    assert cpu_gemm_features("avx2").describe() == "no bf16 dot products, no int8 dot products"


@pytest.mark.parametrize(
    ("machine", "pin", "expected"),
    [
        ("sapphire rapids", "avx2", (None, None)),  # AVX-VNNI is above oneDNN's AVX2 cap
        ("sapphire rapids", "baseline", (None, None)),
        ("alder lake", "avx2", (None, None)),
        ("amx only", "avx2", (None, None)),
        ("sapphire rapids", "avx512", ("avx512_bf16", "avx512_vnni")),  # no cap for the machine's best
    ],
)
def test_a_clef_cpu_isa_pin_caps_what_the_gemms_report(cpuinfo, monkeypatch, machine, pin, expected):
    """CLEF_CPU_ISA's caps (cap_library_gemms, as clef_cuda.kernels.ops.apply_cpu_isa_env sets them for the process) and
    the pinned kernel level together: what a CPU of that level would have."""
    from clef_cuda.kernels.cpu_features import cap_library_gemms, cpu_gemm_features

    cpuinfo(machine)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    environ: dict[str, str] = {}
    cap_library_gemms(pin, environ)
    assert environ.get("ONEDNN_MAX_CPU_ISA") == {"avx2": "AVX2", "baseline": "SSE41", "avx512": None}[pin]
    if "ONEDNN_MAX_CPU_ISA" in environ:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", environ["ONEDNN_MAX_CPU_ISA"])
    found = cpu_gemm_features(pin)
    assert (found.bf16, found.int8) == expected


def test_a_pinned_level_caps_the_libraries_unless_they_are_set():
    from clef_cuda.kernels.cpu_features import cap_library_gemms

    environ = {"MKL_ENABLE_INSTRUCTIONS": "AVX512"}
    assert cap_library_gemms("avx2", environ) == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert environ == {"MKL_ENABLE_INSTRUCTIONS": "AVX512", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert cap_library_gemms("avx512", {}) == {} and cap_library_gemms("auto", {}) == {}


def test_the_cpu_serves_f32_unless_told_and_says_what_bf16_does_there(monkeypatch):
    """f32 stays the CPU's default; the log line says bf16 is faster where the GEMMs have bf16 dot products and
    slower where they convert in software; bf16 is served where asked either way."""
    import torch

    from clef_cuda.decider import serving_dtype
    from clef_cuda.kernels import cpu_features

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


# Two GEMMs in a fresh process, oneDNN saying which code ran each (ONEDNN_VERBOSE): the bf16 linear a CPU serves
# --dtype bf16 with (oneDNN's bf16 matmul where oneDNN may use bf16 dot products, torch's own GEMM where not: then
# oneDNN prints nothing for it) and an f32 linear oneDNN runs at any cap (mkldnn_linear), so that every run shows
# the ISA oneDNN ran at.
GEMMS = """
import json, torch
from clef_cuda.kernels import ops
from clef_cuda.kernels.cpu_features import cpu_gemm_features
x, w = torch.randn(64, 64), torch.randn(64, 64)
torch.nn.functional.linear(x.bfloat16(), w.bfloat16())
torch._C._nn.mkldnn_linear(x.to_mkldnn(), w, None)
print(json.dumps({"isa": ops.cpu_isa(), "bf16": cpu_gemm_features(ops.cpu_isa()).bf16,
                  "onednn_bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported()}))
"""


def _onednn_run(pin: str) -> tuple[dict, str | None, list[tuple[str, str]]]:
    """GEMMS under CLEF_CPU_ISA=`pin` with ONEDNN_VERBOSE=1: its JSON line, the ISA oneDNN's verbose header names
    ("Intel AVX2", ...; None without one) and each matmul or inner product it ran as (implementation, its line)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")}
    run_env = env | {"ONEDNN_VERBOSE": "1", "CLEF_CPU_ISA": pin}
    result = subprocess.run([sys.executable, "-c", GEMMS], capture_output=True, text=True, env=run_env, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    isa = next((line.split("isa:", 1)[1] for line in lines if line.startswith("onednn_verbose,v1,info,cpu,isa:")), None)
    # onednn_verbose,v1,primitive,exec,cpu,<primitive>,<implementation>,...
    fields = [line.split(",") for line in lines if line.startswith("onednn_verbose,v1,primitive,exec,cpu,")]
    gemms = [(f[6], ",".join(f)) for f in fields if f[5] in ("matmul", "inner_product")]
    return json.loads(lines[-1]), isa, gemms


def test_the_pin_reaches_the_gemms():
    """CLEF_CPU_ISA=avx2 caps oneDNN too: oneDNN says it runs at AVX2 and runs the f32 GEMM with AVX2 code, it
    declines bf16 (so the bf16 GEMM is torch's own: no bf16 matmul line), and the features say no bf16 dot
    products. Unpinned on a CPU with them, oneDNN's AVX512-BF16 or AMX matmul runs the bf16 GEMM (the control).
    Each run must show oneDNN's GEMMs: a run without them (no verbose output, no oneDNN) proves nothing."""
    pinned, pinned_isa, pinned_gemms = _onednn_run("avx2")
    assert pinned == {"isa": "avx2", "bf16": None, "onednn_bf16": False}, pinned
    assert pinned_isa == "Intel AVX2", pinned_isa
    assert pinned_gemms, "oneDNN printed no matmul: the pinned run's GEMMs are unchecked"
    for implementation, line in pinned_gemms:
        assert implementation.endswith(":avx2") and "src:bf16" not in line, line
    free, free_isa, free_gemms = _onednn_run("")
    assert free_gemms, "oneDNN printed no matmul: the unpinned run's GEMMs are unchecked"
    if free["bf16"] is not None:
        assert free["onednn_bf16"] and free_isa != "Intel AVX2", (free, free_isa)
        bf16_gemms = [i for i, line in free_gemms if "src:bf16" in line]
        assert bf16_gemms and all("avx512_core_bf16" in i or "amx" in i for i in bf16_gemms), free_gemms


@pytest.fixture(scope="module")
def mid():
    return Decider.from_release(mid_release(), device="cpu", progress=False, chunk_size=128)


def test_every_variant_decides_alike(mid):
    """The same records under each variant: probabilities within fp32 rounding of each other, and the
    self-check passes under each and names the variant it checked."""
    from clef_cuda.verification.selfcheck import run_selfcheck

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
