"""Op microbenchmarks (pytest-benchmark): ours vs the upstream torch path at clef-flash layer shapes.

    pytest benchmarks --benchmark-only                 # CPU: 1024 tokens, 1 and 4 sequences
    pytest benchmarks --benchmark-only --device cuda   # GPU: 4096 tokens, f16

Group by op to read the ratios: pytest-benchmark prints each group sorted by time. The summary table
with rates and % of measured peaks is benchmarks/kernel_table.py.
"""

from __future__ import annotations

import cases
import torch


def pytest_generate_tests(metafunc):
    if "case" not in metafunc.fixturenames:
        return
    device = torch.device(metafunc.config.getoption("--device"))
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    tokens = 4096 if device.type == "cuda" else 1024
    torch.manual_seed(0)
    cases._qwen35()  # before FLA is importable (cases.fla_ops)
    params, ids = [], []
    for case in cases.all_cases([tokens], [1, 4], dtype, device):
        for impl in ["ours", "reference", *case.peers]:
            params.append((case, impl))
            ids.append(f"{case.op}[{case.shape}]-{impl}")
    metafunc.parametrize("case, impl", params, ids=ids)


def test_op(benchmark, case, impl, request):
    device = torch.device(request.config.getoption("--device"))
    fn = {"ours": case.ours, "reference": case.reference, **case.peers}[impl]
    benchmark.group = f"{case.op} {case.shape}"
    benchmark.extra_info["implementation"] = {"ours": "clef_cuda.kernels.ops", "reference": case.reference_name}.get(
        impl, impl
    )
    if device.type == "cuda":

        def synced():
            fn()
            torch.cuda.synchronize()

        benchmark(synced)
    else:
        benchmark(fn)
