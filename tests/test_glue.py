"""The trunk's fused glue ops (csrc/glue: residual add + RMSNorm, SiLU(gate) x up, the gated RMSNorm, q/k
RMSNorm + RoPE, the sigmoid gate) against clef_cuda.kernels.reference on awkward shapes (odd widths, one row,
strided views as the trunk passes them, a partial rotary dim, M-RoPE-like per-token angles), on every
backend: the CPU variants, the CUDA simulator and (when present) the GPU. Each CUDA kernel's test-only
fault fails these comparisons; the trunk with the fused ops answers as the one on the references."""

from __future__ import annotations

import pytest
import torch
from conftest import TOLERANCE, simulated

from clef_cuda.kernels import reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> tuple[bool, float]:
    """Within 2 ulps of the dtype (both sides round one fp32 result once) relative to the largest value."""
    worst = float((actual.float().cpu() - expected.float().cpu()).abs().max())
    return worst <= TOLERANCE[dtype] * max(float(expected.float().abs().max()), 1e-30), worst


def strided_tokens(n: int, heads: int, dim: int, extra: int, dtype, device) -> torch.Tensor:
    """[n, heads, dim] as a view into a wider [n, heads * dim + extra] buffer (the fused GEMM's output)."""
    wide = torch.randn(n, heads * dim + extra, dtype=torch.float32).to(device, dtype)
    return wide[:, extra : extra + heads * dim].view(n, heads, dim)


def run_add_rms_norm(ops, rows, cols, dtype, device, with_delta=True):
    x = torch.randn(rows, cols).to(device) * 3
    delta = torch.randn(rows, cols).to(device, dtype) if with_delta else None
    scale = (1 + 0.2 * torch.randn(cols)).to(device)
    x_ref = x.clone()
    out = ops.add_rms_norm(x, delta, scale, 1e-6, dtype=dtype)
    expected = reference.add_rms_norm(x_ref, delta, scale, 1e-6, dtype=dtype)
    return (out, expected), (x, x_ref)


def run_silu_mul(ops, rows, width, dtype, device):
    gate_up = (torch.randn(rows, 2 * width) * 4).to(device, dtype)
    return ops.silu_mul(gate_up), reference.silu_mul(gate_up)


def run_gated_rms_norm(ops, tokens, heads, dim, dtype, device):
    core = torch.randn(tokens, heads, dim).to(device, dtype)
    z = strided_tokens(tokens, heads, dim, 7, dtype, device).reshape(tokens, heads * dim)  # a strided slice
    z = z if z.stride(0) != heads * dim else z.contiguous()
    weight = (1 + 0.3 * torch.randn(dim)).to(device)
    return ops.gated_rms_norm(core, z, weight, 1e-6), reference.gated_rms_norm(core, z, weight, 1e-6)


def run_rms_norm_rope(ops, tokens, heads, dim, rotary, dtype, device):
    x = strided_tokens(tokens, heads, 2 * dim, 5, dtype, device)[..., :dim]  # query | gate per head
    scale = (1 + 0.2 * torch.randn(dim)).to(device)
    positions = torch.randint(0, 5000, (tokens, rotary // 2)).float()  # per-token, per-frequency (M-RoPE)
    angles = positions / (1e6 ** (torch.arange(rotary // 2) * 2 / rotary))
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    return ops.rms_norm_rope(x, scale, cos, sin, 1e-6), reference.rms_norm_rope(x, scale, cos, sin, 1e-6)


def run_sigmoid_gate(ops, tokens, heads, dim, dtype, device):
    attn = torch.randn(tokens, heads, dim).to(device, dtype)
    gate = strided_tokens(tokens, heads, 2 * dim, 3, dtype, device)[..., dim:] * 3
    return ops.sigmoid_gate(attn, gate), reference.sigmoid_gate(attn, gate)


def shapes(backend):
    """(rows, cols) / (tokens, heads, dim): full-size on fast backends, small in the simulator."""
    if backend.kind == "sim":
        return {"rows": [(1, 33), (5, 300)], "heads": [(1, 1, 32), (3, 2, 64)], "gated_heads": [(1, 1, 32), (3, 2, 64)]}
    heads = [(1, 1, 32), (9, 16, 128), (37, 4, 256)]
    # The CPU loops run 16 lanes at a time and the rest one by one: a head dim of 40 ends in a tail of 8.
    return {
        "rows": [(1, 33), (7, 4096), (130, 1000)],
        "heads": heads,
        "gated_heads": heads + [(5, 3, 40)] * (backend.kind == "cpu"),
    }


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_the_reference(backend, dtype):
    for rows, cols in shapes(backend)["rows"]:
        for with_delta in (True, False):
            (out, expected), (x, x_ref) = run_add_rms_norm(backend.ops, rows, cols, dtype, backend.device, with_delta)
            ok, worst = close(out, expected, dtype)
            assert out.dtype == dtype and ok, (rows, cols, with_delta, worst)
            assert float((x.cpu() - x_ref.cpu()).abs().max()) <= 1e-6 * float(x_ref.abs().max())  # x += delta


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_the_reference(backend, dtype):
    for rows, width in shapes(backend)["rows"]:
        out, expected = run_silu_mul(backend.ops, rows, width, dtype, backend.device)
        assert out.shape == (rows, width) and close(out, expected, dtype)[0], (rows, width)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_matches_the_reference(backend, dtype):
    for tokens, heads, dim in shapes(backend)["gated_heads"]:
        out, expected = run_gated_rms_norm(backend.ops, tokens, heads, dim, dtype, backend.device)
        assert out.shape == (tokens, heads * dim) and close(out, expected, dtype)[0], (tokens, heads, dim)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rope_matches_the_reference(backend, dtype):
    for tokens, heads, dim in shapes(backend)["heads"]:
        for rotary in sorted({dim // 4, dim // 2, dim}):  # clef-flash rotates a quarter of its 256 dims
            out, expected = run_rms_norm_rope(backend.ops, tokens, heads, dim, rotary, dtype, backend.device)
            assert out.is_contiguous() and close(out, expected, dtype)[0], (tokens, heads, dim, rotary)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_gate_matches_the_reference(backend, dtype):
    for tokens, heads, dim in shapes(backend)["gated_heads"]:
        out, expected = run_sigmoid_gate(backend.ops, tokens, heads, dim, dtype, backend.device)
        assert out.shape == (tokens, heads * dim) and close(out, expected, dtype)[0], (tokens, heads, dim)


def test_empty_inputs_are_no_ops(backend):
    ops, device = backend.ops, backend.device
    assert ops.silu_mul(torch.empty(0, 8, device=device)).shape == (0, 4)
    assert ops.add_rms_norm(torch.empty(0, 8, device=device), None, torch.ones(8, device=device), 1e-6).shape == (0, 8)
    assert ops.sigmoid_gate(torch.empty(0, 2, 4, device=device), torch.empty(0, 2, 4, device=device)).shape == (0, 8)


def run_in_place(ops, op: str, tokens: int, heads: int, dim: int, dtype, device):
    """`op` writing its output over its own input (the schema allows out = x for the ops that read each element
    before writing it): (the in-place result, the reference on a copy of the input)."""
    if op == "rms_norm_rope":
        rotary = max(2, dim // 2)  # half = dim / 4: a multiple of 32 at dim 128+, so a lane is its own partner
        x = torch.randn(tokens, heads, dim).to(device, dtype)
        scale = (1 + 0.2 * torch.randn(dim)).to(device)
        angles = torch.randint(0, 5000, (tokens, rotary // 2)).float() / 7.0
        cos, sin = angles.cos().to(device), angles.sin().to(device)
        expected = reference.rms_norm_rope(x.clone(), scale, cos, sin, 1e-6)
        return ops.rms_norm_rope(x, scale, cos, sin, 1e-6, out=x), expected
    if op == "gated_rms_norm":
        core = torch.randn(tokens, heads, dim).to(device, dtype)
        z = torch.randn(tokens, heads * dim).to(device, dtype)
        weight = (1 + 0.3 * torch.randn(dim)).to(device)
        expected = reference.gated_rms_norm(core.clone(), z, weight, 1e-6)
        return ops.gated_rms_norm(core, z, weight, 1e-6, out=core.view(tokens, heads * dim)), expected
    if op == "sigmoid_gate":
        attn = torch.randn(tokens, heads, dim).to(device, dtype)
        gate = torch.randn(tokens, heads, dim).to(device, dtype)
        expected = reference.sigmoid_gate(attn.clone(), gate)
        return ops.sigmoid_gate(attn, gate, out=attn.view(tokens, heads * dim)), expected
    assert op == "add_rms_norm"  # out replaces delta (x is the residual stream and stays apart)
    x, delta = torch.randn(tokens, heads * dim).to(device), torch.randn(tokens, heads * dim).to(device, dtype)
    scale = (1 + 0.2 * torch.randn(heads * dim)).to(device)
    expected = reference.add_rms_norm(x.clone(), delta.clone(), scale, 1e-6)
    return ops.add_rms_norm(x, delta, scale, 1e-6, out=delta), expected


IN_PLACE = ["rms_norm_rope", "gated_rms_norm", "sigmoid_gate", "add_rms_norm"]


@pytest.mark.parametrize("op", IN_PLACE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_in_place_is_right(backend, op, dtype):
    """out = the input itself: right on every backend, the GPU's kernels (in the simulator) included. The
    rope kernel used to write each value as soon as it was ready, so in place a later element read its
    rotation partner already overwritten (the glue_rope_writes_before_reads fault below)."""
    sizes = [(2, 2, 128), (3, 1, 64)] if backend.kind == "sim" else [(5, 4, 256), (3, 2, 64), (2, 3, 96)]
    for tokens, heads, dim in sizes:
        out, expected = run_in_place(backend.ops, op, tokens, heads, dim, dtype, backend.device)
        assert close(out, expected, dtype)[0], (op, tokens, heads, dim)


def test_a_partial_overlap_is_refused_naming_both():
    """An output that overlaps an input other than as the input itself would race on a GPU (a thread reads
    what another already wrote): a ValueError naming the two, before any launch."""
    from clef_cuda.kernels import ops

    gate_up = torch.randn(4, 16)
    with pytest.raises(ValueError, match="silu_mul: out overlaps gate_up in memory"):
        ops.silu_mul(gate_up, out=gate_up.view(-1)[:32].view(4, 8))  # even its own first rows race
    buffer = torch.randn(96)
    with pytest.raises(ValueError, match="sigmoid_gate: out overlaps gate"):
        ops.sigmoid_gate(torch.randn(3, 2, 8), buffer[:48].view(3, 2, 8), out=buffer[24:72].view(3, 16))
    x = torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match=r"rms_norm_rope: out overlaps x in memory \(in place, it must be x itself"):
        ops.rms_norm_rope(x[1:], torch.ones(8), torch.randn(3, 2), torch.randn(3, 2), 1e-6, out=x[:3])
    residual = torch.randn(2, 8)
    with pytest.raises(ValueError, match="add_rms_norm: out overlaps x"):
        ops.add_rms_norm(residual, None, torch.ones(8), 1e-6, out=residual)


FAULTS = {
    "glue_residual_not_kept": lambda ops: run_add_rms_norm(ops, 3, 40, torch.float32, "cpu")[1],
    "glue_swapped_gate_up": lambda ops: run_silu_mul(ops, 3, 40, torch.float32, "cpu"),
    "glue_gate_skipped": lambda ops: run_gated_rms_norm(ops, 3, 2, 32, torch.float32, "cpu"),
    "glue_rope_backwards": lambda ops: run_rms_norm_rope(ops, 3, 2, 32, 16, torch.float32, "cpu"),
    "glue_gate_of_next_head": lambda ops: run_sigmoid_gate(ops, 3, 2, 32, torch.float32, "cpu"),
    "glue_rope_writes_before_reads": lambda ops: run_in_place(ops, "rms_norm_rope", 2, 2, 128, torch.float32, "cpu"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_kernel_fault_fails_its_comparison(sim_ops, fault):
    """The same comparisons as above, in the simulator, with each CUDA kernel's test-only fault on: every
    one fails (and passes with the fault off, so the fault is what the comparison catches)."""
    actual, expected = FAULTS[fault](sim_ops)
    assert close(actual, expected, torch.float32)[0]
    with simulated(fault=fault):
        actual, expected = FAULTS[fault](sim_ops)
    assert not close(actual, expected, torch.float32)[0], fault


def test_argument_errors_name_the_argument():
    from clef_cuda.kernels import ops

    with pytest.raises(ValueError, match="gate_up's width must be even"):
        ops.silu_mul(torch.randn(2, 5))
    with pytest.raises(TypeError, match="x"):
        ops.add_rms_norm(torch.randn(2, 8, dtype=torch.float16), None, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="scale"):
        ops.add_rms_norm(torch.randn(2, 8), None, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="rotary_dim"):
        ops.rms_norm_rope(torch.randn(2, 1, 8), torch.ones(8), torch.ones(2, 5), torch.ones(2, 5), 1e-6)
    with pytest.raises(ValueError, match="z"):
        ops.gated_rms_norm(torch.randn(2, 2, 4), torch.randn(2, 7), torch.ones(4), 1e-6)


def test_opcheck():
    from clef_cuda.kernels import ops  # noqa: F401  (registers the ops)

    x = torch.randn(3, 16)
    args = {
        "add_rms_norm": (x.clone(), torch.randn(3, 16), torch.ones(16), 1e-6, torch.empty(3, 16)),
        "silu_mul": (torch.randn(3, 16), torch.empty(3, 8)),
        "gated_rms_norm": (torch.randn(3, 2, 8), torch.randn(3, 16), torch.ones(8), 1e-6, torch.empty(3, 16)),
        "rms_norm_rope": (
            torch.randn(3, 2, 8),
            torch.ones(8),
            torch.randn(3, 2),
            torch.randn(3, 2),
            1e-6,
            torch.empty(3, 2, 8),
        ),
        "sigmoid_gate": (torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.empty(3, 16)),
    }
    for name, arguments in args.items():
        torch.library.opcheck(getattr(torch.ops.clef, name).default, arguments)


def test_the_norms_see_eps_on_tiny_rows(backend):
    """Rows of magnitude 1e-3 with eps = 1e-4 (mean(x^2) = 1e-6: eps dominates the root): the norms match the
    reference to 1e-6 relative in fp32, while the same reference without eps is 10x off, so a kernel that
    dropped or mis-scaled eps could not pass (rows of order 1 hide eps entirely: 1e-6 of 1)."""
    eps, device = 1e-4, backend.device
    x = (torch.randn(4, 96) * 1e-3).to(device)
    scale = (1 + 0.2 * torch.randn(96)).to(device)
    out = backend.ops.add_rms_norm(x.clone(), None, scale, eps)
    expected = reference.add_rms_norm(x.clone(), None, scale, eps)
    without_eps = reference.add_rms_norm(x.clone(), None, scale, 0.0)
    worst = float((out.cpu() - expected.cpu()).abs().max() / expected.abs().max())
    assert worst <= 1e-6, worst
    assert float((without_eps.cpu() - expected.cpu()).abs().max() / expected.abs().max()) > 1.0
    heads = (torch.randn(3, 2, 32) * 1e-3).to(device)
    weight = (1 + 0.3 * torch.randn(32)).to(device)
    z = torch.randn(3, 64).to(device)
    out = backend.ops.gated_rms_norm(heads, z, weight, eps)
    expected = reference.gated_rms_norm(heads, z, weight, eps)
    assert float((out.cpu() - expected.cpu()).abs().max() / expected.abs().max()) <= 1e-6
    cos, sin = torch.ones(3, 8).to(device), torch.zeros(3, 8).to(device)
    out = backend.ops.rms_norm_rope(heads, weight, cos, sin, eps)
    expected = reference.rms_norm_rope(heads, weight, cos, sin, eps)
    assert float((out.cpu() - expected.cpu()).abs().max() / expected.abs().max()) <= 1e-6
