"""The on-device self-check sees every fault the op tests see: each test-only fault of the CUDA kernels
(tests/kernel_faults.py, every CLEF_FAULT point in csrc/), switched on in the simulator on the card it shows on,
fails the op tests' own cases and the self-check the server runs (clef_cuda.verification.selfcheck.run_selfcheck),
which passes with it off. The self-check runs at clef-flash's per-head shapes (the delta net's 2 value heads a key
head x 128, attention's GQA 4 x 256), int8 weights, f16: the variants, tiles and tensor-core paths a card takes at
clef-flash's shapes. benchmarks/selfcheck_power.py prints the same as a table, with the autotune's checks."""

from __future__ import annotations

import pytest
import torch
from conftest import simulated, simulated_cards
from kernel_faults import BY_NAME, FAULTS, fault_points, op_tests_catch

from clef_cuda.verification.selfcheck import run_selfcheck


def test_every_fault_point_in_the_kernels_is_in_the_table():
    """A CLEF_FAULT point added to csrc/ without its row here would never meet the self-check."""
    assert fault_points() == set(BY_NAME)
    assert len(FAULTS) >= 25


def outputs_with_and_without(fault, sim_ops, claimed) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The op's outputs (`claimed`'s outputs function, on its inputs) with `fault` off and on, on the fault's
    simulated device, the finite check off (what a GPU would give)."""
    with simulated(compute_capability=fault.compute_capability, finite_check=False):
        healthy = claimed.outputs(sim_ops)
        with simulated(fault=fault.name):
            faulty = claimed.outputs(sim_ops)
    return healthy, faulty


@pytest.mark.parametrize("fault", [f for f in FAULTS if not f.reaches_outputs], ids=lambda f: f.name)
def test_a_fault_left_out_of_the_count_leaves_every_output_bit_identical(sim_ops, fault):
    """reaches_outputs=False takes a fault out of the self-check's count (benchmarks/selfcheck_power.py's M): only
    once the op's outputs on the op tests' inputs are bit-identical with it on (its damage stays in rows nothing
    reads). A fault marked so whose outputs differ fails here."""
    assert fault.outputs is not None, f"{fault.name} claims reaches_outputs=False without an outputs function"
    healthy, faulty = outputs_with_and_without(fault, sim_ops, fault)
    assert len(healthy) == len(faulty) > 0
    assert all(torch.equal(a, b) for a, b in zip(healthy, faulty, strict=True)), f"{fault.name} reaches an output"


def test_the_bit_identity_check_sees_a_fault_that_reaches_the_outputs(sim_ops):
    """The same comparison on a fault of the same kernel that does reach its outputs (the far tiles of P dropped)
    finds a difference: it can fail."""
    padding = BY_NAME["gdr_padding_rows_g_zero"]
    healthy, faulty = outputs_with_and_without(BY_NAME["gdr_p_far_tiles_zeroed"], sim_ops, padding)
    assert not all(torch.equal(a, b) for a, b in zip(healthy, faulty, strict=True))


@pytest.fixture(scope="module")
def flash_heads(sim_ops):
    """A trunk with clef-flash's per-head shapes, int8 weights, f16, on the simulator's kernels."""
    from releases import flash_heads_release

    from clef_cuda import Decider

    decider = Decider.from_release(
        flash_heads_release(), device="cpu", dtype=torch.float16, progress=False, quantize="int8"
    )
    return decider.trunk.with_ops(sim_ops)


_HEALTHY_ON: set[int] = set()


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_the_op_tests_and_the_selfcheck_catch_each_fault(sim_ops, flash_heads, fault):
    card, sms = simulated_cards()[fault.compute_capability]
    assert op_tests_catch(fault, sim_ops), f"the op tests' cases miss {fault.name} ({fault.what})"
    if not fault.reaches_outputs:
        return  # its damage stays in rows no output reads: the simulator's finite check (the op tests) sees it
    config = flash_heads.config
    band = (config.key_dim, 2 * config.key_dim) if fault.key_band else None
    with simulated(compute_capability=fault.compute_capability, multiprocessors=sms):
        if fault.compute_capability not in _HEALTHY_ON:
            report = run_selfcheck(flash_heads)
            assert report.passed, f"healthy kernels on a simulated {card}:\n{report.table()}"
            _HEALTHY_ON.add(fault.compute_capability)
        with simulated(fault=fault.name, fault_band=band, finite_check=False):
            report = run_selfcheck(flash_heads)
    assert not report.passed, f"the self-check misses {fault.name} ({fault.what}) on a simulated {card}"
    assert {c.name.split(".")[0] for c in report.failures} <= KERNEL_CHECKS[fault.kernel], report.summary()


# The self-check's checks a fault in each kernel may fail (its op's checks, and the real layers that ran it).
KERNEL_CHECKS = {
    "causal_conv1d_fwd:cuda": {"causal_conv1d_fwd", "causal_conv1d_update", "layer0"},  # one kernel runs both
    "gated_delta_rule_chunk:chunked": {"gated_delta_rule_chunk", "layer0"},
    "paged_attention:wmma": {"paged_attention", "layer1"},
    "paged_attention:wmma2": {"paged_attention"},
    "add_rms_norm:cuda": {"glue", "layer0", "layer1"},
    "silu_mul:cuda": {"glue"},
    "gated_rms_norm:cuda": {"glue", "layer0"},
    "rms_norm_rope:cuda": {"glue", "layer1"},
    "sigmoid_gate:cuda": {"glue", "layer1"},
    "dequantize_int8:cuda": {"dequantize_int8", "int8_linear", "layer0", "layer1"},
    "int8_linear:cuda": {"int8_linear", "layer0", "layer1"},
}
