"""The memory plan (clef_cuda.serving.plan, clef-serve --plan): its weight figures against real loads of
the test releases, clef-flash's figures on the cards people own, the exit codes, the start-up refusal of a
model that cannot fit (naming the numbers and whether int8 would fit), bad --gpu-memory values, and the
resident weights in /metrics."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from releases import flash_config_release, mid_release, tiny_release

from app.server import ServerSettings, create_app
from clef_cuda import Decider
from clef_cuda.model.config import load_release_config
from clef_cuda.model.default_model import default_release
from clef_cuda.model.footprint import planned_weights
from clef_cuda.serving.engine import Engine, EngineConfig
from clef_cuda.serving.plan import GiB, parse_memory_size, plan_cache, plan_serving

RELEASES = {"upstream-tiny": tiny_release, "mid": mid_release, "clef-tiny": default_release}


@pytest.mark.parametrize("release", sorted(RELEASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_the_planned_weights_match_a_real_load_within_5_percent(release, dtype, quantize):
    path = RELEASES[release]()
    planned = planned_weights(load_release_config(path), dtype, quantize)
    loaded = Decider.from_release(path, device="cpu", dtype=dtype, progress=False, quantize=quantize).weight_bytes()
    assert set(planned) == set(loaded)
    for part in planned:
        assert abs(planned[part] - loaded[part]) <= 0.05 * max(loaded[part], 1), (part, planned, loaded)


def test_the_planned_cache_is_the_one_the_engine_allocates():
    decider = Decider.from_release(RELEASES["mid"](), device="cpu", progress=False)
    config = EngineConfig(max_model_len=4096, kv_fraction=0.02)
    engine = Engine(decider, config)
    # The engine split kv_fraction of what was free; the same function on that figure gives the same plan.
    free = int(engine.plan.budget_bytes / config.kv_fraction) + 1
    assert plan_cache(decider.config.trunk, decider.trunk.dtype, config, free) == engine.plan


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    return flash_config_release(tmp_path_factory.mktemp("flash") / "clef-flash")


def plan(flash, gib: float, dtype=torch.float16, quantize="none", **config):
    config = EngineConfig(**config)
    memory = int(gib * GiB)
    return plan_serving(
        flash, load_release_config(flash), config, memory, dtype=dtype, quantize=quantize, on_gpu=True, where="x"
    )


def test_clef_flash_needs_int8_on_16_gb_cards_and_fits_in_f16_on_32_gb_ones(flash):
    f16, int8 = plan(flash, 16), plan(flash, 16, quantize="int8")
    assert not f16.fits and "the weights" in f16.problem
    assert int8.fits and int8.cache.num_blocks * 16 >= 16384
    # The loader's count (shared/specs/memory.md's table leaves out the LM-head rows the joint head reads).
    assert 19.0e9 < f16.weight_bytes < 19.6e9 and 10.1e9 < int8.weight_bytes < 10.6e9
    assert int8.weights["vision"] == f16.weights["vision"] and int8.weights["head"] == f16.weights["head"]
    assert plan(flash, 32).fits
    # 12 GB (RTX 3060): int8 with fewer running records and more of the rest for the cache.
    assert not plan(flash, 12, quantize="int8").fits
    assert plan(flash, 12, quantize="int8", max_num_seqs=2, kv_fraction=0.7).fits
    big_steps = plan(flash, 16, quantize="int8", prefill_chunk_size=16384)
    assert not big_steps.fits and "activations" in big_steps.problem


def clef_serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *args], capture_output=True, text=True, timeout=timeout)


def test_plan_exit_codes_and_the_int8_hint(flash):
    too_small = clef_serve("--w", str(flash), "--plan", "--gpu-memory", "16GiB")
    assert too_small.returncode == 3, too_small.stderr
    assert "fits: NO" in too_small.stdout and "--quantize int8 would fit" in too_small.stdout
    fits = clef_serve("--w", str(flash), "--plan", "--gpu-memory", "16GiB", "--quantize", "int8")
    assert fits.returncode == 0 and "fits: yes" in fits.stdout and "int8 scratch" in fits.stdout
    for part in ("trunk", "embeddings", "vision", "head"):
        assert part in fits.stdout


def test_a_model_that_cannot_fit_is_refused_at_start_up_in_one_line():
    result = clef_serve("--w", str(RELEASES["mid"]()), "--d", "cpu", "--max-model-len", "100000000")
    assert result.returncode == 2, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "error" in line]
    assert line.startswith("clef-serve: error:") and "needs" in line and "KV blocks" in line


@pytest.mark.parametrize("value", ["lots", "16 GiB of it", "-3GB", "0"])
def test_a_bad_gpu_memory_value_is_a_one_line_error(value):
    result = clef_serve("--plan", f"--gpu-memory={value}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("clef-serve: error: --gpu-memory:")
    with pytest.raises(ValueError, match="not a memory size"):
        parse_memory_size(value)


def test_memory_sizes_parse_in_every_unit():
    assert parse_memory_size("16GiB") == 16 * 2**30 and parse_memory_size("12 GB") == 12 * 10**9
    assert parse_memory_size("512mib") == 2**29 and parse_memory_size("1000") == 1000


def test_resident_weights_are_exported_by_part():
    decider = Decider.from_release(RELEASES["upstream-tiny"](), device="cpu", progress=False, quantize="int8")
    engine = Engine(decider, EngineConfig(max_model_len=4096, kv_fraction=0.02))
    with TestClient(create_app(ServerSettings(), engine=engine)) as client:
        text = client.get("/metrics").text
    samples = {
        s.labels["part"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "clef_weight_bytes"
    }
    assert set(samples) == {"trunk", "embeddings", "vision", "head", "adapters"}
    assert samples == {**decider.weight_bytes(), "adapters": 0.0}
    assert samples["vision"] > 0  # the upstream tiny release has a tower
