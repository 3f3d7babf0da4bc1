"""The memory plan (clef_cuda.serving.plan, clef-serve --plan): its weight figures against real loads of
the test releases, clef-flash's figures on the cards people own, the exit codes, the start-up refusal of a
model that cannot fit (naming the numbers and whether int8 would fit), bad --gpu-memory values, and the
resident weights in /metrics."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from releases import clef_config_release, flash_config_release, mid_release, tiny_release

from clef_cuda import Decider
from clef_cuda.model.config import load_release_config
from clef_cuda.model.default_model import default_release
from clef_cuda.model.footprint import planned_weights
from clef_cuda.serving.engine import Engine, EngineConfig
from clef_cuda.serving.plan import (
    GiB,
    auto_vocab_tables,
    delta_rule_workspace_bytes,
    parse_memory_size,
    plan_cache,
    plan_serving,
    plan_tensor_parallel,
    shadow_run_bytes,
    step_activation_bytes,
)

ROOT = Path(__file__).resolve().parents[1]

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
    # --vocab-tables auto: a card whose cache is as large as the running records can use keeps the tables on it;
    # one whose cache grows with them in host memory sends them there.
    roomy = plan(flash, 80, vocab_tables="device"), plan(flash, 80, vocab_tables="host")
    assert roomy[0].cache.num_blocks == roomy[1].cache.num_blocks and auto_vocab_tables(*roomy) == (roomy[0], None)
    tight = plan(flash, 32, vocab_tables="device"), plan(flash, 32, vocab_tables="host")
    assert tight[1].cache.num_blocks > tight[0].cache.num_blocks and auto_vocab_tables(*tight)[0] is tight[1]


# What torch reports as the cards' total capacity (their OOM messages; benchmarks/card_plans.py cites them).
RTX_3060_GIB, T4_GIB = 11.75, 14.56
V100_16_GIB, V100_32_GIB, L4_GIB = 15.77, 31.73, 22.03


@pytest.fixture(scope="module")
def clef(tmp_path_factory):
    return clef_config_release(tmp_path_factory.mktemp("clef") / "clef")


def test_clef_27b_has_its_published_parameter_counts(clef):
    """tests/fixtures/clef-27b against the published counts: the decoder layers (and the final norm), each of
    the two vocabulary tables, the joint head."""
    from clef_cuda.model.weights import head_shapes, trunk_shapes

    config = load_release_config(clef)
    count = {name: torch.Size(shape).numel() for name, shape in trunk_shapes(config.trunk).items()}
    tables = ("embed_tokens.weight", "lm_head.weight")
    assert sum(n for name, n in count.items() if name not in tables) == 24_353_201_664
    assert [count[t] for t in tables] == [1_271_398_400, 1_271_398_400]
    assert sum(torch.Size(s).numel() for s in head_shapes(config.head).values()) == 128_056_324
    assert config.trunk.attention_layers == tuple(range(3, 64, 4))


SEED_FLAGS = dict(max_num_seqs=4, kv_fraction=0.30, prefill_chunk_size=1024)  # and 16k-token records
HOSTED_IMAGE_PIXELS = 1_048_576  # the hosted API's image size (shared/specs/vision.md)


def ranks(release, gib: float, size: int, quantize="none", vocab_tables="device", image_max_pixels=None, **config):
    """The plan over `size` cards of `gib` (rank 0's, the others' in other_ranks), at the seed's flags but for
    `config`."""
    return plan_tensor_parallel(
        release,
        load_release_config(release),
        EngineConfig(**(SEED_FLAGS | config)),
        int(gib * GiB),
        size,
        dtype=torch.float16,
        quantize=quantize,
        on_gpu=True,
        where="x",
        vocab_tables=vocab_tables,
        image_max_pixels=image_max_pixels,
    )


def balance(plan) -> float:
    """What rank 0 needs before its cache over what the most loaded other rank does."""
    return plan.needed_bytes / max(other.needed_bytes for other in plan.other_ranks)


def test_operations_md_gives_clef_27b_trunk_as_the_plan_holds_it(clef):
    """docs/operations.md's clef 27B sentence: the trunk in f16 and int8 on one card, and a --tp 2 rank's (it once
    gave the ranks' figures, 22.7 / 11.4 GiB, as the whole trunk's), each to the 0.1 GiB it prints."""
    import dataclasses

    from clef_cuda.model.shard import local_config

    text = (ROOT / "docs" / "operations.md").read_text()
    found = re.search(
        r"holds ([\d.]+) GiB of trunk in f16 \(([\d.]+) GiB in int8; each of two `--tp 2` ranks half of\s+that, "
        r"([\d.]+) and ([\d.]+) GiB\)",
        text,
    )
    assert found, "operations.md's clef 27B trunk sentence"
    config = load_release_config(clef)
    rank_config = dataclasses.replace(config, trunk=local_config(config.trunk, 2))
    figures = [
        planned_weights(config, torch.float16)["trunk"],
        planned_weights(config, torch.float16, "int8")["trunk"],
        planned_weights(rank_config, torch.float16, rank=0, ranks=2)["trunk"],
        planned_weights(rank_config, torch.float16, "int8", rank=0, ranks=2)["trunk"],
    ]
    assert [float(g) for g in found.groups()] == [round(b / 2**30, 1) for b in figures]


def test_clef_27b_balanced_over_its_ranks_on_the_cards_people_own(clef):
    """The seed's flags: rank 0 holds the head, the last rank the tower, and the vocabulary rows level the rest,
    rank 0 within 1.15x of the other ranks; every rank holds rank 0's cache. Two 24 GB cards hold clef 27B in
    int8 with 16k tokens a record; two 32 GB V100s in f16 (more KV with the tables in host memory, which
    --vocab-tables auto then picks: as many as before the tables were split); four 16 GB V100s in f16."""
    two_l4 = ranks(clef, L4_GIB, 2, "int8")
    assert two_l4.fits and two_l4.cache.num_blocks * 16 >= 16384, two_l4.describe()
    assert balance(two_l4) <= 1.15
    (rank1,) = two_l4.other_ranks
    assert rank1.vocab_rows[0] == two_l4.vocab_rows[1] > 0 and rank1.vocab_rows[1] == 248_320
    assert two_l4.weights["vision"] == rank1.weights["head"] == 0 < min(rank1.weights["vision"], two_l4.weights["head"])
    assert rank1.weights["trunk"] == two_l4.weights["trunk"] and rank1.cache == two_l4.cache
    two_v100 = ranks(clef, V100_32_GIB, 2)
    hosted = ranks(clef, V100_32_GIB, 2, vocab_tables="host")
    assert two_v100.fits and hosted.fits and balance(two_v100) <= 1.15
    assert hosted.cache.num_blocks * 16 >= 41_472 > two_v100.cache.num_blocks * 16 >= 16384
    chosen, why = auto_vocab_tables(two_v100, hosted)
    assert chosen is hosted and why.startswith("the cache holds"), why
    four = ranks(clef, V100_16_GIB, 4)
    assert four.fits and four.cache.num_blocks * 16 >= 21_600 and balance(four) <= 1.15, four.describe()
    assert len(four.other_ranks) == 3 and all(other.fits for other in four.other_ranks)
    assert four.other_ranks[2].weights["vision"] > 0 and four.other_ranks[2].vision_activation_bytes > 0


def test_clef_27b_in_int8_fits_two_16_gb_v100s_at_the_seeds_flags_with_the_tower_beside_rank_0(clef, monkeypatch):
    """Each rank holds 11.4 GiB of int8 trunk, 0.17 GiB of scratch and 0.75 GiB of CUDA overhead; rank 0's cache
    for one 16k-token record (1,024 blocks of 512 KiB and 4 state slots of 73 MiB) at --kv-fraction 0.30 needs
    2.6 GiB free on rank 0. The tables on the cards leave too little (what auto sees); in host memory, with the
    head on rank 0 and the tower on rank 1, rank 0 has that room and rank 1 holds the cache beside the tower's
    step for a 16-megapixel image. With the tower on rank 0 as before, it does not fit."""
    on_cards = ranks(clef, V100_16_GIB, 2, "int8")
    hosted = ranks(clef, V100_16_GIB, 2, "int8", "host")
    assert not on_cards.fits and auto_vocab_tables(on_cards, hosted) == (hosted, "the plan fits only so")
    assert hosted.fits and hosted.cache.num_blocks * 16 >= 16384 and balance(hosted) <= 1.15, hosted.describe()
    (rank1,) = hosted.other_ranks
    assert rank1.image_patches == 65536 and rank1.weights["vision"] > 0 == hosted.weights["vision"]
    import clef_cuda.model.footprint as footprint
    import clef_cuda.serving.plan as plan_module

    for module in (footprint, plan_module):
        monkeypatch.setattr(module, "tower_rank", lambda size: 0)
    assert not ranks(clef, V100_16_GIB, 2, "int8", "host").fits


# the upstream tiny release has a tower


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
    assert serving_dtype(torch.device("cpu"))[0] == torch.float32  # its line: tests/test_cpu_isa.py


@pytest.mark.parametrize("capability", [(7, 0), (7, 5), (6, 1)])
def test_bf16_before_sm_80_is_a_one_line_error_naming_f16(monkeypatch, capability):
    """V100 and T4 have no bf16 arithmetic: refused in one line (the CLI's exit 2), naming the card and f16."""
    from app.cli import engine
    from app.cli.flags import build_parser

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    monkeypatch.setattr(engine, "resolve_device", lambda text: torch.device("cuda:0"))
    args = build_parser().parse_args(["--dtype", "bf16"])
    with pytest.raises(
        ValueError, match=r"--dtype bf16 needs sm_80 or newer .*Tesla V100-SXM2-16GB is sm_\d+: serve --dtype f16"
    ):
        engine.resolve_dtype(args)
    args = build_parser().parse_args([])
    engine.resolve_dtype(args)
    assert args.dtype == ("f32" if capability == (6, 1) else "f16")


def test_the_plan_counts_the_chunked_delta_rules_workspace():
    """A step's delta net holds the chunked kernel's workspace in f16 and bf16 (the dtypes it runs), sized as the
    kernel's own gdr_chunked_workspace (csrc/gated_delta_rule/gated_delta_rule.h, compiled into a probe) sizes it,
    up to its 256-byte alignment of six regions; nothing in fp32."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_archs", ROOT / "scripts" / "check_archs.py")
    check_archs = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = check_archs
    spec.loader.exec_module(check_archs)
    probe = r"""
#include <cstdio>
#include <cstdlib>
#include "gated_delta_rule/gated_delta_rule.h"
int main(int, char** argv) {
  std::printf("%lld\n", static_cast<long long>(clef::gdr_chunked_workspace(std::atoll(argv[1]), std::atoi(argv[2]),
                                                                           16, 32, 128, 2).bytes));
}
"""
    flash = load_release_config(flash_config_release(ROOT / ".cache" / "plan-flash")).trunk
    for tokens, sequences in ((2048, 1), (1000, 3), (8192, 4)):
        kernel = int(check_archs.host_probe(probe, str(tokens), str(sequences)))
        ours = delta_rule_workspace_bytes(flash, torch.float16, tokens, sequences)
        assert 0 <= kernel - ours <= 6 * 256, (tokens, sequences, kernel, ours)
        residual = 3 * tokens * flash.hidden_size * 4
        assert step_activation_bytes(flash, torch.bfloat16, tokens, sequences) >= residual + ours  # counted in a step
    assert delta_rule_workspace_bytes(flash, torch.float32, 2048) == 0
    # clef-flash at 2,048 tokens, 33 chunk tiles: about 75 MiB (W and U 33 MiB, a state per chunk 33 MiB, keys 8 MiB)
    assert 70 * 2**20 < delta_rule_workspace_bytes(flash, torch.float16, 2048) < 80 * 2**20


# ---- restored (lost in a01c80d): the cards a 16 GB plan leaves out, the CLI's exits, sizes, the metrics ----------
def test_clef_flash_int8_on_an_rtx_3060_at_the_seeds_flags_with_the_tables_on_the_host(flash):
    """The seed's flags (4 records, --kv-fraction 0.30, 16k tokens) on the 11.75 GiB torch sees of an RTX 3060:
    not with the vocabulary tables on the device; with them in host memory, one full record of KV; the vision
    tower's peak over a 16k-token image inside the plan."""
    seed = dict(max_num_seqs=4, kv_fraction=0.30, prefill_chunk_size=1024)
    on_device = plan(flash, RTX_3060_GIB, quantize="int8", **seed)
    hosted = plan(flash, RTX_3060_GIB, quantize="int8", vocab_tables="host", **seed)
    assert not on_device.fits and hosted.fits, hosted.describe()
    assert hosted.weights["embeddings"] == 0 and 1.8 * GiB < hosted.host_table_bytes < 2.0 * GiB
    assert hosted.cache.num_blocks * 16 >= 16384
    assert hosted.image_patches == 65536 and 1.0 * GiB < hosted.vision_activation_bytes < 2.0 * GiB
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
    free = plan_serving(
        flash,
        load_release_config(flash),
        EngineConfig(),
        20 * GiB,
        dtype=torch.float16,
        quantize="int8",
        on_gpu=True,
        where="free",
        context_counted=False,
    )
    assert total.overhead_bytes == CUDA_CONTEXT_BYTES + CUDA_WORKSPACE_BYTES
    assert free.overhead_bytes == CUDA_WORKSPACE_BYTES
    assert total.load_peak_bytes - free.load_peak_bytes == CUDA_CONTEXT_BYTES
    assert total.load_transient_bytes > 0 and "load peak" in total.describe()


def clef_serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *args], capture_output=True, text=True, timeout=timeout)


def test_the_cli_puts_the_tables_on_the_host_when_only_that_fits(flash):
    """--vocab-tables auto (the default): host when the plan does not fit with them on the device, said in the plan;
    --vocab-tables device keeps them there and does not fit (exit 3)."""
    auto = clef_serve("--w", str(flash), "--plan", "--quantize", "int8", "--gpu-memory", f"{RTX_3060_GIB}GiB")
    assert auto.returncode == 0, auto.stdout + auto.stderr
    assert "in pinned host memory (--vocab-tables host)" in auto.stdout and "fits: yes" in auto.stdout
    device = clef_serve(
        *("--w", str(flash), "--plan", "--quantize", "int8", "--gpu-memory", f"{RTX_3060_GIB}GiB"),
        *("--vocab-tables", "device"),
    )
    assert device.returncode == 3 and "pinned host memory" not in device.stdout


def test_plan_exit_codes_and_the_int8_hint(flash):
    too_small = clef_serve("--w", str(flash), "--plan", "--gpu-memory", "16GiB")
    assert too_small.returncode == 3, too_small.stderr
    assert "fits: NO" in too_small.stdout and "--quantize int8 would fit" in too_small.stdout
    fits = clef_serve("--w", str(flash), "--plan", "--gpu-memory", "16GiB", "--quantize", "int8")
    assert fits.returncode == 0 and "fits: yes" in fits.stdout and "int8 scratch" in fits.stdout
    assert "float16 activations" in fits.stdout  # the card named: a GPU's default, whatever this machine serves
    for part in ("trunk", "vision", "head"):
        assert part in fits.stdout
    # the tables: among the weights, or (--vocab-tables auto, where the cache grows) in host memory
    assert "embeddings" in fits.stdout or "vocab tables" in fits.stdout


@pytest.mark.parametrize("shadow", ["off", "enforce"])
def test_a_model_that_cannot_fit_is_refused_at_start_up_in_one_line(shadow):
    """A 100M-token record: no KV cache holds it, and a shadow run's reference attention over it would need tens of
    GiB (one KV head's keys in fp32 alone): the refusal names what does not fit."""
    result = clef_serve(
        "--w",
        str(RELEASES["mid"]()),
        "--d",
        "cpu",
        "--max-model-len",
        "100000000",
        "--allow-long-context",
        *("--shadow-mode", shadow),
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
    assert parse_memory_size("1.5 GiB") == 3 * 2**29 and parse_memory_size("2kb") == 2000


def test_resident_weights_are_exported_by_part():
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from app.server import ServerSettings, create_app

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


@pytest.mark.parametrize("cap_pixels_per_frame", [False, True])
def test_the_plan_sizes_the_tower_for_the_largest_frame_group_a_clip_can_make(tmp_path, cap_pixels_per_frame):
    """A release whose video budget outgrows its image budget (4x here): the tower's step is planned for the largest
    group of frames a clip can give, which a 2-frame clip at a large size reaches (its pixel budget over the fewest
    frames a clip resizes for, or the per-frame cap where the release sets cap_pixels_per_frame), within 10% (the
    resize rounds to whole 32-pixel blocks); more frames give smaller groups. The decider says the same (the engine
    batches the tower's inputs up to Decider.tower_patches)."""
    import json
    import shutil

    import clips
    from releases import tiny_release

    from clef_cuda import Decider

    release = tmp_path / "release"
    shutil.copytree(tiny_release(), release)
    processor = json.loads((release / "processor_config.json").read_text())
    image_budget = processor["image_processor"]["size"]["longest_edge"]
    video = processor["video_processor"]
    video["size"]["longest_edge"] = 4 * image_budget
    video["cap_pixels_per_frame"] = cap_pixels_per_frame
    video["max_video_tokens"] = 1024  # capped: 1,024 tokens of 32 x 32 pixels a frame, under the budget over 2
    (release / "processor_config.json").write_text(json.dumps(processor))
    decider = Decider.from_release(release, device="cpu", progress=False)
    planned = plan_serving(
        release,
        load_release_config(release),
        EngineConfig(kv_fraction=0.05),
        16 * GiB,
        dtype=torch.float32,
        on_gpu=False,
        where="x",
    )
    # The budget over 2 frames (or the cap per frame); a patch spans the group's 2 frames.
    expected = (1024 * 32 * 32 if cap_pixels_per_frame else 4 * image_budget // 2) // 16**2
    assert planned.image_patches == decider.tower_patches == expected > image_budget // 16**2
    largest = {}
    for count in (2, 3, 4):
        blob = clips.clip("h264", 2560, 1440, count=count, fps=2, seed=count)
        (prepared,) = decider.prepare_videos([(blob, "mp4")])
        largest[count] = max(group.num_patches for group in prepared.groups)
    assert expected * 0.9 <= largest[2] <= expected, (largest, expected)
    assert largest[4] <= largest[3] <= largest[2], largest
