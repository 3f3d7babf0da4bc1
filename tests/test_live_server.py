"""A real uvicorn server on 127.0.0.1: the official client (typesafe-sdk) works unchanged against it, a client
that disconnects mid-prefill frees its slot and blocks, and the CLI fails cleanly on bad flags."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from live import live_server, wait_until
from releases import TINY_PAST_TRAINING, clef_config_release, flash_config_release, tiny_release

from app.server import ServerSettings
from clef_cuda import Decider
from clef_cuda.model.config import context_length, load_release_config
from clef_cuda.serving.engine import Engine, EngineConfig

KEY = "sdk-test-key"


@pytest.fixture(scope="module")
def engine_factory():
    decider = Decider.from_release(tiny_release(), device="cpu", progress=False, **TINY_PAST_TRAINING)
    defaults = {"max_model_len": 8192, "allow_long_context": True, "kv_fraction": 0.05}

    def make(**config):
        return Engine(decider, EngineConfig(**(defaults | config)))

    return make


def test_official_client_works_unchanged(engine_factory):
    from typesafe_sdk import Choice, Noul, RetryPolicy, Score, TypeSafeClient

    with live_server(engine_factory(), ServerSettings(api_key=KEY)) as (url, _):
        with TypeSafeClient(base_url=url, api_key=KEY, retry=RetryPolicy(max_retries=0), timeout=60) as client:
            result = client.system_one(
                state="Checkout has been failing for every customer for the last hour. " * 20,  # > 1 KiB: zstd
                questions={
                    "outage": Noul(instructions="Is a service down?"),
                    "department": Choice(
                        instructions="Which team should handle the message?",
                        criteria={"billing": "Payments, invoices, or refunds", "technical": "Bugs, outages"},
                    ),
                    "urgency": Score(instructions="How soon?", criteria=["Can wait", "This week", "Today"]),
                },
            )
            assert 0 <= result.nouls["outage"].noul <= 1
            assert result.choices["department"].choice in {"billing", "technical"}
            assert 0 <= result.scores["urgency"].score <= 2
            assert result.model == "clef-flash" and result.usage.input_tokens > 0
            assert any(m.name == "clef-flash" for m in client.models.list().models)


def test_disconnect_mid_prefill_frees_everything(engine_factory):
    engine = engine_factory(prefill_chunk_size=16, prefix_cache=False, max_num_seqs=2)
    with live_server(engine, ServerSettings()) as (_, port):
        body = json.dumps({"model": "clef-flash", "state": "slow " * 1500, "questions": {"q": {"type": "noul"}}})
        raw = (
            f"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}"
        ).encode()
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(raw)
                wait_until(lambda: engine.running, "the engine to prefill the request")
                assert engine.running == 1
            # the socket is closed mid-prefill
        wait_until(lambda: engine.running == 0 and engine.queue_depth == 0, "the engine to drop the requests")
        assert engine.blocks.used == 0 and engine.running_slots.available == engine.plan.running_slots
        assert engine.failed >= 3 and engine.completed == 1  # the warm-up; the three went nowhere


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--port", "abc"], "--p/--port"),
        (["--kv-fraction", "1.5"], "--kv-fraction"),
        (["--dtype", "f8"], "--dtype"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--w", "/nonexistent/clef-flash"], "--w /nonexistent/clef-flash: not a directory"),
        (["--d", "7"], "--d"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--selfcheck", "maybe"], "--selfcheck"),
        (["--log-format", "xml"], "--log-format"),
        (["--client-special-tokens", "raw"], "--client-special-tokens"),
        (["--max-json-depth", "0"], "--max-json-depth"),
        (["--selfcheck-only", "--selfcheck", "off"], "--selfcheck-only"),
        (["--p", "8080x"], "--p/--port: must be a TCP port, an integer from 1 to 65535, got '8080x'"),
        (["--p", "70000"], "--p/--port: must be a TCP port, an integer from 1 to 65535, got 70000"),
        (["--request-timeout", "soon"], "--request-timeout: must be a number of seconds, got 'soon'"),
    ],
)
def test_bad_flags_are_one_line_errors_with_exit_2(args, words):
    done = _cli(*args)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], done.stderr


def test_every_typed_flag_says_what_it_takes_for_a_value_it_cannot_read(capsys):
    """argparse names the type's function for a ValueError ('invalid _positive_int value: 8080x'): every flag with a
    value type says what it takes instead, in clef-serve and clef-serve batch (each given 'x')."""
    from app.cli.batch import build_batch_parser
    from app.cli.flags import build_parser

    for parser, files in ((build_parser(), []), (build_batch_parser(), ["in.jsonl", "out.jsonl"])):
        typed = [a for a in parser._actions if a.option_strings and a.type is not None]
        assert len(typed) > 20
        for action in typed:
            with pytest.raises(SystemExit) as exited:
                parser.parse_args([*files, action.option_strings[0], "x"])
            error = capsys.readouterr().err
            assert exited.value.code == 2 and "invalid" not in error, error
            assert "must be" in error or "expected" in error, error


def test_help_names_the_batch_command():
    done = _cli("--help")
    assert done.returncode == 0 and "clef-serve batch INPUT.jsonl OUTPUT.jsonl" in done.stdout, done.stdout[-400:]


def test_bad_model_directory_is_a_one_line_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    done = _cli("--w", str(tmp_path))
    assert done.returncode == 2
    assert "config.json: field 'model_type' is 'llama'" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_seed_deployment_arguments_parse(tmp_path):
    from app.cli.flags import build_parser

    seed = [
        "--w",
        "/mnt/models/clef-flash",
        "--d",
        "0",
        "--dtype",
        "f16",
        "--p",
        "8080",
        "--max-num-seqs",
        "4",
        "--kv-fraction",
        "0.30",
        "--prefill-chunk-size",
        "1024",
    ]
    args = build_parser().parse_args(seed)
    assert (args.weights, args.device, args.dtype, args.port) == ("/mnt/models/clef-flash", "0", "f16", 8080)
    assert (args.max_num_seqs, args.kv_fraction, args.prefill_chunk_size) == (4, 0.30, 1024)
    assert not args.disable_prefix_cache and args.max_model_len is None  # the release's limit, resolved at start
    assert context_length(load_release_config(flash_config_release(tmp_path / "flash")).trunk, None) == 16384
    assert (args.selfcheck, args.log_format, args.client_special_tokens) == ("enforce", "text", "control")


def test_the_served_name_follows_the_release(tmp_path):
    """clef 27B is served as `clef`, clef-flash (and any other release) as `clef-flash`: the hosted API's two
    names; /v1/models describes which; --served-model-name overrides the name; no --w: the embedded clef-tiny."""
    from app.cli.checks import served_model
    from app.cli.flags import build_parser

    def named(*flags: str) -> tuple[str, str]:
        return served_model(build_parser().parse_args(list(flags)))

    clef, flash = clef_config_release(tmp_path / "clef"), flash_config_release(tmp_path / "flash")
    assert named("--w", str(clef)) == ("clef", "clef System One decision model (27B)")
    assert named("--w", str(flash)) == ("clef-flash", "clef-flash System One decision model (9B)")
    assert named("--w", str(tiny_release()))[0] == "clef-flash"
    assert named("--w", str(clef), "--served-model-name", "ours")[0] == "ours"
    assert named()[0] == "clef-tiny"


def test_client_special_tokens_reach_the_tokenizer():
    from app.cli.engine import make_decider
    from app.cli.flags import build_parser

    args = build_parser().parse_args(["--d", "cpu", "--client-special-tokens", "text"])
    args.weights = str(tiny_release())
    assert make_decider(args).tokenizer.client_special_tokens == "text"
