"""The start-up autotune (clef_cuda.tuning.autotune): with injected timings it picks the fastest candidate per
bucket, never one that failed its check or raised; it reuses its cache and ignores one from another device
or version; a batch runs its nearest bucket's choice; decisions agree with the reference whichever candidate
runs; /ready and /metrics show the choices; the SDPA candidate against the reference on awkward packs."""

from __future__ import annotations

import json
import random
import sys
from types import SimpleNamespace

import pytest
import torch
from fastapi.testclient import TestClient
from parity import PARITY_BOUND
from prometheus_client.parser import text_string_to_metric_families
from random_requests import random_request
from releases import mid_release, tiny_release
from test_paged_attention import cu_seqlens_of, fill_context, make_cache

from app.server import ServerSettings, create_app
from clef_cuda import Decider
from clef_cuda.kernels import reference
from clef_cuda.kernels.sdpa import paged_attention_sdpa
from clef_cuda.model.default_model import default_release
from clef_cuda.serving.engine import Engine, EngineConfig
from clef_cuda.tuning import autotune as tuning
from clef_cuda.tuning import tunes

CONFIG = EngineConfig(max_model_len=4096, kv_fraction=0.05, prefill_chunk_size=256, max_num_seqs=2)


@pytest.fixture(scope="module")
def tiny():
    return Decider.from_release(default_release(), device="cpu", progress=False)


def fake_timings(monkeypatch, ms_by_candidate: dict[str, float]) -> None:
    """_median_ms runs the candidate once and returns its injected time."""

    def median(fn, repeats, device, candidate, **_):
        fn()
        return ms_by_candidate[candidate]

    monkeypatch.setattr(tunes, "_median_ms", median)


def test_the_fastest_candidate_is_chosen_for_every_bucket(tiny, monkeypatch):
    fake_timings(monkeypatch, {"ours": 5.0, "sdpa-flash": 2.0, "sdpa-math": 9.0})
    report = tuning.autotune(tiny.trunk, CONFIG, "fast", None)
    assert set(report.choices["paged_attention"].values()) == {"sdpa-flash"}
    chosen = [r for r in report.rows if r.status == "chosen"]
    assert len(chosen) == len(report.choices["paged_attention"]) and all(r.candidate == "sdpa-flash" for r in chosen)
    assert "sdpa-flash" in report.table()


def test_a_candidate_that_fails_its_check_or_raises_is_never_chosen(tiny, monkeypatch):
    real = tunes.attention_candidates

    def with_bad_ones(trunk):
        found = real(trunk)

        def wrong(query, key_cache, value_cache, batch):
            return found["ours"](query, key_cache, value_cache, batch) * 1.01

        def raises(*args):
            raise RuntimeError("no kernel image is available for execution on the device")

        return found | {"wrong": wrong, "raises": raises}

    monkeypatch.setattr(tunes, "attention_candidates", with_bad_ones)
    # The broken ones would be the fastest: only their checks keep them out.
    fake_timings(monkeypatch, {"wrong": 0.1, "raises": 0.1, "ours": 5.0, "sdpa-flash": 6.0, "sdpa-math": 7.0})
    report = tuning.autotune(tiny.trunk, CONFIG, "fast", None)
    assert not {"wrong", "raises"} & set(report.choices["paged_attention"].values())
    rows = {(r.candidate, r.status.split(":")[0]) for r in report.rows if r.bucket == "verify"}
    assert ("wrong", "failed its check") in rows and ("raises", "raised") in rows


def test_the_cache_is_reused_and_another_devices_is_ignored(tiny, tmp_path, monkeypatch):
    first = tuning.autotune(tiny.trunk, CONFIG, "fast", tmp_path)
    assert not first.cached and len(list(tmp_path.glob("autotune-*.json"))) == 1
    monkeypatch.setattr(tunes, "_median_ms", lambda *a: pytest.fail("timed although cached"))
    again = tuning.autotune(tiny.trunk, CONFIG, "fast", tmp_path)
    assert again.cached and again.choices == first.choices
    (path,) = tmp_path.glob("autotune-*.json")
    data = json.loads(path.read_text())
    data["key"]["torch"] = "0.0.1"  # another version's file under this key's name: ignored, tuned again
    path.write_text(json.dumps(data))
    monkeypatch.setattr(tunes, "_median_ms", lambda fn, repeats, device, candidate, **_: 1.0)
    assert not tuning.autotune(tiny.trunk, CONFIG, "fast", tmp_path).cached
    other = tuning.cache_key(tiny.trunk, CONFIG, "fast", tunes.attention_buckets("fast", 2, 256, 4096))
    assert tuning.cache_file(tmp_path, other | {"device": "another cpu"}) != path
    # The GEMMs capped below the CPU's bf16 dot products (ONEDNN_MAX_CPU_ISA): another key, tuned again.
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "SSE41")
    capped = tuning.cache_key(tiny.trunk, CONFIG, "fast", tunes.attention_buckets("fast", 2, 256, 4096))
    assert capped["gemm"] == "no bf16 dot products, no int8 dot products"
    assert capped == other | {"gemm": capped["gemm"]}  # the same key but for the GEMMs' features
    if other["gemm"] != capped["gemm"]:  # a CPU with bf16 or int8 dot products: its own file
        assert tuning.cache_file(tmp_path, capped) != tuning.cache_file(tmp_path, other)


def test_a_batch_runs_its_nearest_buckets_choice():
    buckets = tunes.attention_buckets("fast", 4, 1024, 16384)
    names = {b.name for b in buckets}
    assert {"prefill 1k", "prefill 4k", "prefill 16k", "prefill 1k x4", "chunk 64 after 4k", "decode 1k x4"} == names

    def nearest(q_lens, contexts):
        return tunes.nearest_bucket(buckets, tuple(q_lens), tuple(contexts)).name

    assert nearest([1024], [1024]) == "prefill 1k" and nearest([700], [6000]) == "prefill 4k"
    assert nearest([512], [30000]) == "prefill 16k" and nearest([256, 256, 100], [300, 600, 100]) == "prefill 1k x4"
    assert nearest([64], [5000]) == "chunk 64 after 4k" and nearest([1, 1, 1], [40, 900, 3]) == "decode 1k x4"


@pytest.mark.parametrize("release", ["upstream-tiny", "mid"])
def test_decisions_agree_with_the_reference_whichever_candidate_runs(release):
    from parity import reference_response  # noqa: F401  (the bound's module)
    from releases import reference_model
    from test_decider import reference_probabilities

    path = {"upstream-tiny": tiny_release, "mid": mid_release}[release]()
    decider = Decider.from_release(path, device="cpu", progress=False)
    jsm, model, processor = reference_model(path)
    requests = [random_request(random.Random(seed), state_words=(50, 300)) for seed in range(3)]
    expected = [reference_probabilities(jsm, model, processor, r)[1] for r in requests]
    for candidate in tunes.attention_candidates(decider.trunk):
        policy = tunes.attention_candidates(decider.trunk)[candidate]
        decider.trunk.attention_choice = lambda batch, impl=policy: impl
        for request, want in zip(requests, expected, strict=True):
            got = decider.probabilities(decider.encode(request))
            worst = max(abs(a - b) for p, q in zip(got, want, strict=True) for a, b in zip(p, q, strict=True))
            assert worst < PARITY_BOUND, (candidate, worst)
    decider.trunk.attention_choice = None


def test_ready_and_metrics_show_the_choices(tiny):
    engine = Engine(tiny, CONFIG)
    with TestClient(create_app(ServerSettings(autotune="fast"), engine=engine)) as client:
        body = client.get("/ready").json()
        text = client.get("/metrics").text
    assert body["autotune"]["choices"]["paged_attention"] and body["autotune"]["rows"]
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "clef_kernel_choice"]
    chosen = {(s.labels["bucket"], s.labels["impl"]) for s in samples}
    assert chosen == {(b, i) for b, i in body["autotune"]["choices"]["paged_attention"].items()}
    assert engine.decider.trunk.attention_choice is not None


def test_the_modes_the_cli_offers_are_the_autotunes():
    from app.cli.flags import AUTOTUNE_MODES

    assert AUTOTUNE_MODES == tunes.AUTOTUNE_MODES
    with pytest.raises(ValueError, match="--autotune must be one of"):
        tuning.autotune(None, CONFIG, "sometimes")


@pytest.mark.parametrize("backend", ["sdpa-flash", "sdpa-math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sdpa_candidate_matches_the_reference(backend, dtype):
    """Chunks after a cached prefix, fresh prefills, decode tokens, empty sequences; GQA 1, 2 and 4; block
    sizes 4 and 16; the pages scattered and NaN between contexts."""
    sequences = [(9, 9), (3, 40), (1, 17), (0, 5), (20, 70)]
    for hq, hkv, d, block_size in [(4, 1, 64, 16), (4, 2, 32, 4), (2, 2, 16, 4)]:
        key_cache, value_cache, tables = make_cache(sequences, hkv, d, block_size, dtype, "cpu")
        fill_context(sequences, key_cache, value_cache, tables, dtype, "cpu")
        query = torch.randn(sum(q for q, _ in sequences), hq, d, dtype=dtype)
        cu = cu_seqlens_of([q for q, _ in sequences])
        lens = torch.tensor([c for _, c in sequences], dtype=torch.int32)
        q_lens, contexts = tuple(q for q, _ in sequences), tuple(c for _, c in sequences)
        out = paged_attention_sdpa(query, key_cache, value_cache, tables, q_lens, contexts, backend=backend)
        expected = reference.paged_attention(query, key_cache, value_cache, cu, lens, tables)
        assert torch.isfinite(out).all()
        assert float((out.float() - expected.float()).abs().max()) <= (1e-5 if dtype == torch.float32 else 2e-2)


def test_int8_linear_takes_the_faster_checked_candidate_per_step_size_and_answers_the_same(monkeypatch):
    """With int8 weights the fused kernel (up to 64 rows), dequantize + GEMM and, on the CPU, torch's
    _weight_int8pack_mm compete per step size: injected as the faster, each is chosen where it may run and
    installed, the fused kernel never above its 64 rows; the decisions stay those of dequantize + GEMM (the same
    int8 weights and scales; only the summation order differs)."""
    decider = Decider.from_release(mid_release(), device="cpu", progress=False, quantize="int8")
    decider.trunk.int8_by_rows = [(sys.maxsize, "dequantize+gemm")]
    requests = [random_request(random.Random(seed), state_words=(50, 200)) for seed in range(2)]
    before = [decider.probabilities(decider.encode(r)) for r in requests]
    fake_timings(
        monkeypatch,
        {"dequantize+gemm": 2.0, "fused": 1.0, "int8pack_mm": 1.5, "ours": 1.0, "sdpa-flash": 2.0, "sdpa-math": 3.0},
    )
    report = tuning.autotune(decider.trunk, CONFIG, "fast", None)
    assert report.choices["int8_linear"] == {
        "rows 1": "fused",
        "rows 16": "fused",
        "rows 64": "fused",
        "prefill": "int8pack_mm",
    }
    assert decider.trunk.int8_by_rows == [(1, "fused"), (16, "fused"), (64, "fused"), (sys.maxsize, "int8pack_mm")]
    assert decider.trunk.int8_impl(64) == "fused" and decider.trunk.int8_impl(65) == "int8pack_mm"
    after = [decider.probabilities(decider.encode(r)) for r in requests]
    worst = max(
        abs(a - b)
        for x, y in zip(before, after, strict=True)
        for p, q in zip(x, y, strict=True)
        for a, b in zip(p, q, strict=True)
    )
    assert worst < PARITY_BOUND, worst
    fake_timings(
        monkeypatch,
        {"dequantize+gemm": 1.0, "fused": 2.0, "int8pack_mm": 3.0, "ours": 1.0, "sdpa-flash": 2.0, "sdpa-math": 3.0},
    )
    tuning.autotune(decider.trunk, CONFIG, "fast", None)
    assert decider.trunk.int8_impl(8) == "dequantize+gemm"


def test_past_the_budget_the_remaining_buckets_keep_ours_untimed(tiny, monkeypatch):
    """Start-up stays bounded on a slow device: once the mode's budget is spent, no more timing."""
    monkeypatch.setitem(tunes.BUDGET_SECONDS, "fast", 0.0)
    fake_timings(monkeypatch, {"ours": 5.0, "sdpa-flash": 1.0, "sdpa-math": 9.0})
    report = tuning.autotune(tiny.trunk, CONFIG, "fast", None)
    assert set(report.choices["paged_attention"].values()) == {"ours"}
    untimed = [r for r in report.rows if r.status.startswith("chosen untimed: past the fast budget")]
    assert len(untimed) == len(report.choices["paged_attention"]) and all(r.ms is None for r in untimed)


def test_ours_runs_on_the_trunks_own_op_library(monkeypatch):
    """A trunk built on another op library (a fault-injected one, the simulator) keeps it when the autotune
    chooses ours: the policy never swaps in clef_cuda.kernels.ops behind its back."""
    from faults import OpFault

    calls = []

    def counted(original, *args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    decider = Decider.from_release(
        tiny_release(), device="cpu", progress=False, ops=OpFault("paged_attention", counted)
    )
    fake_timings(monkeypatch, {"ours": 1.0, "sdpa-flash": 2.0, "sdpa-math": 3.0})
    tuning.autotune(decider.trunk, CONFIG, "fast", None)
    calls.clear()
    decider.decide(random_request(random.Random(0)))
    assert calls and decider.trunk.attention_choice is not None


def test_each_bucket_runs_its_own_choice(tiny, monkeypatch):
    """Timings that differ by bucket give choices that differ by bucket, and a batch runs its nearest bucket's:
    a prefill chunk the candidate fastest at prefill, a short chunk after a long prefix the one fastest there."""

    real_case = tunes._AttentionCase.of

    def case_of(target, bucket, block_size, generator):
        case = real_case(target, bucket, block_size, generator)
        case.bucket = bucket
        return case

    timed_bucket = {}

    def median_by_bucket(fn, repeats, device, candidate, **kwargs):
        fn()
        kind = timed_bucket["now"].kind
        fastest = {"prefill": "sdpa-flash", "chunk": "sdpa-math", "decode": "ours"}[kind]
        return 1.0 if candidate == fastest else 5.0

    real_run = tunes._AttentionCase.run

    def run(self, impl):
        if hasattr(self, "bucket"):
            timed_bucket["now"] = self.bucket
        return real_run(self, impl)

    monkeypatch.setattr(tunes._AttentionCase, "of", staticmethod(case_of))
    monkeypatch.setattr(tunes._AttentionCase, "run", run)
    monkeypatch.setattr(tunes, "_median_ms", median_by_bucket)
    config = EngineConfig(max_model_len=4096, kv_fraction=0.05, prefill_chunk_size=256, max_num_seqs=2)
    report = tuning.autotune(tiny.trunk, config, "fast", None)
    choices = report.choices["paged_attention"]
    assert {choices[b] for b in choices if b.startswith("prefill")} == {"sdpa-flash"}
    assert {choices[b] for b in choices if b.startswith("chunk")} == {"sdpa-math"}
    assert {choices[b] for b in choices if b.startswith("decode")} == {"ours"}
    policy = tiny.trunk.attention_choice
    from clef_cuda.model.trunk import ChunkBatch, SequenceChunk

    def batch(q_len: int, context: int):
        blocks = list(range(-(-context // 16)))
        return ChunkBatch.build([SequenceChunk([0] * q_len, context - q_len, -1, blocks)], 16, "cpu")

    for (q_len, context), kind, expected in (
        ((256, 1024), "prefill", "sdpa-flash"),
        ((64, 4000), "chunk", "sdpa-math"),
    ):
        bucket = tunes.nearest_bucket(policy.buckets, (q_len,), (context,))
        assert bucket.kind == kind and choices[bucket.name] == expected
        assert policy(batch(q_len, context)) is policy.impl[bucket.name]
    assert policy(batch(256, 1024)) is not policy(batch(64, 4000))


def test_a_candidate_wrong_only_at_long_contexts_is_rejected_there_and_chosen_elsewhere(tiny, monkeypatch):
    """Checked at every bucket against ours: a candidate right on the small verification pack and at 1k but
    wrong past 2k of context fails its check at those buckets only, and is never chosen for them."""
    real = tunes.attention_candidates

    def with_long_fault(trunk):
        found = real(trunk)

        def wrong_when_long(query, key_cache, value_cache, batch):
            out = found["ours"](query, key_cache, value_cache, batch)
            return out * 1.01 if max(batch.context_lengths) > 2048 else out

        return found | {"wrong-long": wrong_when_long}

    monkeypatch.setattr(tunes, "attention_candidates", with_long_fault)
    fake_timings(monkeypatch, {"wrong-long": 0.1, "ours": 5.0, "sdpa-flash": 6.0, "sdpa-math": 7.0})
    config = EngineConfig(max_model_len=4096, kv_fraction=0.05, prefill_chunk_size=256, max_num_seqs=2)
    report = tuning.autotune(tiny.trunk, config, "fast", None)
    rejected = {
        r.bucket for r in report.rows if r.candidate == "wrong-long" and r.status.startswith("failed its check")
    }
    long_buckets = {b.name for b in tunes.attention_buckets("fast", 2, 256, 4096) if b.context > 2048}
    assert rejected == long_buckets
    choices = report.choices["paged_attention"]
    assert all(choices[b] != "wrong-long" for b in long_buckets)
    assert any(choice == "wrong-long" for b, choice in choices.items() if b not in long_buckets)


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Tue Sep 30 2025\nGCC version: 12\n",
            "580.159.04",
        ),
        ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  575.57.08  Release Build\n", "575.57.08"),
    ],
)
def test_the_cache_key_names_the_nvidia_driver(tmp_path, text, expected):
    """The driver JIT-compiles PTX, so a tuning is keyed by it; torch has no public call for its version (the
    first GPU run's autotune failed on a private one torch 2.11 lacks), so it is read from the driver's file."""
    driver_file = tmp_path / "version"
    driver_file.write_text(text)
    assert tuning.cuda_driver_version(driver_file) == expected


def test_without_a_driver_the_version_is_unknown_not_an_error(tmp_path):
    """No /proc file and no libcuda (a CPU machine, a container without the driver): a string, never a raise."""
    assert tuning.cuda_driver_version(tmp_path / "absent") in {"unknown"} | {
        f"cuda {v}" for v in range(9000, 20000, 10)
    }


# ---- the delta rule's kernels: the simulator's op library stands in for a GPU's (it runs the CUDA kernels) ----
def sim_target(sim_ops, tiny) -> tunes.TuneTarget:
    """clef-tiny's delta-net shapes (2 key heads, 4 value heads, head dim 16) in f16 on the simulated GPU."""
    return tunes.TuneTarget(sim_ops, tiny.trunk.config, torch.device("cpu"), torch.float16)


STEPS = SimpleNamespace(max_num_seqs=2, prefill_chunk_size=32)  # small steps: the simulator runs them


def test_the_delta_rule_kernels_are_checked_then_the_faster_runs_per_bucket(sim_ops, tiny, monkeypatch):
    assert [b.name for b in tunes.delta_rule_buckets(STEPS)] == ["32 x1", "16 x2"]
    big = tunes.delta_rule_buckets(SimpleNamespace(max_num_seqs=4, prefill_chunk_size=1024))
    assert [b.name for b in big] == ["64 x1", "1024 x1", "256 x4", "16 x4"]
    injected = iter([3.0, 1.0, 1.0, 2.0])  # (serial, chunked) per bucket, in bucket order
    monkeypatch.setattr(tunes, "_median_ms", lambda fn, repeats, device, candidate, **_: next(injected))
    report = tunes.AutotuneReport("fast", {})
    tunes.tune_delta_rule(sim_target(sim_ops, tiny), STEPS, "fast", report)
    choices = report.choices["gated_delta_rule_chunk"]
    assert choices == {"32 x1": "chunked", "16 x2": "serial"}
    assert not [r for r in report.rows if r.bucket == "verify"], report.table()  # both passed their checks

    policy = tunes.DeltaRulePolicy(tunes.delta_rule_buckets(STEPS), choices)
    assert policy(SimpleNamespace(q_lens=(64,))) == "chunked" and policy(SimpleNamespace(q_lens=(1000,))) == "chunked"
    assert policy(SimpleNamespace(q_lens=(9, 20))) == "serial" and policy(SimpleNamespace(q_lens=())) == "auto"
    nearest = tunes.nearest_delta_rule_bucket(big, (200, 300, 250))
    assert nearest.name == "256 x4" and tunes.nearest_delta_rule_bucket(big, (700,)).name == "1024 x1"


def test_a_delta_rule_kernel_that_fails_its_check_is_never_chosen(sim_ops, tiny, monkeypatch):
    """The chunked kernel with the state dropped between chunks (a test-only fault): its check against the
    reference fails, and every bucket runs the serial kernel."""
    from conftest import simulated

    monkeypatch.setattr(tunes, "_median_ms", lambda fn, repeats, device, candidate, **_: 1.0)
    report = tunes.AutotuneReport("fast", {})
    with simulated(fault="gdr_state_not_carried"):
        tunes.tune_delta_rule(sim_target(sim_ops, tiny), STEPS, "fast", report)
    verify = [(r.candidate, r.status) for r in report.rows if r.bucket == "verify"]
    assert verify == [("chunked", "failed its check: the reference")], report.table()
    assert set(report.choices["gated_delta_rule_chunk"].values()) == {"serial"}


def test_the_cpu_has_one_delta_rule_and_nothing_to_tune(tiny):
    report = tunes.AutotuneReport("fast", {})
    target = tunes.TuneTarget(tiny.trunk.ops, tiny.trunk.config, torch.device("cpu"), torch.float32)
    tunes.tune_delta_rule(target, STEPS, "fast", report)
    assert report.rows == [] and "gated_delta_rule_chunk" not in report.choices


def test_install_gives_the_trunk_the_delta_rule_choices_its_failures_allow(tiny):
    trunk = tiny.trunk
    saved = trunk.ops, trunk.attention_choice, trunk.delta_rule_choice
    try:
        choices = {"gated_delta_rule_chunk": {"32 x1": "chunked", "16 x2": "serial"}}
        tuning.install(trunk, tunes.AutotuneReport("fast", {}, choices=choices), [], None, STEPS)
        assert trunk.delta_rule_choice(SimpleNamespace(q_lens=(80,))) == "chunked"
        trunk.ops.mark_failed("gated_delta_rule_chunk:chunked", "could not launch: no kernel image")
        assert trunk.delta_rule_choice(SimpleNamespace(q_lens=(80,))) == "auto"  # failed while serving: steered
        failed = {"gated_delta_rule_chunk:chunked": "crashed its trial"}
        tuning.install(trunk, tunes.AutotuneReport("fast", {}, choices=choices, failures=failed), [], None, STEPS)
        assert trunk.delta_rule_choice(SimpleNamespace(q_lens=(80,))) == "serial"  # the only choice left
        tuning.install(trunk, tunes.AutotuneReport("fast", {}), [], None, STEPS)
        assert trunk.delta_rule_choice is None  # untuned: the op's own rule ("auto")
    finally:
        trunk.ops, trunk.attention_choice, trunk.delta_rule_choice = saved
