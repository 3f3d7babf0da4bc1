"""Tensor parallel (clef_cuda.model.shard, clef_cuda.parallel.tensor_parallel) on the CPU over gloo: each rank loads
only its shard; TP=2 and TP=4 answer as one device does over the random-request corpus (chunked prefill and
prefix-cache hits included); a worker killed or hung turns /ready 503 and the server exits 5, never a hang; the
one-line refusals; the memory plan per rank."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from live import ClefServe, clef_serve_process
from parity import INT8_BOUNDS, assert_answers_match, assert_response_matches, reference_response
from random_requests import random_request
from releases import clef_ratio_release, flash_config_release, reference_model, tiny_release, tp4_release
from tp_worker_faults import ARMED_ENV, FAULT_ENV, WORKER_COMMAND, rank0_ops

from clef_cuda import Decider
from clef_cuda.errors import NumericalOverflowError
from clef_cuda.model.config import load_release_config
from clef_cuda.model.shard import Shard, local_config
from clef_cuda.model.vocab_tables import VOCAB_TABLES, VocabShard
from clef_cuda.model.weights import load_release_weights
from clef_cuda.parallel import tensor_parallel
from clef_cuda.parallel.tensor_parallel import RemoteVisionTower, StepFailedOnRank, TensorParallel
from clef_cuda.request import answers
from clef_cuda.serving.engine import Engine, EngineConfig
from clef_cuda.verification.shadow import ShadowConfig

ROOT = Path(__file__).resolve().parents[1]
TP_BOUND = 1e-5  # |p_TP - p_one device| in fp32: the partial sums add in another order, nothing else differs


def worst_difference(a: list, b: list) -> float:
    """max |p - q| over every option of every question of every request (capture_answers' lists)."""
    return max(abs(p[o] - q[o]) for x, y in zip(a, b, strict=True) for p, q in zip(x, y, strict=True) for o in p)


def nbytes(weights: dict) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values() if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_loads_its_share_of_the_trunk(size):
    """The layers' bytes split N ways (norm gains, a few KiB, replicated); the vocabulary tables by rows (the
    ranks' rows, in order, are the whole table); every rank's tensors have its local config's shapes."""
    path = tp4_release()
    config = load_release_config(path)
    whole = load_release_weights(path, config, progress=False).trunk
    layers = nbytes({k: v for k, v in whole.items() if k not in VOCAB_TABLES})
    replicated = nbytes({k: v for k, v in whole.items() if k.endswith(("norm.weight", "layernorm.weight"))})
    rows = {table: [] for table in VOCAB_TABLES}
    for rank in range(size):
        shard = load_release_weights(path, config, progress=False, shard=Shard(rank, size)).trunk
        mine = nbytes({k: v for k, v in shard.items() if k not in VOCAB_TABLES})
        assert mine == (layers - replicated) // size + replicated, (rank, mine, layers)
        for table in VOCAB_TABLES:
            assert isinstance(shard[table], VocabShard) and shard[table].shape == whole[table].shape
            assert shard[table].start == sum(part.shape[0] for part in rows[table])
            rows[table].append(shard[table].local)
        from clef_cuda.model.weights import trunk_shapes

        expected = trunk_shapes(local_config(config.trunk, size))
        for key, tensor in shard.items():
            if key not in VOCAB_TABLES:
                assert tuple(tensor.shape) == expected[key], key
    for table in VOCAB_TABLES:
        assert torch.equal(torch.cat(rows[table]), whole[table]), table


def test_ranks_on_the_cpu_share_its_cores(caplog):
    """Rank 0's intra-op threads (6 here, as on a 6-core machine) split between the ranks, workers included, while
    the group runs (every rank with the whole pool kept the others off the cores: TP=4 on 2 cores served 3.7x
    slower); rank 0's pool comes back when the group stops."""
    caplog.set_level("INFO", logger="clef_cuda.parallel.tensor_parallel")
    before = torch.get_num_threads()
    torch.set_num_threads(6)  # not twice a worker's default on the 2-core CI machine: a worker ignoring it fails
    try:
        group = TensorParallel(2)
        decider = Decider.from_release(tiny_release(), device="cpu", progress=False, tensor_parallel=group)
        try:
            assert torch.get_num_threads() == 3
            ready = [r.getMessage() for r in caplog.records if "tensor-parallel rank 1 ready" in r.getMessage()]
            assert len(ready) == 1 and ready[0].endswith(", 3 intra-op thread(s)"), ready
            request = {"model": "clef-flash", "state": "x", "questions": {"q": {"type": "noul"}}}
            assert decider.decide(request)["answers"]["q"]["type"] == "noul"  # the group serves
        finally:
            group.stop()
        assert torch.get_num_threads() == 6
    finally:
        torch.set_num_threads(before)


def capture_answers(monkeypatch) -> list[dict[str, float]]:
    """Each answered question's unrounded probabilities by option, in answer order."""
    seen: list[dict[str, float]] = []
    real = answers.answer

    def record(question, probabilities, confidence="clef"):
        seen.append(dict(probabilities))
        return real(question, probabilities, confidence)

    monkeypatch.setattr(answers, "answer", record)
    return seen


def corpus() -> list[dict]:
    """Random requests, long ones in several prefill chunks, and repeats and shared prefixes: prefix-cache hits."""
    rng = random.Random(41)
    requests = [random_request(rng, null_score_levels=False, state_words=(5, 300)) for _ in range(8)]
    shared = random_request(rng, null_score_levels=False, state_words=(120, 150))
    requests += [shared, shared, dict(shared, questions=dict(list(shared["questions"].items())[:1]))]
    return requests


def serve(
    path: Path, size: int, requests: list[dict], seen: list, shadow: ShadowConfig | None = None, **load
) -> tuple[list[dict], list, Engine]:
    shadow = shadow or ShadowConfig(mode="off")
    group = TensorParallel(size) if size > 1 else None
    decider = Decider.from_release(path, device="cpu", progress=False, tensor_parallel=group, **load)
    config = EngineConfig(
        max_model_len=4096, kv_fraction=0.02, prefill_chunk_size=128, min_snapshot_tokens=32, shadow=shadow
    )
    engine = Engine(decider, config)
    engine.start()
    try:
        bodies, probabilities = [], []
        for request in requests:
            seen.clear()
            bodies.append(engine.decide(request, timeout=300))
            probabilities.append(list(seen))
        # With the shadow on (at rate 1 in these tests), every record's verdict before the engine stops.
        stats, deadline = engine.shadow.stats, time.monotonic() + 300
        while shadow.enabled and stats.match + stats.marginal + stats.mismatch + stats.dropped < len(requests):
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
        return bodies, probabilities, engine
    finally:
        engine.stop(60)


# One device's answers by (release, requests): served once per process for every TP case compared with them.
ONE_DEVICE: dict[tuple[Path, str], tuple[list[dict], list]] = {}


def one_device_answers(path: Path, requests: list[dict], seen: list) -> tuple[list[dict], list]:
    key = (path, json.dumps(requests, sort_keys=True))
    if key not in ONE_DEVICE:
        bodies, probabilities, _ = serve(path, 1, requests, seen)
        ONE_DEVICE[key] = (bodies, probabilities)
    return ONE_DEVICE[key]


@pytest.mark.parametrize(
    ("size", "release"),
    [(2, tiny_release), (4, tp4_release), (2, tp4_release), (2, clef_ratio_release), (4, clef_ratio_release)],
)
def test_tensor_parallel_answers_equal_one_device(monkeypatch, size, release):
    seen = capture_answers(monkeypatch)
    one, p_one = one_device_answers(release(), corpus(), seen)
    many, p_many, engine = serve(release(), size, corpus(), seen)
    assert engine.prefix_cache.hits > 0  # the repeats were restored from snapshots, on every rank
    worst = worst_difference(p_one, p_many)
    assert worst <= TP_BOUND, worst
    # The rounded answers: the one-device ones, but for a value within TP_BOUND of a rounding boundary.
    for ours, theirs, unrounded in zip(many, one, p_one, strict=True):
        assert ours["usage"] == theirs["usage"] and ours["model"] == theirs["model"]
        by_question = dict(zip(theirs["answers"], unrounded, strict=True))
        assert_answers_match(ours["answers"], theirs["answers"], by_question, TP_BOUND)


@pytest.mark.parametrize("vocab_tables", ["device", "host"])
def test_images_and_vocabulary_rows_split_over_the_ranks_answer_as_one_device(monkeypatch, vocab_tables):
    """Requests with images under TP=2 on clef 27B's ratios: the tower on rank 1 (rank 0 sends the images and gets
    the features back in host memory), each rank's share of the vocabulary rows (as many as level the ranks'
    weights beside the head and the tower; in host memory too), image features in place of their tokens on rank
    0 and zeros on the other (its rows of <|image_pad|> included), the head's option rows summed over the
    ranks. A video's frame groups go the images' way (the first request carries one)."""
    import clips
    import video_oracle
    from images import data_url, png

    seen = capture_answers(monkeypatch)
    rng = random.Random(7)
    requests = []
    for seed in range(3):
        request = random_request(rng, null_score_levels=False, state_words=(5, 60))
        request["images"] = [data_url(png(64 + 32 * seed, 48, seed)) for _ in range(seed % 2 + 1)]
        requests.append(request)
    requests[0]["videos"] = [video_oracle.data_url(clips.clip("h264", 96, 64, 20, 10, seed=7))]
    release = clef_ratio_release()
    _, p_one = one_device_answers(release, requests, seen)
    _, p_two, engine = serve(release, 2, requests, seen, vocab_tables=vocab_tables)
    embed = engine.decider.trunk.embed
    assert isinstance(embed, VocabShard)
    assert isinstance(engine.decider.vision, RemoteVisionTower) and engine.weight_bytes["vision"] == 0
    assert engine.images == 4 and engine.videos == 1 and engine.vision_seconds > 0
    assert worst_difference(p_one, p_two) <= TP_BOUND


def test_the_tower_failing_on_its_rank_fails_that_request_and_the_group_serves_on(monkeypatch, tmp_path):
    """The vision tower runs out of memory on rank 1, which holds it: that request fails with the worker's error
    (StepFailedOnRank, as rank 0's own tower failing fails its request), nothing is held for it, and the next
    requests with images are answered as one device answers them."""
    from images import data_url, png

    seen = capture_answers(monkeypatch)
    rng = random.Random(8)
    requests = [
        random_request(rng, null_score_levels=False, state_words=(5, 40)) | {"images": [data_url(png(64, 48, s))]}
        for s in range(3)
    ]
    release = clef_ratio_release()
    _, p_one, _ = serve(release, 1, requests[1:], seen)
    armed = tmp_path / "armed"
    monkeypatch.setenv(ARMED_ENV, str(armed))
    worker_fault(monkeypatch, "tower_oom_once_when_armed")
    decider = Decider.from_release(release, device="cpu", progress=False, tensor_parallel=TensorParallel(2, timeout=30))
    engine = Engine(decider, EngineConfig(max_model_len=4096, kv_fraction=0.02, prefill_chunk_size=128))
    engine.start()
    try:
        armed.touch()
        with pytest.raises(StepFailedOnRank, match="out of memory"):
            engine.decide(requests[0], timeout=120)
        assert not armed.exists()  # it fired, once
        probabilities = []
        for request in requests[1:]:
            seen.clear()
            engine.decide(request, timeout=120)
            probabilities.append(list(seen))
        assert decider.trunk.peers.lost is None and len(engine.vision_cache) == 2
        assert worst_difference(p_one, probabilities) <= TP_BOUND
        no_leak(engine)
    finally:
        engine.stop(60)


def test_shadow_runs_the_reference_on_every_rank_and_matches(monkeypatch):
    """Shadow verification under TP=2 (every record): the reference ops and the MLP replays run on both ranks
    (their partial sums all-reduced), and every healthy record matches, layer by layer."""
    seen = capture_answers(monkeypatch)
    requests = corpus()[:5]
    _, _, engine = serve(tiny_release(), 2, requests, seen, shadow=ShadowConfig(rate=1.0, mode="warn"))
    stats = engine.shadow.stats
    assert (stats.match, stats.mismatch, stats.dropped) == (len(requests), 0, 0), stats


def test_calls_from_several_threads_run_one_after_another():
    """The engine thread's trunk steps and the head thread's vocabulary rows (a finished record's joint head runs
    beside the next step) call the group at once. Interleaved, one call's all-reduce was paired with another's:
    the shadow's reference pass hung at its last collective (CI, and 1 run in about 15 here under load), and
    where shapes agree a call would get the rows of another. Three threads ask for rows of three shapes."""
    import threading

    group = TensorParallel(2, timeout=10)
    decider = Decider.from_release(tiny_release(), device="cpu", progress=False, tensor_parallel=group)
    trunk = decider.trunk
    try:
        assert isinstance(trunk.lm_head, VocabShard)  # every rank holds a share: each call sums over the group
        vocab = decider.config.trunk.vocab_size
        asks = [torch.arange(n, dtype=torch.int64) * 7 % vocab for n in (3, 40, 399)]
        alone = [trunk.vocab_rows("lm_head", ids) for ids in asks]  # one thread: the rows each shape must get
        errors: list[BaseException] = []

        def ask(ids: torch.Tensor, expected: torch.Tensor) -> None:
            try:
                for _ in range(30):
                    assert torch.equal(trunk.vocab_rows("lm_head", ids), expected)
            except BaseException as error:  # noqa: BLE001 (reported by the test's thread)
                errors.append(error)

        threads = [threading.Thread(target=ask, args=pair) for pair in zip(asks, alone, strict=True)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in threads)
        assert errors == [] and group.lost is None, (errors[:1], group.lost)
    finally:
        group.stop()


PEER_THAT_LEAVES = """
import os, sys, torch
from clef_cuda.parallel.tensor_parallel import _join
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=False)
group = _join(1, 2, store, torch.device("cpu"), 30.0)
dist.all_reduce(torch.full((4, 8), 2.0), group=group)
os._exit(0)  # gone before the call's second collective
"""


def test_a_collective_whose_peer_left_fails_the_call_not_hands_back_this_ranks_share():
    """Gloo completes a collective whose peer is gone with an error and leaves the tensor as this rank's own
    share; read as done (is_completed() alone, as rank 0 did), the call went on with partial sums. Both ranks
    are real processes in a real group; rank 1 leaves after the call's first collective."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    peer = subprocess.Popen([sys.executable, "-c", PEER_THAT_LEAVES, str(store.port)], cwd=ROOT)
    lost: list[str] = []
    try:
        group = tensor_parallel._join(0, 2, store, torch.device("cpu"), 30.0)
        collectives = tensor_parallel._Collectives(group, torch.device("cpu"), 30.0, lost.append)
        schedule = [("all_reduce", (4, 8), torch.float32)] * 2
        collectives.begin("forward", schedule)
        summed = collectives.all_reduce(torch.ones(4, 8))
        assert torch.equal(summed, torch.full((4, 8), 3.0))  # 1 + 2: the group works
        assert peer.wait(30) == 0
        share = torch.ones(4, 8)
        with pytest.raises(tensor_parallel.TensorParallelLost, match=r"collective failed: Connection closed by peer"):
            collectives.all_reduce(share)
        assert len(lost) == 1 and "collective failed" in lost[0], lost
        with pytest.raises(tensor_parallel.TensorParallelLost):  # and every later collective of the group
            collectives.all_reduce(torch.ones(4, 8))
    finally:
        peer.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def no_leak(engine: Engine) -> None:
    """Idle: every running slot free, and the only KV blocks in use the prefix cache's (and a shadow run's)."""
    assert engine.running_slots.available == engine.plan.running_slots
    assert engine.blocks.used == engine.prefix_cache.blocks_held + engine.shadow.lent_blocks


def worker_fault(monkeypatch, fault: str) -> None:
    """Every worker rank started from now on runs tests/tp_worker_faults.py's `fault`."""
    monkeypatch.setattr(tensor_parallel, "WORKER_COMMAND", WORKER_COMMAND)
    monkeypatch.setenv(FAULT_ENV, fault)


@pytest.mark.parametrize(
    ("rank", "fault", "error"),
    [
        (0, "overflow_once_when_armed", NumericalOverflowError),
        (0, "oom_once_when_armed", torch.OutOfMemoryError),
        (1, "oom_once_when_armed", StepFailedOnRank),
        (1, "overflow_once_when_armed", NumericalOverflowError),
    ],
    ids=["f16-overflow-record", "rank0-oom-mid-step", "rank1-oom-mid-step", "overflow-on-rank1"],
)
def test_a_step_that_fails_on_any_rank_fails_on_every_rank_and_the_group_serves_on(
    monkeypatch, tmp_path, rank, fault, error
):
    """One step's failure, on rank 0 or on a worker, part way through its layers (an out-of-memory) or after every
    all-reduce (an overflow, raised by every rank at the same point): the rank that failed makes the rest of the
    step's collectives, so every rank finishes it in lock-step; that step's request fails with the error, and the
    group serves on: the next requests are answered as one device answers them, nothing leaked. Without the
    lock-step (a rank leaving the step at its error) the other ranks would wait in a collective until the timeout."""
    seen = capture_answers(monkeypatch)
    requests = corpus()[:3]
    _, p_one, _ = serve(tiny_release(), 1, requests, seen)
    armed = tmp_path / "armed"
    monkeypatch.setenv(ARMED_ENV, str(armed))
    if rank == 1:
        worker_fault(monkeypatch, fault)
    load = {"ops": rank0_ops(fault)} if rank == 0 else {}
    decider = Decider.from_release(
        tiny_release(), device="cpu", progress=False, tensor_parallel=TensorParallel(2, timeout=30), **load
    )
    config = EngineConfig(max_model_len=4096, kv_fraction=0.02, prefill_chunk_size=128, min_snapshot_tokens=32)
    engine = Engine(decider, config)
    engine.start()
    try:
        armed.touch()
        with pytest.raises(error):
            engine.decide(requests[0], timeout=120)
        assert not armed.exists()  # it fired, once
        probabilities = []
        for request in requests:
            seen.clear()
            engine.decide(request, timeout=120)
            probabilities.append(list(seen))
        assert engine.failed == 1 and engine.kernel_fault is None and decider.trunk.peers.lost is None
        worst = worst_difference(p_one, probabilities)
        assert worst <= TP_BOUND, worst
        no_leak(engine)
    finally:
        engine.stop(60)


def test_a_fault_on_a_worker_alone_is_caught_by_the_shadow(monkeypatch):
    """Rank 1's attention answers long records wrongly (its heads' output x 1.5 past 256 tokens of context, which its
    start-up self-check cannot see; rank 0's kernels are right): the shadow run, whose reference ops run on every
    rank, sees each long record's wrong answer and names an attention layer; the short ones match. Shadow
    verification under tensor parallel is only as good as the workers' part of it."""
    worker_fault(monkeypatch, "attention_scaled_long")
    seen = capture_answers(monkeypatch)
    requests = corpus()[:6]
    _, _, engine = serve(tiny_release(), 2, requests, seen, shadow=ShadowConfig(rate=1.0, mode="warn"))
    long = [r for r in requests if engine.decider.encode(r).num_tokens > 256]
    stats = engine.shadow.stats
    assert long and (stats.mismatch, stats.match) == (len(long), len(requests) - len(long)), stats
    assert {kind for (_, kind) in stats.mismatches_by_layer} == {"attention"}, stats.mismatches_by_layer


def test_int8_shards_stay_within_the_int8_bound(monkeypatch):
    """int8 weights quantized per shard (a row-parallel layer's scales per rank's columns): within the int8
    bound of the fp32 model, as one device's int8 is."""
    seen = capture_answers(monkeypatch)
    requests = corpus()[:4]
    _, p_f32, _ = serve(tiny_release(), 1, requests, seen)
    _, p_int8, _ = serve(tiny_release(), 2, requests, seen, quantize="int8")
    worst = worst_difference(p_f32, p_int8)
    assert 0 < worst <= INT8_BOUNDS[("upstream-tiny", "f32")], worst


# ---- the server: faults, refusals, the plan ---------------------------------------------------------------
def clef_serve(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=300, cwd=ROOT, **kwargs
    )


def test_clef_serve_over_two_ranks_answers_a_clef_27b_ratio_release_as_the_reference():
    """The whole path at TP=2 on clef 27B's ratios (the CLI, the plan, every rank's self-check and autotune, the
    engine, HTTP), a request with an image: the reference's response, by tests/parity.py's rules."""
    from images import data_url, png

    release = clef_ratio_release()
    request = random_request(random.Random(9), null_score_levels=False, state_words=(20, 80))
    request = request | {"model": "clef-flash", "images": [data_url(png(96, 64, 3))]}
    with clef_serve_process("--w", str(release), "--d", "cpu", "--tp", "2", ready_timeout=300) as (url, _, _):
        response = httpx.post(url + "/v1/systemone", json=request, timeout=120)
    assert response.status_code == 200, response.text
    assert_response_matches(response.json(), *reference_response(reference_model(release), request))


def test_the_self_check_passes_on_every_rank_when_rank_0_holds_no_vocabulary_rows():
    """int8 on clef 27B's ratios at TP=2: the tower and head outweigh a share of this small release's tables, so
    rank 0 holds none of their rows; its int8 table check has no rows to check (it crashed on an empty draw)."""
    result = clef_serve(
        "--w", str(clef_ratio_release()), "--d", "cpu", "--tp", "2", "--quantize", "int8", "--selfcheck-only"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "self-check passed" in result.stdout and "rank1.dequantize_int8.embed_rows" in result.stdout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tp", "4"], "--tensor-parallel-size 4 does not divide the model's 2 KV heads"),
        (["--tp", "3"], "--tensor-parallel-size must be one of 1, 2, 4, got 3"),
    ],
)
def test_what_cannot_shard_is_refused_in_one_line(flags, message):
    result = clef_serve("--w", str(tiny_release()), "--d", "cpu", *flags)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("clef-serve: error: ") and message in line, line


def test_variants_with_tensor_parallel_are_refused_in_one_line(tmp_path):
    from adapter_fixtures import checkpoint

    result = clef_serve("--w", str(tiny_release()), "--d", "cpu", "--tp", "2", "--adapter", f"all={checkpoint('all')}")
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "LoRA variants" in line and "--tensor-parallel-size 1" in line


def test_the_plan_per_rank_fits_clef_flash_in_f16_on_two_16_gb_cards(tmp_path):
    """The seed's flags, f16, two cards of 16 GiB: at least 16k KV tokens a record, rank 1 (which holds the
    tower) holding rank 0's cache too; one such card alone does not hold clef-flash in f16."""
    release = flash_config_release(tmp_path / "flash")
    seed = ["--max-num-seqs", "4", "--kv-fraction", "0.30", "--max-model-len", "16384", "--dtype", "f16"]
    two = clef_serve("--w", str(release), "--plan", "--gpu-memory", "16GiB", "--tp", "2", *seed, "--d", "cpu")
    assert two.returncode == 0, two.stdout + two.stderr
    assert "rank 0 of 2 such cards" in two.stdout and "fits: yes" in two.stdout
    assert re.search(r"^  rank 1 .* rank 0's cache fits", two.stdout, re.MULTILINE), two.stdout
    # the balance line: who holds the head and the tower, every rank's share of the vocabulary rows
    assert re.search(r"rank 1 the vision tower; the 248,320 vocabulary rows .*: [\d,]+ / [\d,]+$", two.stdout, re.M)
    (tokens,) = re.findall(r"= (\d+) tokens \(", two.stdout)
    assert int(tokens) >= 16384, two.stdout
    one = clef_serve("--w", str(release), "--plan", "--gpu-memory", "16GiB", *seed, "--d", "cpu")
    assert one.returncode == 3, one.stdout


def start_server(*flags: str, faults: dict[str, str] | None = None) -> ClefServe:
    """clef-serve over two ranks on the tiny release (tests/live.py's launcher; `faults`: its test-only hooks)."""
    return ClefServe("--w", str(tiny_release()), "--d", "cpu", "--tp", "2", *flags, faults=faults)


def test_a_killed_worker_turns_ready_503_and_the_server_exits_5():
    server = start_server()
    try:
        server.assert_ready(240)
        request = {
            "model": "clef-flash",
            "state": "disk full on db-1",
            "questions": {"q": {"type": "noul", "instructions": "Down?"}},
        }
        assert httpx.post(server.url + "/v1/systemone", json=request, timeout=60).status_code == 200
        (worker,) = server.workers()
        worker.kill()
        statuses = []
        deadline = time.monotonic() + 10
        while server.process.poll() is None and time.monotonic() < deadline:
            try:
                statuses.append(httpx.get(server.url + "/ready", timeout=1).status_code)
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        assert server.process.wait(10) == 5
        assert 503 in statuses and 200 not in statuses[statuses.index(503) :], statuses
        assert "tensor-parallel rank 1 exited" in server.text()
    finally:
        server.kill()


def test_a_hung_worker_fails_the_step_within_the_timeout_and_the_server_exits_5():
    """A worker stopped (SIGSTOP: alive, answering nothing): the next step's collective outlasts
    --tensor-parallel-timeout, the request gets a 503 with the contract's body, counted, /ready 503, exit 5;
    never a hang."""
    server = start_server("--tensor-parallel-timeout", "3s")
    worker = None
    try:
        server.assert_ready(240)
        (worker,) = server.workers()
        os.kill(worker.pid, signal.SIGSTOP)
        request = {
            "model": "clef-flash",
            "state": "disk full on db-1",
            "questions": {"q": {"type": "noul", "instructions": "Down?"}},
        }
        started = time.monotonic()
        response = httpx.post(server.url + "/v1/systemone", json=request, timeout=60)
        assert response.status_code == 503 and time.monotonic() - started < 3 + 10, response.text
        detail = response.json()["detail"]
        assert detail["error_type"] == "service_unavailable" and "tensor-parallel" in detail["message"], detail
        metrics = httpx.get(server.url + "/metrics", timeout=5).text
        assert 'clef_requests_total{status="503"} 1.0' in metrics
        ready = httpx.get(server.url + "/ready", timeout=5)
        assert ready.status_code == 503 and "tensor-parallel" in ready.json()["detail"]["message"]
        assert server.process.wait(30) == 5
    finally:
        if worker is not None and worker.is_running():
            worker.kill()
        server.kill()


def test_a_worker_killed_before_the_rendezvous_takes_the_server_down_within_seconds_and_every_rank_with_it():
    """A worker of three that dies while the ranks load (here: hung in its load, then killed): the server does not
    wait for a rendezvous that cannot happen; /ready says why, the process exits 5 within 15 s of the death
    (was 600 s in the TCPStore, then kept alive 'failed'), and the other two workers are gone with it."""
    server = ClefServe("--w", str(tp4_release()), "--d", "cpu", "--tp", "4", faults={FAULT_ENV: "hang_at_start"})
    try:
        deadline = time.monotonic() + 120
        while len(workers := server.workers()) < 3:
            assert time.monotonic() < deadline and server.process.poll() is None, server.text()
            time.sleep(0.1)
        workers[1].kill()
        killed = time.monotonic()
        assert server.process.wait(30) == 5
        assert server.exited_at is not None and server.exited_at - killed <= 15
        psutil.wait_procs(workers, timeout=10)
        assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
        assert "tensor-parallel rank" in server.text()
    finally:
        server.kill()


def test_a_sticky_fault_on_a_worker_is_recorded_and_the_restart_runs_without_that_kernel(tmp_path):
    """rms_norm_rope leaves a sticky CUDA error on rank 1 (test-only, once armed): the worker names the kernel before
    it exits; the request gets 503, the server records the kernel in its autotune cache and exits 4 (not 5: a
    restart must skip the kernel, not just restart the ranks); the next start runs every rank without it."""
    from clef_cuda.lifecycle import EXIT_KERNEL_FAULT

    armed, cache = tmp_path / "armed", tmp_path / "autotune"
    faults = {FAULT_ENV: "sticky_when_armed", ARMED_ENV: str(armed)}
    request = {"model": "clef-flash", "state": "disk full on db-1", "questions": {"q": {"type": "noul"}}}
    server = start_server("--autotune-cache", str(cache), faults=faults)
    try:
        server.assert_ready(240)
        armed.touch()
        response = httpx.post(server.url + "/v1/systemone", json=request, timeout=60)
        assert response.status_code == 503 and "rms_norm_rope" in response.json()["detail"]["message"], response.text
        assert server.process.wait(30) == EXIT_KERNEL_FAULT
    finally:
        server.kill()
    (path,) = cache.glob("autotune-*.json")
    assert "rms_norm_rope:cpu" in json.loads(path.read_text())["report"]["failures"]
    server = start_server("--autotune-cache", str(cache), faults=faults)
    try:
        server.assert_ready(240)
        assert httpx.post(server.url + "/v1/systemone", json=request, timeout=60).status_code == 200
    finally:
        server.stop(60)


def test_sigterm_drains_and_stops_every_rank():
    server = start_server()
    try:
        server.assert_ready(240)
        (worker,) = server.workers()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0
        worker.wait(30)  # the worker exited too (psutil raises TimeoutExpired if not)
    finally:
        server.kill()


def test_the_corpus_has_prefix_hits_for_the_parity_test():
    assert json.dumps(corpus()[8]) == json.dumps(corpus()[9])
