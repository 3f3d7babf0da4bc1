"""Every test-only fault of the CUDA kernels (the CLEF_FAULT points in csrc/), what it breaks, the simulated device
it shows on, and the op tests' cases that catch it: the table benchmarks/selfcheck_power.py runs the self-check
and the autotune's checks against, and tests/test_selfcheck_power.py keeps whole (a CLEF_FAULT point missing here
fails it).

Each `op_tests` runs the cases of the op's own tests (imported from them, not copied) on the simulator and raises
AssertionError or RuntimeError when they catch the fault (a wrong answer, a non-finite value, a deadlock, a
launch over the device's shared memory); it returns quietly when they do not.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from conftest import Backend, simulated

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class InjectedFault:
    name: str  # the CLEF_FAULT point
    kernel: str  # as failures name kernels: "op:kernel"
    what: str  # the bug, in words
    op_tests: Callable  # op_tests(sim_ops): raises when the op tests' cases catch it (see the module's doc)
    compute_capability: int = 80  # the simulated device it shows on
    key_band: bool = False  # a band fault: the band is the case's key band [key_dim, 2 key_dim)
    # False: its damage stays in rows no output is computed from (only the simulator's CLEF_CHECK_FINITE sees
    # it): no self-check can, on a GPU; benchmarks/selfcheck_power.py reports it apart from M. A claim, so it is
    # shown: `outputs` computes the op's outputs on the op tests' inputs, and tests/test_selfcheck_power.py
    # requires them bit-identical with the fault on and off (the finite check off) before the fault leaves M.
    reaches_outputs: bool = True
    outputs: Callable | None = None  # outputs(sim_ops) -> tensors, for a fault that claims reaches_outputs=False


def sim_backend(sim_ops) -> Backend:
    return Backend("sim", sim_ops, torch.device("cpu"))


# ---- the op tests' cases, by kernel ------------------------------------------------------------------------
def conv_bands(sim_ops) -> None:
    """tests/test_key_band.py's check of every band of the conv, at clef-flash's split (the band fault zeroes
    that split's key band)."""
    from test_key_band import SPLITS, check_conv_bands, with_key_dim

    key_dim, value_dim = SPLITS["sim"][0]
    with simulated(fault_band=(key_dim, 2 * key_dim)):
        check_conv_bands(with_key_dim(sim_ops.causal_conv1d_fwd), key_dim, value_dim, torch.device("cpu"))


def chunked_delta_rule(sim_ops) -> None:
    """tests/test_gated_delta_rule.py's chunked cases: 1..3 chunks with tails and several sequences in a pack, the
    gates' and betas' edges, and every state-pass variant at clef-flash's head dim."""
    from test_gated_delta_rule import CHUNKED_CASES, GATE_EDGES, check_chunked, check_state_variants

    backend = sim_backend(sim_ops)
    lengths, shapes = CHUNKED_CASES["sim"]
    for hk, hv, d in shapes:
        check_chunked(backend, lengths, hk, hv, d, torch.float16)
    for edge in GATE_EDGES.values():
        check_chunked(backend, [7, 140], 1, 2, 16, torch.float16, **edge)
    check_state_variants(backend, torch.float16)


def chunked_delta_rule_outputs(sim_ops) -> list[torch.Tensor]:
    """The chunked delta rule's outputs and final states on chunked_delta_rule's pack shapes (1..3 chunks, odd
    tails: padding rows in every last chunk), f16 and bf16, the same inputs each call (seeded)."""
    from test_gated_delta_rule import CHUNKED_CASES, make_inputs, nan_like

    lengths, shapes = CHUNKED_CASES["sim"]
    results = []
    for dtype in (torch.float16, torch.bfloat16):
        for hk, hv, d in [*shapes, (1, 2, 128)]:
            torch.manual_seed(0)
            q, k, v, g, beta, states, cu, slots, has_initial = make_inputs(lengths, hk, hv, d, d, dtype, "cpu")
            out = sim_ops.gated_delta_rule_chunk(
                q, k, v, g, beta, states, cu, slots, has_initial, out=nan_like(v.contiguous()), kernel="chunked"
            )
            results += [out, states]
    return results


def wmma_attention(sim_ops) -> None:
    """tests/test_paged_attention.py's tensor-core (v1) cases."""
    from test_paged_attention import WMMA_HEADS, WMMA_SEQUENCES, attention_failures

    failures = attention_failures(sim_backend(sim_ops), torch.float16, WMMA_HEADS["sim"], WMMA_SEQUENCES["sim"], "wmma")
    assert not failures, failures


def wmma2_attention(sim_ops) -> None:
    """tests/test_paged_attention_v2.py's cases: the whole grid and the split-context pass."""
    from test_paged_attention_v2 import split_failures, whole_grid_failures

    backend = sim_backend(sim_ops)
    failures = whole_grid_failures(backend) + split_failures(backend)
    assert not failures, failures


def attention_on_a_t4(sim_ops) -> None:
    """tests/test_paged_attention.py's every-card case on a T4: clef-flash's head dim in f16 (the launcher must
    pick the tile its 64 KB holds)."""
    from test_paged_attention import attention_failures

    backend = sim_backend(sim_ops)
    heads, sequences = [(4, 1, 256, 16)], [(9, 9), (20, 70)]
    failures = attention_failures(backend, torch.float16, heads, sequences)
    failures += attention_failures(backend, torch.float16, heads, sequences, kernel="wmma2")
    assert not failures, failures


def glue_op(fault: str) -> Callable:
    def run(sim_ops) -> None:
        """tests/test_glue.py's comparison for the fault's op."""
        from test_glue import FAULTS, close

        actual, expected = FAULTS[fault](sim_ops)
        assert close(actual, expected, torch.float32)[0], fault

    return run


def dequantize(sim_ops) -> None:
    """tests/test_quantize.py's exact comparison of dequantize_int8."""
    from test_quantize import random_int8

    from clef_cuda.kernels import reference

    q, scale = random_int8(5, 32, "cpu")
    assert torch.equal(sim_ops.dequantize_int8(q, scale), reference.dequantize_int8(q, scale))


def int8_linear(sim_ops) -> None:
    """tests/test_quantize.py's comparison of the fused W8A16 GEMM with the reference, a tile tail and several
    column tiles."""
    from test_quantize import int8_linear_case, linear_close

    from clef_cuda.kernels import reference

    for rows, features_in, features_out in ((3, 256, 64), (16, 300, 200)):
        x, q, scale = int8_linear_case(rows, features_in, features_out, torch.float32, "cpu")
        close, why = linear_close(sim_ops.int8_linear(x, q, scale), reference.int8_linear(x, q, scale), torch.float32)
        assert close, why


# ---- the faults ----------------------------------------------------------------------------------------------
FAULTS = [
    InjectedFault(
        "conv_channel_band_zeroed",
        "causal_conv1d_fwd:cuda",
        "the conv's key channel band zeroed (the seed's bug)",
        conv_bands,
        key_band=True,
    ),
    InjectedFault("gdr_w_without_decay", "gated_delta_rule_chunk:chunked", "W without its decay", chunked_delta_rule),
    InjectedFault(
        "gdr_skip_causal_mask", "gated_delta_rule_chunk:chunked", "the causal mask skipped in P", chunked_delta_rule
    ),
    InjectedFault(
        "gdr_state_not_carried",
        "gated_delta_rule_chunk:chunked",
        "the state not carried from chunk to chunk",
        chunked_delta_rule,
    ),
    InjectedFault(
        "gdr_w_rows_past_16_zeroed", "gated_delta_rule_chunk:chunked", "W's rows 16-63 zeroed", chunked_delta_rule
    ),
    InjectedFault(
        "gdr_qs_rows_past_16_zeroed",
        "gated_delta_rule_chunk:chunked",
        "the Q S term's rows 16-63 zeroed",
        chunked_delta_rule,
    ),
    InjectedFault(
        "gdr_p_far_tiles_zeroed",
        "gated_delta_rule_chunk:chunked",
        "P's tiles two or more 16-blocks below the diagonal zeroed",
        chunked_delta_rule,
    ),
    InjectedFault(
        "gdr_t_far_blocks_zeroed",
        "gated_delta_rule_chunk:chunked",
        "T's blocks two or more from the diagonal zeroed",
        chunked_delta_rule,
    ),
    InjectedFault(
        "gdr_drops_last_chunk_of_pack",
        "gated_delta_rule_chunk:chunked",
        "the state pass stops a chunk short in the pack's last sequence",
        chunked_delta_rule,
    ),
    InjectedFault(
        "gdr_cp_async_not_waited",
        "gated_delta_rule_chunk:chunked",
        "the staged state pass reads W and U before its cp.async lands (sm_80 on)",
        chunked_delta_rule,
    ),
    InjectedFault(
        "gdr_prefetch_lands_early",
        "gated_delta_rule_chunk:chunked",
        "the staged state pass stores the next W while this chunk's is read (registers, before sm_80)",
        chunked_delta_rule,
        compute_capability=70,
    ),
    InjectedFault(
        "gdr_padding_rows_g_zero",
        "gated_delta_rule_chunk:chunked",
        "the output pass's padding rows with G = 0: 0 x inf in P's rows past the last token",
        chunked_delta_rule,
        reaches_outputs=False,
        outputs=chunked_delta_rule_outputs,
    ),
    InjectedFault(
        "wmma_skip_causal_mask", "paged_attention:wmma", "the tensor-core kernel's causal mask skipped", wmma_attention
    ),
    InjectedFault("wmma_tile_offset", "paged_attention:wmma", "P V reads the wrong 16-key slice of V", wmma_attention),
    InjectedFault(
        "wmma_assumes_element_order",
        "paged_attention:wmma",
        "the rescale assumes a fragment's element order",
        wmma_attention,
    ),
    InjectedFault(
        "wmma_last_warp_rows_doubled", "paged_attention:wmma", "a tile's last warp's rows doubled", wmma_attention
    ),
    InjectedFault(
        "wmma2_swap_column_halves", "paged_attention:wmma2", "a pair's output column halves swapped", wmma2_attention
    ),
    InjectedFault(
        "wmma2_prefetch_one_tile_late",
        "paged_attention:wmma2",
        "the next K/V tile prefetched from the current offsets",
        wmma2_attention,
    ),
    InjectedFault(
        "wmma2_rescale_vote", "paged_attention:wmma2", "O rescaled only when every row's max rose", wmma2_attention
    ),
    InjectedFault(
        "wmma2_combine_wrong_max",
        "paged_attention:wmma2",
        "the split pass's combine weights every part by the first's max",
        wmma2_attention,
    ),
    InjectedFault(
        "wmma2_pair_barrier_count",
        "paged_attention:wmma2",
        "a pair's named barrier counts 128 threads (a deadlock)",
        wmma2_attention,
    ),
    InjectedFault(
        "wmma2_last_warp_rows_doubled",
        "paged_attention:wmma2",
        "a tile's last warp's rows (its half of the columns) doubled",
        wmma2_attention,
    ),
    InjectedFault(
        "attention_ignores_smem_limit",
        "paged_attention:wmma",
        "the attention tiles chosen without the device's shared memory (a T4)",
        attention_on_a_t4,
        compute_capability=75,
    ),
    InjectedFault(
        "glue_residual_not_kept",
        "add_rms_norm:cuda",
        "the residual not written back",
        glue_op("glue_residual_not_kept"),
    ),
    InjectedFault("glue_swapped_gate_up", "silu_mul:cuda", "gate and up swapped", glue_op("glue_swapped_gate_up")),
    InjectedFault(
        "glue_gate_skipped", "gated_rms_norm:cuda", "the norm's SiLU gate skipped", glue_op("glue_gate_skipped")
    ),
    InjectedFault(
        "glue_rope_backwards", "rms_norm_rope:cuda", "RoPE rotated backwards", glue_op("glue_rope_backwards")
    ),
    InjectedFault(
        "glue_rope_writes_before_reads",
        "rms_norm_rope:cuda",
        "in place, a rotated element written before its pair is read",
        glue_op("glue_rope_writes_before_reads"),
    ),
    InjectedFault(
        "glue_gate_of_next_head", "sigmoid_gate:cuda", "the next head's gate applied", glue_op("glue_gate_of_next_head")
    ),
    InjectedFault(
        "dequantize_wrong_scale_row", "dequantize_int8:cuda", "the last row scaled by the first's scale", dequantize
    ),
    InjectedFault(
        "int8_linear_drops_tile_tail", "int8_linear:cuda", "each 128-wide tile's last 4 products dropped", int8_linear
    ),
    InjectedFault(
        "int8_linear_column_tile_wrong_scale",
        "int8_linear:cuda",
        "one column tile scaled by its first column's scale",
        int8_linear,
    ),
]
BY_NAME = {f.name: f for f in FAULTS}


def fault_points() -> set[str]:
    """Every CLEF_FAULT point in csrc/ (the macro's own definition left out)."""
    names = set()
    for path in (ROOT / "csrc").rglob("*"):
        if path.suffix in (".h", ".cuh", ".cu", ".cpp"):
            names |= set(re.findall(r"CLEF_FAULT\(\s*([a-z0-9_]+)\s*,", path.read_text()))
    return names - {"name"}


_HEALTHY: set[tuple[Callable, int]] = set()  # (op tests, compute capability) seen passing without a fault


def op_tests_catch(fault: InjectedFault, sim_ops) -> bool:
    """Whether the op tests' cases catch `fault` on its simulated device (and pass without it: a case that fails
    healthy kernels proves nothing, so that raises; checked once a process per cases and device)."""
    with simulated(compute_capability=fault.compute_capability):
        if (fault.op_tests, fault.compute_capability) not in _HEALTHY:
            fault.op_tests(sim_ops)
            _HEALTHY.add((fault.op_tests, fault.compute_capability))
        try:
            with simulated(fault=fault.name):
                fault.op_tests(sim_ops)
        except (AssertionError, RuntimeError):
            return True
    return False
