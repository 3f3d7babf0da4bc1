#!/usr/bin/env python3
"""The fused glue ops with a SiLU or a sigmoid (csrc/glue/glue_cpu.cpp) on the CPU against eager torch
(clef_cuda.kernels.reference: the same math, one torch op a pass), per CPU kernel variant and dtype, at clef-flash's
widths: time per call (median of --repeats, ours and eager interleaved) and eager / ours (above 1: ours is
faster). Threads: torch's default unless --threads.

    python benchmarks/glue_cpu.py                 # 512 rows, every variant this CPU runs, f32 and bf16
    python benchmarks/glue_cpu.py --rows 2048 --threads 1
"""

from __future__ import annotations

import argparse
import sys

import torch
from decision_latency import interleaved_medians, markdown_table  # benchmarks/, the script's own directory

from clef_cuda.kernels import ops, reference

# clef-flash (shared/specs/qwen35-trunk.md): MLP 12288; delta nets 32 value heads x 128; attention 16 heads x 256.
MLP, V_HEADS, V_DIM, Q_HEADS, HEAD_DIM = 12288, 32, 128, 16, 256


def cases(rows: int, dtype: torch.dtype) -> dict[str, tuple]:
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    gate_up = randn(rows, 2 * MLP)
    core, z, weight = randn(rows, V_HEADS, V_DIM), randn(rows, V_HEADS * V_DIM), torch.rand(V_DIM, generator=g)
    attn, gate = randn(rows, Q_HEADS, HEAD_DIM), randn(rows, Q_HEADS, HEAD_DIM)
    return {
        "silu_mul": (lambda: ops.silu_mul(gate_up), lambda: reference.silu_mul(gate_up)),
        "gated_rms_norm": (
            lambda: ops.gated_rms_norm(core, z, weight, 1e-6),
            lambda: reference.gated_rms_norm(core, z, weight, 1e-6),
        ),
        "sigmoid_gate": (lambda: ops.sigmoid_gate(attn, gate), lambda: reference.sigmoid_gate(attn, gate)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512, help="tokens a call (default 512)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per cell (default 20)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.repeats < 1 or args.threads < 0:
        parser.error("--rows and --repeats must be positive, --threads not negative")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for isa in ops.supported_cpu_isas():
        with ops.using_cpu_isa(isa):
            for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
                for op, (ours, eager) in cases(args.rows, dtype).items():
                    t_ours, t_eager = interleaved_medians([ours, eager], args.repeats, torch.device("cpu"))
                    rows.append(
                        [op, isa, name, f"{1e3 * t_ours:.2f}", f"{1e3 * t_eager:.2f}", f"{t_eager / t_ours:.2f}"]
                    )
    title = f"{args.rows} rows, {torch.get_num_threads()} thread(s), median of {args.repeats} calls"
    header = ["op", "variant", "dtype", "ours (ms)", "eager (ms)", "eager / ours"]
    print("\n".join(markdown_table(title, header, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
