"""The on-device self-check (clef_cuda.verification.selfcheck): it passes on healthy kernels for every test release,
dtype and the simulator's CUDA kernels, and every check fails against a fault injected into its op (the
seed's zeroed key band by name, unwritten outputs, reads outside the context, a kernel that raises). The
server keeps /ready at 503 and refuses decisions while it fails; --selfcheck warn and off; metrics; the
--selfcheck-only exit codes."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import simulated
from fastapi.testclient import TestClient
from faults import KeyBandZeroedOps, OpFault
from prometheus_client.parser import text_string_to_metric_families
from releases import mid_release, tiny_release

from app.server import ServerSettings, create_app
from clef_cuda import Decider
from clef_cuda.model.default_model import default_release
from clef_cuda.serving.engine import Engine, EngineConfig
from clef_cuda.verification.selfcheck import SelfCheckCases, run_selfcheck

ROOT = Path(__file__).resolve().parents[1]
OK = {"model": "clef-flash", "state": "Checkout fails for everyone.", "questions": {"outage": {"type": "noul"}}}
RELEASES = {"clef-tiny": default_release, "upstream-tiny": tiny_release, "mid": mid_release}


def load(release: str, dtype=torch.float32, ops=None, quantize="none") -> Decider:
    path = RELEASES[release]()
    return Decider.from_release(path, device="cpu", dtype=dtype, progress=False, ops=ops, quantize=quantize)


@pytest.fixture(scope="module")
def mid():
    return load("mid")


def failed(report) -> set[str]:
    return {c.name for c in report.failures}


# ---- healthy ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("release", sorted(RELEASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
def test_healthy_kernels_pass_at_every_release_and_dtype(release, dtype):
    report = run_selfcheck(load(release, dtype).trunk)
    assert report.passed, report.table()
    names = {c.name for c in report.checks}
    assert {"causal_conv1d_fwd.q", "causal_conv1d_fwd.k", "causal_conv1d_fwd.v", "causal_conv1d_update"} <= names
    assert {"gated_delta_rule_chunk", "gated_delta_rule_recurrent", "reshape_and_cache"} <= names
    assert {"paged_attention.prefix+chunk", "paged_attention.prefill", "paged_attention.decode"} <= names
    assert "paged_attention.decode_pack" in names
    assert any(n.endswith(".delta_net") for n in names) and any(n.endswith(".attention") for n in names)
    assert report.device == "cpu" and report.dtype == str(dtype).removeprefix("torch.")
    assert all(c.tolerance > 0 for c in report.checks if c.name != "reshape_and_cache")
    json.dumps(report.to_json(), allow_nan=False)  # /ready's body is strict JSON


INT8_CHECKS = {"dequantize_int8.layer0.out_proj", "dequantize_int8.embed_rows"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
def test_int8_weights_add_their_checks_and_pass(dtype):
    report = run_selfcheck(load("mid", dtype, quantize="int8").trunk)
    assert report.passed, report.table()
    assert INT8_CHECKS <= {c.name for c in report.checks}
    assert all(c.tolerance == 0.0 for c in report.checks if c.name in INT8_CHECKS)  # exact
    assert not INT8_CHECKS & {c.name for c in run_selfcheck(load("mid", dtype).trunk).checks}


def _last_row_scaled_by_the_first(original, qweight, scale, **kwargs):
    scale = scale.clone()
    scale[-1] = scale[0]
    return original(qweight, scale, **kwargs)


def test_a_wrong_scale_row_in_the_dequant_fails_the_self_check(sim_ops):
    """On the CPU (a faulty op library) and in the CUDA kernel (its test-only fault in the simulator):
    the dequant checks fail, and so do the real int8 layers that ran through it."""
    decider = load("mid", quantize="int8")
    faulty = failed(run_selfcheck(decider.trunk.with_ops(OpFault("dequantize_int8", _last_row_scaled_by_the_first))))
    assert INT8_CHECKS <= faulty and any(n.endswith(".delta_net") for n in faulty), faulty
    simulated_trunk = load("upstream-tiny", quantize="int8").trunk.with_ops(sim_ops)
    assert run_selfcheck(simulated_trunk).passed
    with simulated(fault="dequantize_wrong_scale_row"):
        assert INT8_CHECKS <= failed(run_selfcheck(simulated_trunk))


def test_the_cuda_kernels_pass_in_the_simulator(sim_ops):
    """The unmodified CUDA kernels (the test-suite's simulator) at the upstream tiny release's shapes."""
    decider = load("upstream-tiny")
    report = run_selfcheck(decider.trunk.with_ops(sim_ops))
    assert report.passed, report.table()


@pytest.mark.parametrize("cc", [70, 75], ids=["V100", "T4"])
def test_the_attention_checks_guard_the_tensor_core_kernel(sim_ops, cc):
    cases = ("prefix+chunk", "prefill", "decode")
    """At clef-flash's attention shapes (16 / 4 heads x 256) in f16 on a simulated V100 and T4 (its 64 KB
    tile), the self-check's attention group runs the dispatch rule's kernels (the tensor-core one for its mixed
    pack, the SIMT one for its decode pack) and then each kernel the autotune may choose, forced: it passes, and
    with the tensor-core kernel's causal mask skipped (a test-only fault) exactly the checks that kernel served
    with more than one new token fail, under the rule and forced. (The test releases' head dim is 32, which the
    tensor-core kernels do not tile, so the group runs on a stand-in trunk with clef-flash's shapes.)"""
    flash = SimpleNamespace(num_attention_heads=16, num_key_value_heads=4, head_dim=256)

    def failing() -> set[str]:
        checks = SelfCheckCases(sim_ops, flash, torch.float16, torch.device("cpu"), 16, 0).paged_attention()
        names = {c.name for c in checks}
        assert names >= {"paged_attention.prefix+chunk", "paged_attention.decode_pack"}
        assert names >= {f"paged_attention.{k}.{case}" for k in ("simt", "wmma", "wmma2") for case in cases}
        return {c.name for c in checks if not c.passed}

    with simulated(compute_capability=cc):
        assert failing() == set()
        with simulated(fault="wmma_skip_causal_mask"):
            served = ("paged_attention", "paged_attention.wmma")
            assert failing() == {f"{kernel}.{case}" for kernel in served for case in ("prefix+chunk", "prefill")}


# ---- injected faults -------------------------------------------------------------------------------
def _scratch_then_copy_all_but_last_row(original, *args, out=None, **kwargs):
    scratch = original(*args, **kwargs)
    out[:-1] = scratch[:-1]  # the last row is never written
    return out


def _keep_states(original, x, weight, bias, conv_states, *args, **kwargs):
    saved = conv_states.clone()
    out = original(x, weight, bias, conv_states, *args, **kwargs)
    conv_states.copy_(saved)
    return out


def _fresh(original, *args, **kwargs):
    *head, has_initial = args
    return original(*head, torch.zeros_like(has_initial), **kwargs)


def _wrong_scale(original, q, *args, factor=1.01, **kwargs):
    return original(q, *args, scale=factor * q.shape[-1] ** -0.5, **kwargs)


def _skip_a_token(original, key, value, key_cache, value_cache, slot_mapping):
    slot_mapping = slot_mapping.clone()
    slot_mapping[0] = -1
    return original(key, value, key_cache, value_cache, slot_mapping)


def _reads_past_the_context(original, query, key_cache, value_cache, cu_seqlens, context_lens, *args, **kwargs):
    return original(query, key_cache, value_cache, cu_seqlens, context_lens + 1, *args, **kwargs)


def _wrong_block(original, query, key_cache, value_cache, cu_seqlens, context_lens, block_tables, **kwargs):
    return original(query, key_cache, value_cache, cu_seqlens, context_lens, block_tables.roll(1, dims=1), **kwargs)


def _softmax_scale(original, query, *args, **kwargs):
    return original(query, *args, scale=1.01 * query.shape[-1] ** -0.5, **kwargs)


def _raises(original, *args, **kwargs):
    raise RuntimeError("CUDA error: no kernel image is available for execution on the device")


def _residual_not_kept(original, x, *args, **kwargs):
    return original(x.clone(), *args, **kwargs)


def _gate_and_up_swapped(original, gate_up, **kwargs):
    return original(gate_up.roll(gate_up.shape[1] // 2, dims=1), **kwargs)


def _gate_reversed(original, core, z, *args, **kwargs):
    return original(core, z.flip(-1), *args, **kwargs)


def _rope_backwards(original, x, scale, cos, sin, *args, **kwargs):
    return original(x, scale, cos, -sin, *args, **kwargs)


def _next_heads_gate(original, attn, gate, **kwargs):
    return original(attn, gate.roll(1, dims=1), **kwargs)


FAULTS = {
    # name: (op, broken, checks that must fail)
    "residual stream not updated": ("add_rms_norm", _residual_not_kept, {"glue.add_rms_norm.residual"}),
    "gate and up swapped": ("silu_mul", _gate_and_up_swapped, {"glue.silu_mul"}),
    "delta net gate misread": ("gated_rms_norm", _gate_reversed, {"glue.gated_rms_norm"}),
    "rope turns backwards": ("rms_norm_rope", _rope_backwards, {"glue.rms_norm_rope"}),
    "attention gate of the next head": ("sigmoid_gate", _next_heads_gate, {"glue.sigmoid_gate"}),
    "conv ignores the history": (
        "causal_conv1d_fwd",
        _fresh,
        {"causal_conv1d_fwd.q", "causal_conv1d_fwd.k", "causal_conv1d_fwd.v"},
    ),
    "conv leaves a row unwritten": (
        "causal_conv1d_fwd",
        _scratch_then_copy_all_but_last_row,
        {"causal_conv1d_fwd.q", "causal_conv1d_fwd.k", "causal_conv1d_fwd.v"},
    ),
    "conv update forgets its state": ("causal_conv1d_update", _keep_states, {"causal_conv1d_update.conv_states"}),
    "delta rule drops initial states": (
        "gated_delta_rule_chunk",
        _fresh,
        {"gated_delta_rule_chunk", "gated_delta_rule_chunk.states"},
    ),
    "decode step scales q wrongly": ("gated_delta_rule_recurrent", _wrong_scale, {"gated_delta_rule_recurrent"}),
    "cache write skips a token": ("reshape_and_cache", _skip_a_token, {"reshape_and_cache"}),
    "attention softmax scale off by 1%": (
        "paged_attention",
        _softmax_scale,
        {"paged_attention.prefix+chunk", "paged_attention.prefill", "paged_attention.decode"},
    ),
    "attention reads past the context": (
        "paged_attention",
        _reads_past_the_context,
        {"paged_attention.prefix+chunk", "paged_attention.prefill", "paged_attention.decode"},
    ),
    "attention reads the wrong blocks": (
        "paged_attention",
        _wrong_block,
        {"paged_attention.prefix+chunk", "paged_attention.prefill", "paged_attention.decode"},
    ),
    "attention kernel raises": ("paged_attention", _raises, {"paged_attention"}),
}


def test_the_seeds_zeroed_key_band_fails_by_name(mid):
    faulty = load("mid", ops=KeyBandZeroedOps(mid.config.trunk.key_dim))
    report = run_selfcheck(faulty.trunk)
    assert not report.passed
    assert failed(report) == {"causal_conv1d_fwd.k", f"layer{mid.config.trunk.linear_layers[0]}.delta_net"}
    assert "causal_conv1d_fwd.k" in report.summary() and "FAIL" in report.table()


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_check_fails_against_a_fault_in_its_op(mid, fault):
    op, broken, must_fail = FAULTS[fault]
    report = run_selfcheck(mid.trunk.with_ops(OpFault(op, broken)))
    assert must_fail <= failed(report), report.table()
    if fault == "attention kernel raises":
        (check,) = [c for c in report.checks if c.name == "paged_attention"]
        assert "no kernel image" in check.error and "no kernel image" in report.summary()
    json.dumps(report.to_json(), allow_nan=False)


@pytest.mark.parametrize("dtype, error", [(torch.float16, 0.01), (torch.bfloat16, 0.03)], ids=["f16", "bf16"])
def test_the_reduced_precision_tolerances_still_catch_a_small_fault(dtype, error):
    """A scale error of 1% in the decode step is caught in f16, 3% in bf16 (rtol: 2 ulps of the dtype)."""
    decider = load("mid", dtype)
    fault = OpFault("gated_delta_rule_recurrent", functools.partial(_wrong_scale, factor=1 + error))
    assert "gated_delta_rule_recurrent" in failed(run_selfcheck(decider.trunk.with_ops(fault)))


# ---- the server ------------------------------------------------------------------------------------
def _engine(decider: Decider) -> Engine:
    return Engine(decider, EngineConfig(max_model_len=2048, kv_fraction=0.02))


def _selfcheck_metrics(client) -> dict[tuple[str, str], float]:
    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name.startswith("clef_selfcheck"):
                out[(sample.name, sample.labels.get("check", ""))] = sample.value
    return out


def test_a_healthy_server_reports_its_selfcheck(mid):
    with TestClient(create_app(ServerSettings(), engine=_engine(mid))) as client:
        ready = client.get("/ready")
        assert ready.status_code == 200
        body = ready.json()
        assert body["status"] == "ready" and body["selfcheck"]["passed"] is True
        assert body["selfcheck"]["device"] == "cpu" and body["selfcheck"]["dtype"] == "float32"
        checks = body["selfcheck"]["checks"]
        assert checks["causal_conv1d_fwd.k"]["max_abs_error"] <= checks["causal_conv1d_fwd.k"]["tolerance"]
        metrics = _selfcheck_metrics(client)
        assert metrics[("clef_selfcheck_passed", "")] == 1
        assert set(checks) == {c for name, c in metrics if name == "clef_selfcheck_max_abs_error"}
        assert client.post("/v1/systemone", json=OK).status_code == 200


def test_a_failed_selfcheck_keeps_the_server_unready_and_refuses_decisions(mid):
    faulty = load("mid", ops=KeyBandZeroedOps(mid.config.trunk.key_dim))
    with TestClient(create_app(ServerSettings(), engine=_engine(faulty))) as client:
        ready = client.get("/ready")
        assert ready.status_code == 503 and ready.headers["retry-after"]
        body = ready.json()
        assert body["status"] == "selfcheck_failed" and body["selfcheck"]["passed"] is False
        assert body["selfcheck"]["checks"]["causal_conv1d_fwd.k"]["passed"] is False
        assert body["selfcheck"]["checks"]["causal_conv1d_fwd.q"]["passed"] is True
        assert "causal_conv1d_fwd.k" in body["detail"]["message"]
        decision = client.post("/v1/systemone", json=OK)
        assert decision.status_code == 503 and decision.headers["retry-after"]
        detail = decision.json()["detail"]
        assert detail["error_type"] == "service_unavailable" and "causal_conv1d_fwd.k" in detail["message"]
        metrics = _selfcheck_metrics(client)
        assert metrics[("clef_selfcheck_passed", "")] == 0
        k = metrics[("clef_selfcheck_max_abs_error", "causal_conv1d_fwd.k")]
        assert k > metrics[("clef_selfcheck_tolerance", "causal_conv1d_fwd.k")]


def test_warn_serves_anyway_and_off_skips_it(mid):
    faulty = load("mid", ops=KeyBandZeroedOps(mid.config.trunk.key_dim))
    with TestClient(create_app(ServerSettings(selfcheck="warn"), engine=_engine(faulty))) as client:
        ready = client.get("/ready")
        assert ready.status_code == 200 and ready.json()["selfcheck"]["passed"] is False
        assert client.post("/v1/systemone", json=OK).status_code == 200
        assert _selfcheck_metrics(client)[("clef_selfcheck_passed", "")] == 0
    with TestClient(create_app(ServerSettings(selfcheck="off"), engine=_engine(faulty))) as client:
        ready = client.get("/ready")
        assert ready.status_code == 200 and ready.json()["status"] == "ready" and ready.json()["selfcheck"] is None
        assert _selfcheck_metrics(client) == {}  # absent, not a misleading 0


# ---- clef-serve --selfcheck-only --------------------------------------------------------------------
def _cli(*args: str, faulty: bool = False) -> subprocess.CompletedProcess:
    entry = [str(ROOT / "tests" / "faulty_clef_serve.py")] if faulty else ["-m", "app"]
    return subprocess.run(
        [sys.executable, *entry, *args], capture_output=True, text=True, timeout=300, cwd=ROOT, check=False
    )


def test_selfcheck_only_exit_codes(tmp_path):
    healthy = _cli("--selfcheck-only")  # the embedded default model
    assert healthy.returncode == 0, healthy.stderr
    assert "self-check passed" in healthy.stdout and "causal_conv1d_fwd.k" in healthy.stdout

    broken = _cli("--selfcheck-only", "--w", str(mid_release()), faulty=True)
    assert broken.returncode == 1, broken.stderr
    assert "FAILED" in broken.stdout and "causal_conv1d_fwd.k (max abs error" in broken.stdout

    (tmp_path / "config.json").write_text("{}")
    bad = _cli("--selfcheck-only", "--w", str(tmp_path))
    assert bad.returncode == 2 and "config.json" in bad.stderr
    assert _cli("--selfcheck-only", "--selfcheck", "off").returncode == 2
