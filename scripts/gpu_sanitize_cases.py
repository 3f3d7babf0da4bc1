#!/usr/bin/env python3
"""Every CUDA kernel once, at clef-flash's shapes but few tokens, against the reference: what
scripts/gpu_check.sh runs under each compute-sanitizer tool (memcheck, racecheck, synccheck, initcheck),
where the test suite would take too long. Exits 1 on a mismatch, naming it.

- the on-device self-check on a random trunk of clef-flash's layer shapes (benchmarks/selfcheck_cost.py), f16
  and bf16, with int8 weights once: conv (each channel band) and its update, the delta rule's chunk op through
  each of its kernels (token-serial, chunked on tensor cores) and its recurrent op, the cache write, attention on
  the tensor-core kernel (a prefill pack) and the SIMT one (a decode pack), the five glue ops, int8 dequantize,
  one real layer of each kind;
- once a dtype: tensor-core attention v2 forced, on a pack that fills the GPU (no split) and on one long record
  (a handful of CTAs: the split-context pass and its combine kernel); rms_norm_rope in place (out = x).

    python scripts/gpu_sanitize_cases.py                 # on the GPU (cuda:0)
    compute-sanitizer --tool racecheck python scripts/gpu_sanitize_cases.py --ops-only --dtypes f16

--ops-only leaves out the two real layers, whose inputs come from cuBLAS: on sm_90 its GEMMs (nvjet, stored by
the bulk-copy engine) leave memory that initcheck does not see written, so every kernel that reads a GEMM's
output, ours or torch's, is reported (seen on an H200, 2026-12-04); without them our kernels read only what
torch's random generators wrote. scripts/sanitizer_verdict.py then gates on reports inside our kernels alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def selfcheck_cost():
    spec = importlib.util.spec_from_file_location("selfcheck_cost", ROOT / "benchmarks" / "selfcheck_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    from clef_cuda.kernels import ops, reference
    from clef_cuda.tuning.autotune import TuneTarget, _AttentionCase
    from clef_cuda.verification.selfcheck import OP_RTOL, run_selfcheck, within

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="f16,bf16", help="activation dtypes (bf16 on sm_80+ only)")
    parser.add_argument("--ops-only", action="store_true", help="the op checks without the real layers")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_sanitize_cases: no GPU", file=sys.stderr)
        return 2
    device, costs, failures = torch.device("cuda:0"), selfcheck_cost(), []
    config = costs.FLASH_LAYERS
    named = {"f16": torch.float16, "bf16": torch.bfloat16}
    dtypes = [named[d] for d in args.dtypes.split(",")]
    if torch.cuda.get_device_capability() < (8, 0):
        dtypes = [d for d in dtypes if d != torch.bfloat16]
    for dtype, quantize in [(d, "none") for d in dtypes] + [(torch.float16, "int8")]:
        trunk = costs.random_trunk(config, device, dtype, quantize)
        report = run_selfcheck(trunk, block_size=16, layers=not args.ops_only)
        print(f"self-check {dtype} {quantize}: {report.summary()}")
        if not report.passed:
            failures.append(f"self-check {dtype} {quantize}: {report.summary()}")
        if quantize != "none":
            continue  # int8 changes the weights' kernels only: the cases below ran at this dtype already

        target = TuneTarget(ops, config, device, dtype)
        generator = torch.Generator().manual_seed(1)
        # A pack of chunks that fills the GPU's SMs (no split), then one long record over few CTAs (split).
        for name, shape in (("v2 whole grid", [(256, 1024)] * 4 + [(1, 300)]), ("v2 split", [(64, 4096)])):
            case = _AttentionCase(target, shape, 16, generator)
            expected = case.reference()
            out = ops.paged_attention(
                case.query,
                case.key_cache,
                case.value_cache,
                case.batch.cu_seqlens,
                case.batch.context_lens,
                case.batch.block_tables,
                kernel="wmma2",
                max_query_len=max(case.batch.q_lens),
            )
            ok = within(out, expected, 2 * OP_RTOL[dtype])
            print(f"{name} {dtype}: {'ok' if ok else 'MISMATCH'}")
            if not ok:
                failures.append(f"{name} {dtype}")

        x = torch.randn(37, config.num_attention_heads, config.head_dim, device=device, dtype=dtype)
        scale = 1 + 0.1 * torch.randn(config.head_dim, device=device)
        angles = torch.rand(37, config.rotary_dim // 2, device=device) * 100
        expected = reference.rms_norm_rope(x.clone(), scale, angles.cos(), angles.sin(), 1e-6)
        out = ops.rms_norm_rope(x, scale, angles.cos(), angles.sin(), 1e-6, out=x)
        ok = within(out, expected, 2 * OP_RTOL[dtype])
        print(f"rms_norm_rope in place {dtype}: {'ok' if ok else 'MISMATCH'}")
        if not ok:
            failures.append(f"rms_norm_rope in place {dtype}")
    torch.cuda.synchronize()
    for failure in failures:
        print(f"FAIL {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
