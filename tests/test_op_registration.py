"""Schemas, fake kernels and the build: torch.library.opcheck once per op, and build_info."""

from __future__ import annotations

import torch
from packing import cu_seqlens_of

import clef_cuda
from clef_cuda.kernels import ops


def _opcheck(op, args):
    torch.library.opcheck(op, args)


def test_causal_conv1d_ops_pass_opcheck():
    x, w, states = torch.randn(7, 16), torch.randn(16, 4), torch.randn(3, 16, 3)
    cu, slots, init = cu_seqlens_of([3, 4]), torch.tensor([2, 0], dtype=torch.int32), torch.tensor([True, False])
    _opcheck(torch.ops.clef.causal_conv1d_fwd.default, (x, w, None, states, cu, slots, init, True, torch.empty(7, 16)))
    _opcheck(
        torch.ops.clef.causal_conv1d_update.default,
        (x[:2], w, torch.randn(16), states, slots, True, torch.empty(2, 16)),
    )


def test_gated_delta_rule_ops_pass_opcheck():
    q, k, v = torch.randn(7, 2, 16), torch.randn(7, 2, 16), torch.randn(7, 4, 16)
    g, beta, states = -torch.rand(7, 4), torch.rand(7, 4), torch.randn(3, 4, 16, 16)
    cu, slots, init = cu_seqlens_of([3, 4]), torch.tensor([2, 0], dtype=torch.int32), torch.tensor([True, False])
    _opcheck(
        torch.ops.clef.gated_delta_rule_chunk.default,
        (q, k, v, g, beta, states, cu, slots, init, 0.25, True, torch.empty(7, 4, 16)),
    )
    _opcheck(
        torch.ops.clef.gated_delta_rule_recurrent.default,
        (q[:2], k[:2], v[:2], g[:2], beta[:2], states, slots, 0.25, True, torch.empty(2, 4, 16)),
    )


def test_paged_kv_ops_pass_opcheck():
    key, value = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    key_cache, value_cache = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)
    slots = torch.tensor([0, 1, 2, 4, 5], dtype=torch.int32)
    _opcheck(torch.ops.clef.reshape_and_cache.default, (key, value, key_cache, value_cache, slots))
    query = torch.randn(5, 4, 16)
    block_tables = torch.tensor([[0, 3], [1, 2]], dtype=torch.int32)
    _opcheck(
        torch.ops.clef.paged_attention.default,
        (
            query,
            key_cache,
            value_cache,
            cu_seqlens_of([3, 2]),
            torch.tensor([3, 6], dtype=torch.int32),
            block_tables,
            0.25,
            torch.empty(5, 4, 16),
        ),
    )


def test_ops_compile_with_torch_compile():
    """The fake kernels and mutation annotations let torch.compile trace a layer that calls our ops."""

    def conv_then_rule(x, w, states, gdr_states, cu, slots, init, g, beta):
        y = ops.causal_conv1d_fwd(x, w, None, states, cu, slots, init)
        q, k, v = y[:, :32].view(-1, 2, 16), y[:, 32:64].view(-1, 2, 16), y[:, 64:].view(-1, 2, 16)
        return ops.gated_delta_rule_chunk(q, k, v, g, beta, gdr_states, cu, slots, init)

    args = (
        torch.randn(9, 96),
        torch.randn(96, 4),
        torch.zeros(2, 96, 3),
        torch.zeros(2, 2, 16, 16),
        cu_seqlens_of([4, 5]),
        torch.tensor([1, 0], dtype=torch.int32),
        torch.tensor([False, False]),
        -torch.rand(9, 2),
        torch.rand(9, 2),
    )
    eager_args = [a.clone() for a in args]
    compiled = torch.compile(conv_then_rule, backend="aot_eager", fullgraph=True)(*args)
    eager = conv_then_rule(*eager_args)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(args[3], eager_args[3])  # the state update happened under compile too


def test_build_info_describes_the_extension():
    info = clef_cuda.build_info()
    assert info["variant"] in ("cpu", "cuda")
    if info["variant"] == "cuda":
        assert info["cuda_archs"], "a CUDA build must list its archs"
        assert all(float(a) >= 6.0 for a in info["cuda_archs"])
        # The default build (setup.py DEFAULT_ARCHS, as CI builds it) embeds sm_90's PTX for cards newer than
        # every machine code; a build for the local GPU alone (gpu_check.sh) need not.
        if {"7.5", "8.0", "9.0"} <= set(info["cuda_archs"]):
            assert info["cuda_ptx"] == ["9.0"], info
