#!/usr/bin/env python3
"""Bytes the trunk's glue moves per token, per layer, before (eager torch, one pass per op) and after the
fused glue ops (csrc/glue), at clef-flash's shapes in the serving dtype (default f16).

Counted from the code, not measured: each eager op reads its inputs and writes its output in full (what
torch's elementwise kernels do); a fused op reads each input once and writes each output once (a row of
the residual stream, 16 KB in fp32, is re-read from L1/L2, not from DRAM). The residual stream is fp32,
activations are in the serving dtype. The eager passes are listed as the old trunk ran them (git show
35bb5e9^:clef_cuda/model/trunk.py): e.g. `rms_norm(x).to(f16)` is x.pow(2), mean, * rsqrt, * scale,
.to(f16).

    python benchmarks/glue_bytes.py            # clef-flash, f16
    python benchmarks/glue_bytes.py --dtype 4  # fp32 activations (the CPU's serving dtype)
"""

from __future__ import annotations

import argparse

# clef-flash (shared/specs/qwen35-trunk.md): hidden 4096, MLP 12288, 16 query / 4 KV heads x 256 (a
# quarter rotated), delta nets 16 key heads x 128, 32 value heads x 128; 24 delta-net + 8 attention layers.
SHAPES = {"H": 4096, "I": 12288, "Q": 16 * 256, "K": 4 * 256, "R": 16 * 64, "RK": 4 * 64, "V": 32 * 128}
LAYERS = {"delta_net": 24, "attention": 8}


def passes(a: int, s: dict[str, int]) -> dict[str, tuple[list[tuple[str, int]], list[tuple[str, int]]]]:
    """op -> (eager passes, fused passes), each pass (what, bytes read + written per token). `a`: bytes per
    activation element (2 for f16/bf16, 4 for fp32); the residual stream is fp32."""
    H, I, Q, K, R, RK, V = (s[k] for k in ("H", "I", "Q", "K", "R", "RK", "V"))  # noqa: E741 (the spec's names)

    def norm_eager(n: int, src: int) -> list[tuple[str, int]]:
        # x.float() when x is not fp32, x.pow(2), mean, x * rsqrt, * scale, .to(dtype)
        steps = [("x.float()", (src + 4) * n)] if src != 4 else []
        return steps + [
            ("pow(2)", 8 * n),
            ("mean", 4 * n),
            ("* rsqrt", 8 * n),
            ("* scale", 8 * n),
            (".to", (4 + a) * n),
        ]

    def rope_eager(n: int, rotated: int) -> list[tuple[str, int]]:
        # x1*cos, x2*sin, -, x2*cos, x1*sin, + over the rotated half-pairs, then torch.cat of the head
        return [("rotate products", 6 * 12 * rotated // 2), ("cat", 8 * n)]

    return {
        "residual add + norm (x2 a layer)": (
            [("mix.float()", (a + 4) * H), ("x += ", 12 * H), *norm_eager(H, 4)],
            [("add_rms_norm: x, delta in; x, out", (4 + a + 4 + a) * H)],
        ),
        "SiLU(gate) x up": (
            [("silu_(gate)", 2 * a * I), ("mul_(up)", 3 * a * I)] if a != 4 else [("silu_", 8 * I), ("mul_", 12 * I)],
            [("silu_mul: gate, up in; out", 3 * a * I)],
        ),
        "delta net: gated RMSNorm x SiLU(z)": (
            [*norm_eager(V, a), ("z.float()", (a + 4) * V), ("silu(z)", 8 * V), ("normed * gate", 12 * V)]
            + [(".to", (4 + a) * V)],
            [("gated_rms_norm: core, z in; out", 3 * a * V)],
        ),
        "attention: q norm + RoPE": (
            [*norm_eager(Q, a)[:-1], *rope_eager(Q, R), (".to", (4 + a) * Q)],
            [("rms_norm_rope: q in, out", 2 * a * Q)],
        ),
        "attention: k norm + RoPE": (
            [*norm_eager(K, a)[:-1], *rope_eager(K, RK), (".to", (4 + a) * K)],
            [("rms_norm_rope: k in, out", 2 * a * K)],
        ),
        "attention: sigmoid gate": (
            [("attn.float()", (a + 4) * Q), ("gate.float()", (a + 4) * Q), ("sigmoid", 8 * Q), ("*", 12 * Q)]
            + [(".to", (4 + a) * Q)],
            [("sigmoid_gate: attn, gate in; out", 3 * a * Q)],
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", type=int, default=2, choices=[2, 4], help="bytes per activation element")
    args = parser.parse_args()
    table = passes(args.dtype, SHAPES)

    def total(op: str, which: int) -> int:
        return sum(b for _, b in table[op][which])

    def layer(kind: str, which: int) -> int:
        common = 2 * total("residual add + norm (x2 a layer)", which) + total("SiLU(gate) x up", which)
        if kind == "delta_net":
            return common + total("delta net: gated RMSNorm x SiLU(z)", which)
        return common + sum(
            total(op, which)
            for op in ("attention: q norm + RoPE", "attention: k norm + RoPE", "attention: sigmoid gate")
        )

    print(f"glue bytes per token at clef-flash's shapes ({'f16' if args.dtype == 2 else 'fp32'} activations)")
    print(f"{'op':38s} {'eager passes':>12s} {'eager B':>9s} {'fused B':>9s} {'ratio':>6s}")
    for op, (eager, _) in table.items():
        e, f = total(op, 0), total(op, 1)
        print(f"{op:38s} {len(eager):12d} {e:9,d} {f:9,d} {e / f:6.1f}")
    print()
    print(f"{'per layer':38s} {'':>12s} {'eager KB':>9s} {'fused KB':>9s} {'ratio':>6s}")
    for kind in LAYERS:
        e, f = layer(kind, 0), layer(kind, 1)
        print(f"{kind:38s} {'':>12s} {e / 1024:9.1f} {f / 1024:9.1f} {e / f:6.1f}")
    e = sum(n * layer(k, 0) for k, n in LAYERS.items())
    f = sum(n * layer(k, 1) for k, n in LAYERS.items())
    print(f"{'whole trunk (24 + 8 layers), MB/token':38s} {'':>12s} {e / 2**20:9.2f} {f / 2**20:9.2f} {e / f:6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
