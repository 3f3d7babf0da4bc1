"""Long records (issue 69): the release's trained context is the ceiling of a record's length."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import threading

import httpx
import pytest
from live import PausingEngine, live_server
from releases import flash_config_release, tiny_release

from app.server import ServerSettings
from clef_cuda import Decider
from clef_cuda.errors import RequestTooLongError
from clef_cuda.model.config import DEFAULT_MAX_MODEL_LEN, context_length, load_release_config
from clef_cuda.serving.engine import Engine, EngineConfig

TRAINED = 4096  # clef_finetune.tiny's text_config.max_position_embeddings


def clef_serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def tiny():
    return Decider.from_release(tiny_release(), device="cpu", progress=False)


def test_the_release_declares_the_positions_it_was_trained_to():
    trunk = load_release_config(tiny_release()).trunk
    assert trunk.max_position_embeddings == TRAINED
    assert context_length(trunk, None) == min(DEFAULT_MAX_MODEL_LEN, TRAINED)
    assert context_length(trunk, TRAINED) == TRAINED
    over = rf"--max-model-len {TRAINED + 1} is over .*max_position_embeddings \({TRAINED}\)"
    with pytest.raises(ValueError, match=over):
        context_length(trunk, TRAINED + 1)
    assert context_length(trunk, 4 * TRAINED, allow_long_context=True) == 4 * TRAINED


def test_a_decider_and_an_engine_default_to_the_release_limit_and_refuse_past_it(tiny, caplog):
    """No budget asked for: the release's 4096 (not the reference's 16384, past what it was trained on); a larger
    one raises naming both numbers, or with allow_long_context is served with a warning."""
    assert tiny.options.max_length == TRAINED
    assert Engine(tiny, EngineConfig(kv_fraction=0.02)).config.max_model_len == TRAINED
    with pytest.raises(ValueError, match=f"{2 * TRAINED}.*{TRAINED}"):
        Engine(tiny, EngineConfig(max_model_len=2 * TRAINED, kv_fraction=0.02))
    with pytest.raises(ValueError, match=f"{2 * TRAINED}.*{TRAINED}"):
        Decider(tiny.config, tiny.trunk, tiny.head, tiny.tokenizer, type(tiny.options)(max_length=2 * TRAINED))
    with caplog.at_level(logging.WARNING, logger="clef_cuda.decider"):
        options = type(tiny.options)(max_length=2 * TRAINED, allow_long_context=True)
        long = Decider(tiny.config, tiny.trunk, tiny.head, tiny.tokenizer, options)
    assert long.options.max_length == 2 * TRAINED
    assert any("extrapolation" in r.getMessage() and f"{TRAINED} positions" in r.getMessage() for r in caplog.records)


def test_a_record_past_the_release_limit_is_refused_naming_both_numbers_as_it_is_encoded(tiny):
    """Encoding is the first work a record sees (before a queue place's prefill): the 413's error."""
    engine = Engine(tiny, EngineConfig(kv_fraction=0.02))
    request = {"model": "clef-flash", "state": "x " * TRAINED, "questions": {"q": {"type": "noul"}}}
    with pytest.raises(RequestTooLongError) as info:
        engine.encode(request)
    assert info.value.max_tokens == TRAINED and info.value.input_tokens > TRAINED
    assert f"{info.value.input_tokens} tokens" in str(info.value) and f"{TRAINED} tokens" in str(info.value)


def test_clef_serve_refuses_a_max_model_len_past_the_release_unless_allowed():
    release = str(tiny_release())
    refused = clef_serve("--w", release, "--d", "cpu", "--plan", "--max-model-len", str(2 * TRAINED))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    (line,) = refused.stderr.strip().splitlines()[-1:]
    assert line.startswith("clef-serve: error: --max-model-len 8192 is over") and f"({TRAINED})" in line, line
    allowed = clef_serve(
        "--w", release, "--d", "cpu", "--plan", "--max-model-len", str(2 * TRAINED), "--allow-long-context"
    )
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert "extrapolation" in allowed.stderr and f"records of {2 * TRAINED}" in allowed.stdout
    default = clef_serve("--w", release, "--d", "cpu", "--plan")
    assert default.returncode == 0 and f"records of {TRAINED})" in default.stdout, default.stdout


def test_a_prefill_in_progress_shows_in_status_with_its_request_id_and_tokens(tiny):
    engine = PausingEngine(tiny, EngineConfig(kv_fraction=0.02, prefill_chunk_size=64))
    request = {"model": "clef-tiny", "state": "word " * 100, "questions": {"q": {"type": "noul"}}}
    with live_server(engine, ServerSettings(served_model_name="clef-tiny")) as (url, _):
        idle = httpx.get(url + "/status").json()
        assert idle["prefills"] == [] and idle["queued"] == 0
        engine.pausing.set()
        answered = {}
        post = lambda: answered.update(  # noqa: E731
            response=httpx.post(url + "/v1/systemone", json=request, headers={"X-Request-Id": "long-1"}, timeout=120)
        )
        thread = threading.Thread(target=post)
        thread.start()
        try:
            assert engine.paused.wait(60), "the record never started"
            (running,) = httpx.get(url + "/status").json()["prefills"]
            assert running["request_id"] == "long-1" and running["tokens_prefilled"] == 64
            assert running["tokens_total"] > 64 and running["seconds"] >= 0
        finally:
            engine.pausing.clear()
            engine.resume.set()
            thread.join(120)
        assert answered["response"].status_code == 200, answered["response"].text
        assert answered["response"].json()["usage"]["input_tokens"] == running["tokens_total"]
        assert httpx.get(url + "/status").json()["prefills"] == []


SEED_CARD = ("--quantize", "int8", "--vocab-tables", "host", "--gpu-memory", "15.75GiB")  # V100 16GB, as torch reports


def plan_line(*args: str) -> tuple[int, str]:
    result = clef_serve(*args)
    (line,) = [line for line in result.stdout.splitlines() if line.strip().startswith("fits:")]
    return result.returncode, line


@pytest.mark.parametrize("kv_fraction", ["0.30", "0.95"])
def test_a_record_that_cannot_fit_is_told_the_longest_that_does_and_that_advice_works(tmp_path, kv_fraction):
    """The seed's card, clef-flash int8 with host tables and an f16 cache: one 262,144-token record fits at no
    --kv-fraction (0.95 leaves a step's activations too little): the plan says so, the longest record that fits
    and at what fraction; that record, planned with that fraction, fits."""
    flash = str(flash_config_release(tmp_path / "flash"))
    code, line = plan_line(
        "--w", flash, "--plan", *SEED_CARD, "--max-model-len", "262144", "--kv-fraction", kv_fraction
    )
    assert code == 3 and re.search(r"no --kv-fraction up to 0\.[0-9]+ .* holds one", line), line
    advice = re.search(r"at --kv-fraction ([0-9.]+).* the longest record that fits is (\d+) tokens", line)
    assert advice, line
    fraction, longest = advice.groups()
    assert float(fraction) <= float(kv_fraction) and 16_384 < int(longest) < 262_144
    assert "--tensor-parallel-size 2" in line and "--quantize int8" not in line  # int8 is on already
    code, line = plan_line("--w", flash, "--plan", *SEED_CARD, "--max-model-len", longest, "--kv-fraction", fraction)
    assert code == 0 and line.strip() == "fits: yes", line
    code, line = plan_line(
        *("--w", flash, "--plan", *SEED_CARD, "--max-model-len", str(int(longest) + 16 * 64)),
        *("--kv-fraction", fraction),
    )
    assert code == 3, line  # the longest is the longest (a few blocks more do not fit)


def test_where_a_larger_fraction_holds_the_record_the_plan_names_it_and_it_fits(tmp_path):
    flash = str(flash_config_release(tmp_path / "flash"))
    card = ("--quantize", "int8", "--gpu-memory", "31.73GiB")  # V100 32GB
    code, line = plan_line("--w", flash, "--plan", *card, "--max-model-len", "262144", "--kv-fraction", "0.30")
    fraction = re.search(r"--kv-fraction ([0-9.]+) holds one", line)
    assert code == 3 and fraction, line
    code, line = plan_line("--w", flash, "--plan", *card, "--max-model-len", "262144", "--kv-fraction", fraction[1])
    assert code == 0, line
