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
from clef_cuda.serving.plan import GiB, parse_memory_size, plan_cache, plan_serving, shadow_run_bytes

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


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_the_plan_counts_the_bytes_the_engine_allocates(quantize):
    """Not the plan against its own formula: the tensors the engine and the trunk really hold. The KV pools and
    state slots the engine allocated are the blocks and slots the plan's figures multiply out to, to the byte;
    the int8 scratch is the one the plan counts; the vision cache budget and the shadow run's own state slot (one
    more than the pools, allocated beside them) are what the plan reserves."""
    from clef_cuda.model.footprint import tensor_bytes

    path = RELEASES["upstream-tiny"]()
    decider = Decider.from_release(path, device="cpu", progress=False, quantize=quantize)
    config = EngineConfig(max_model_len=4096, kv_fraction=0.02)
    engine = Engine(decider, config)
    cache = engine.plan
    allocated = tensor_bytes(engine.cache)
    shadow_slots = 1  # the shadow run's (its KV blocks are lent from the pool)
    assert (
        allocated
        == cache.num_blocks * cache.block_bytes
        + (cache.running_slots + cache.snapshot_slots + shadow_slots) * cache.slot_bytes
    )
    planned = plan_serving(
        path, decider.config, config, 8 * GiB, dtype=decider.trunk.dtype, quantize=quantize, on_gpu=False, where="x"
    )
    assert planned.scratch_bytes == (decider.trunk.scratch.nbytes() if quantize == "int8" else 0)
    shadow = planned.reserved_bytes - engine.vision_cache.capacity_bytes
    assert engine.vision_cache.capacity_bytes == config.vision_cache_bytes
    # Counted independently of the plan's formula: the shadow's state slot is what the engine allocated beyond
    # its pools, and its reference attention's peak at --max-model-len is measured (beyond a step's headroom).
    c = decider.config.trunk
    measured = memory_probe(
        "shadow_attention",
        str(c.num_attention_heads),
        str(c.num_key_value_heads),
        str(c.head_dim),
        str(config.max_model_len),
    )["peak"]
    slot = (
        allocated
        - cache.num_blocks * cache.block_bytes
        - (cache.running_slots + cache.snapshot_slots) * cache.slot_bytes
    )
    assert shadow >= slot + max(0, measured - planned.activation_bytes), (shadow, slot, measured)
    assert shadow == shadow_run_bytes(c, decider.trunk.dtype, config.max_model_len, planned.activation_bytes)
    # The same split on the same free figure: the engine's allocation is what plan_cache promised.
    free = int(cache.budget_bytes / config.kv_fraction) + 1
    assert plan_cache(decider.config.trunk, decider.trunk.dtype, config, free) == cache


def memory_probe(*args: str) -> dict:
    """tests/memory_probe.py in a fresh process: a measured peak of anonymous memory."""
    import json
    from pathlib import Path

    out = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "memory_probe.py"), *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("variant", ["", "expanded"])
def test_the_shadows_reference_attention_stays_within_its_plan_at_clef_flash_heads_and_16k(variant):
    """A shadow chunk's reference attention over 16k tokens of context at clef-flash's heads (16 query heads over 4 KV
    heads of 256), its peak of anonymous memory measured in a fresh process, is within what the plan reserves
    (shadow_scores_bytes: 167 MiB in fp32), and the plan is less than twice the measurement. The fault: the
    reference attention as it was, every KV head expanded to its query heads and a masked copy of every head's
    scores (1.07 GiB), is caught."""
    measured = memory_probe("shadow_attention", "16", "4", "256", "16384", *([variant] if variant else []))
    if variant == "expanded":
        assert measured["peak"] > measured["planned"], measured
        return
    assert measured["peak"] <= measured["planned"] < 2 * measured["peak"], measured


@pytest.mark.parametrize("grid", [(128, 128), (160, 256)])
def test_the_vision_towers_measured_peak_is_inside_the_plan(grid):
    """The tower over one image (16k and 40k patches: several of its 4,096-patch row chunks; large enough that
    malloc's reuse of freed memory does not hide the peak), its peak
    of anonymous memory measured in a fresh process, is within the plan's vision_peak_bytes, and the plan is no
    more than twice the measurement (a bound that could not hold if it were vacuous)."""
    from clef_cuda.model.config import VisionConfig
    from clef_cuda.serving.plan import vision_peak_bytes

    config = VisionConfig(
        depth=2,
        hidden_size=256,
        intermediate_size=1024,
        num_heads=4,
        out_hidden_size=256,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=2304,
    )
    measured = memory_probe("vision", "256", "1024", "4", "2", *map(str, grid))["peak"]
    planned = vision_peak_bytes(config, torch.float32, grid[0] * grid[1])
    assert measured <= planned <= 2 * measured, (measured, planned)


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_loadings_measured_peak_is_inside_the_plan(quantize, tmp_path):
    """Loading a 51M-parameter release on the CPU (the int8 one quantized as it streams in), its anonymous memory
    measured in a fresh process: within the plan's load peak (weights, the fused layer and quantize block at
    once, the runtime allowance), and the weights within 5% of the plan's."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "int8_table", Path(__file__).parents[1] / "benchmarks" / "int8_table.py"
    )
    int8_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(int8_table)
    path = int8_table.build("memory", tmp_path)
    measured = memory_probe("load", str(path), quantize)
    plan = plan_serving(
        path,
        load_release_config(path),
        EngineConfig(),
        8 * GiB,
        dtype=torch.float32,
        quantize=quantize,
        on_gpu=False,
        where="x",
    )
    assert measured["peak"] <= plan.load_peak_bytes, (measured, plan.load_peak_bytes)
    assert abs(measured["weights"] - plan.weight_bytes) <= 0.05 * plan.weight_bytes


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    return flash_config_release(tmp_path_factory.mktemp("flash") / "clef-flash")


def plan(flash, gib: float, dtype=torch.float16, quantize="none", vocab_tables="device", **config):
    config = EngineConfig(**config)
    memory = int(gib * GiB)
    return plan_serving(
        flash,
        load_release_config(flash),
        config,
        memory,
        dtype=dtype,
        quantize=quantize,
        on_gpu=True,
        where="x",
        vocab_tables=vocab_tables,
    )


def test_clef_flash_needs_int8_on_16_gb_cards_and_fits_in_f16_on_32_gb_ones(flash):
    f16, int8 = plan(flash, 16), plan(flash, 16, quantize="int8")
    assert not f16.fits and "loading needs" in f16.problem
    assert int8.fits and int8.cache.num_blocks * 16 >= 16384
    # The loader's count (shared/specs/memory.md's table leaves out the LM-head rows the joint head reads).
    assert 19.0e9 < f16.weight_bytes < 19.6e9 and 10.1e9 < int8.weight_bytes < 10.6e9
    assert int8.weights["vision"] == f16.weights["vision"] and int8.weights["head"] == f16.weights["head"]
    assert plan(flash, 32).fits
    big_steps = plan(flash, 16, quantize="int8", prefill_chunk_size=16384)
    assert not big_steps.fits and "activations" in big_steps.problem


# What torch reports as the cards' total capacity (their OOM messages; benchmarks/card_plans.py cites them).
RTX_3060_GIB, T4_GIB = 11.75, 14.56


def test_clef_flash_int8_on_an_rtx_3060_at_the_seeds_flags_with_the_tables_on_the_host(flash):
    """The seed's flags (4 records, --kv-fraction 0.30, 16k tokens) on the 11.75 GiB torch sees of an RTX 3060:
    not with the vocabulary tables on the device; with them in host memory, one full record of KV; the vision
    tower's peak over a 16k-token image inside the plan."""
    on_device = plan(flash, RTX_3060_GIB, quantize="int8")
    hosted = plan(flash, RTX_3060_GIB, quantize="int8", vocab_tables="host")
    assert not on_device.fits and hosted.fits, hosted.describe()
    assert hosted.weights["embeddings"] == 0 and 1.8 * GiB < hosted.host_table_bytes < 2.0 * GiB
    assert hosted.cache.num_blocks * 16 >= 16384
    assert hosted.image_patches == 65536 and 1.4 * GiB < hosted.vision_activation_bytes < 2.0 * GiB
    assert hosted.activation_bytes >= hosted.vision_activation_bytes


def test_a_t4_holds_int8_clef_flash_with_the_towers_peak_and_refuses_f16_naming_int8(flash):
    t4 = plan(flash, T4_GIB, quantize="int8")
    assert t4.fits and t4.vision_activation_bytes > t4.trunk_activation_bytes
    assert not plan(flash, T4_GIB).fits
    result = clef_serve("--w", str(flash), "--plan", "--gpu-memory", f"{T4_GIB}GiB")
    assert result.returncode == 3 and "--quantize int8" in result.stdout and "would fit" in result.stdout


def test_the_load_peak_and_the_context_are_counted_once(flash):
    """A card's total (--gpu-memory) still has the CUDA context to come out of it; a live device's free memory
    does not: planning on the same figure both ways differs by the context allowance alone."""
    from clef_cuda.serving.plan import CUDA_CONTEXT_BYTES, CUDA_WORKSPACE_BYTES

    total = plan(flash, 20, quantize="int8")
    config = EngineConfig()
    free = plan_serving(
        flash,
        load_release_config(flash),
        config,
        20 * GiB,
        dtype=torch.float16,
        quantize="int8",
        on_gpu=True,
        where="free",
        context_counted=False,
    )
    assert (
        total.overhead_bytes == CUDA_CONTEXT_BYTES + CUDA_WORKSPACE_BYTES
        and free.overhead_bytes == CUDA_WORKSPACE_BYTES
    )
    assert total.load_peak_bytes - free.load_peak_bytes == CUDA_CONTEXT_BYTES
    assert total.load_transient_bytes > 0 and "load peak" in total.describe()


def clef_serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *args], capture_output=True, text=True, timeout=timeout)


def test_the_cli_puts_the_tables_on_the_host_when_only_that_fits(flash):
    """--vocab-tables auto (the default): host when the plan does not fit with them on the device, said in the log
    and the plan; --vocab-tables device keeps them there and does not fit."""
    auto = clef_serve("--w", str(flash), "--plan", "--quantize", "int8", "--gpu-memory", f"{RTX_3060_GIB}GiB")
    assert auto.returncode == 0, auto.stdout + auto.stderr
    assert "in pinned host memory (--vocab-tables host)" in auto.stdout and "fits: yes" in auto.stdout
    device = clef_serve(
        "--w",
        str(flash),
        "--plan",
        "--quantize",
        "int8",
        "--gpu-memory",
        f"{RTX_3060_GIB}GiB",
        "--vocab-tables",
        "device",
    )
    assert device.returncode == 3 and "pinned host memory" not in device.stdout


def test_plan_exit_codes_and_the_int8_hint(flash):
    too_small = clef_serve("--w", str(flash), "--plan", "--gpu-memory", "16GiB")
    assert too_small.returncode == 3, too_small.stderr
    assert "fits: NO" in too_small.stdout and "--quantize int8 would fit" in too_small.stdout
    fits = clef_serve("--w", str(flash), "--plan", "--gpu-memory", "16GiB", "--quantize", "int8")
    assert fits.returncode == 0 and "fits: yes" in fits.stdout and "int8 scratch" in fits.stdout
    for part in ("trunk", "embeddings", "vision", "head"):
        assert part in fits.stdout


@pytest.mark.parametrize("shadow", ["off", "enforce"])
def test_a_model_that_cannot_fit_is_refused_at_start_up_in_one_line(shadow):
    """A 100M-token record: no KV cache holds it, and a shadow run's reference attention over it would need tens of
    GiB (one KV head's keys in fp32 alone): the refusal names what does not fit."""
    result = clef_serve(
        "--w", str(RELEASES["mid"]()), "--d", "cpu", "--max-model-len", "100000000", "--shadow-mode", shadow
    )
    assert result.returncode == 2, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "error" in line]
    assert line.startswith("clef-serve: error:") and "needs" in line
    assert ("KV blocks" if shadow == "off" else "what is reserved beside them") in line, line


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


@pytest.mark.parametrize(
    "capability, requested, expected, why",
    [
        ((6, 1), None, torch.float32, "1/64"),  # P40: f16 arithmetic at 1/64 of f32
        ((6, 0), None, torch.float16, None),  # P100: f16 at twice its f32 rate
        ((7, 0), None, torch.float16, None),
        ((6, 1), torch.float16, torch.float16, None),  # asked for: as asked
        ((8, 0), torch.bfloat16, torch.bfloat16, None),
    ],
)
def test_the_serving_dtype_follows_the_card(monkeypatch, capability, requested, expected, why):
    from clef_cuda.decider import serving_dtype

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a test card")
    dtype, reason = serving_dtype(torch.device("cuda:0"), requested)
    assert dtype == expected and (reason is None if why is None else why in reason)
    assert serving_dtype(torch.device("cpu")) == (torch.float32, None)


@pytest.mark.parametrize("capability", [(7, 0), (7, 5), (6, 1)])
def test_bf16_before_sm_80_is_a_one_line_error_naming_f16(monkeypatch, capability):
    """V100 and T4 have no bf16 arithmetic: refused in one line (the CLI's exit 2), naming the card and f16."""
    import logging

    from app import cli

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    monkeypatch.setattr(cli, "resolve_device", lambda text: torch.device("cuda:0"))
    args = cli.build_parser().parse_args(["--dtype", "bf16"])
    with pytest.raises(
        ValueError, match=r"--dtype bf16 needs sm_80 or newer .*Tesla V100-SXM2-16GB is sm_\d+: serve --dtype f16"
    ):
        cli.resolve_dtype(args, logging.getLogger("test"))
    args = cli.build_parser().parse_args([])
    cli.resolve_dtype(args, logging.getLogger("test"))
    assert args.dtype == ("f32" if capability == (6, 1) else "f16")
