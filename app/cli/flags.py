"""clef-serve's flags, flag-compatible with the candle-vllm Deployment it replaces (--w /mnt/models/clef-flash
--d 0 --dtype f16 --p 8080 --max-num-seqs 4 --kv-fraction 0.30 --prefill-chunk-size 1024): one function a group of
--help, the value types (a bad value is one line, exit 2), the choices. Imports no torch: --help is instant."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from app.logs import LOG_FORMATS
from clef_cuda.model.config import QUANTIZE_MODES
from clef_cuda.request.encoding import CLIENT_SPECIAL_TOKENS

EXIT_USAGE = 2
# What a failed on-device self-check (clef_cuda.lifecycle) or shadow check (clef_cuda.verification.shadow) does.
SELFCHECK_MODES = ("enforce", "warn", "off")
AUTOTUNE_MODES = ("fast", "full", "off")  # clef_cuda.tuning.autotune (kept here: the CLI imports no torch)
KERNEL_TRIALS = ("auto", "child", "inline")  # clef_cuda.tuning.autotune.KERNEL_TRIALS
VOCAB_TABLES = ("auto", "device", "host")  # clef_cuda.model.weights.VOCAB_TABLE_PLACEMENTS, and auto
DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints the whole usage otherwise)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


class _HelpWithDefaults(argparse.HelpFormatter):
    """Every flag's help says its default: its own words where they do, else argparse's value (off for a
    switch, none where there is none). One line a flag at 120 columns: the metavar names the unit (TOKENS,
    SECONDS, MIB, ...); docs/operations.md#flags says the rest."""

    WIDTH, HELP_COLUMN = 120, 40

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=self.HELP_COLUMN, width=self.WIDTH)

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
            return f"{text} (default: off)"
        return f"{text} (default: {'none' if action.default in (None, []) else '%(default)s'})"


def _number(text: str, kind: type, what: str):
    """text as `kind`, or the one line saying what the flag takes (argparse's own says 'invalid _positive_int
    value')."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = _number(text, int, "a positive integer")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _port(text: str) -> int:
    value = _number(text, int, "a TCP port, an integer from 1 to 65535")
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, an integer from 1 to 65535, got {text}")
    return value


def _seconds(text: str) -> float:
    value = _number(text, float, "a number of seconds")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _seconds_or_zero(text: str) -> float:
    """0 allowed: a drain that waits for nothing."""
    value = _number(text, float, "a number of seconds")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = _number(text, float, "a positive number")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _fraction(text: str) -> float:
    value = _number(text, float, "a number in (0, 1]")
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _rate(text: str) -> float:
    value = _number(text, float, "a number in [0, 1]")
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(text: str) -> float | None:
    """'off' -> None; '90s', '30m', '1h', '1d' or plain seconds -> seconds (positive)."""
    text = text.strip().lower()
    if text == "off":
        return None
    unit = text[-1:] if text[-1:] in _DURATION_UNITS else "s"
    number = text[:-1] if text[-1:] in _DURATION_UNITS else text
    try:
        seconds = float(number) * _DURATION_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a duration (e.g. 1h, 30m, 90s) or 'off', got {text!r}") from None
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return seconds


SERVE_EPILOG = (
    "commands: clef-serve batch INPUT.jsonl OUTPUT.jsonl [these flags] scores a file of requests offline "
    "(clef-serve batch --help). Flags, exit codes, examples: docs/operations.md#flags"
)


def build_parser(
    prog: str = "clef-serve",
    description: str = "Serve a Clef release over TypeSafe's System One API.",
    epilog: str | None = SERVE_EPILOG,
) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog, description=description, epilog=epilog, allow_abbrev=False, formatter_class=_HelpWithDefaults
    )
    # --help in the groups a reader looks for a flag in (README, docs/operations.md#flags), in this order
    for title, add_flags in (
        ("serving: the model, the device, the listener", add_serving_flags),
        ("memory: the plan, int8, the engine's batch and caches", add_memory_flags),
        ("verification: the self-check, autotune, kernel trials, shadow (docs/verifying.md)", add_verification_flags),
        ("clients: requests, answers and their limits (docs/clients.md)", add_clients_flags),
        ("variants: fine-tuned LoRA checkpoints served beside the base", add_variants_flags),
        ("scale: tensor parallel over the cards of one machine", add_scale_flags),
    ):
        add_flags(parser.add_argument_group(title))
    return parser


def add_serving_flags(group) -> None:
    """The release, the device and dtype, the listener, the key, logging."""
    group.add_argument(
        "--w", "--weights", dest="weights", metavar="DIR", help="release directory (default: the embedded demo model)"
    )
    group.add_argument(
        "--d", "--device", dest="device", metavar="DEVICE", help="GPU index, cuda:N or cpu (default: GPU 0, else cpu)"
    )
    group.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="activations; bf16 on sm_80+ and AVX512-BF16 CPUs (default: f16 GPU, f32 CPU)",
    )
    group.add_argument("--p", "--port", dest="port", type=_port, default=8080, metavar="PORT", help="TCP port")
    group.add_argument("--host", default="0.0.0.0", metavar="ADDRESS", help="address to listen on")
    group.add_argument(
        "--api-key",
        default=os.environ.get("CLEF_API_KEY"),
        metavar="KEY",
        help="require Authorization: Bearer KEY (default: $CLEF_API_KEY; none: no auth)",
    )
    group.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model name clients send (default: the release's: clef-flash, clef)",
    )
    group.add_argument(
        "--drain-timeout",
        type=_seconds_or_zero,
        default=90.0,
        metavar="SECONDS",
        help="on SIGTERM, for in-flight requests to finish (new ones: 503)",
    )
    group.add_argument(
        "--cors-origins", default="", metavar="ORIGINS", help="comma-separated CORS origins (default: none)"
    )
    group.add_argument(
        "--no-vllm-metric-aliases",
        dest="vllm_metric_aliases",
        action="store_false",
        help="no copies of the gauges under vLLM's names in /metrics",
    )
    group.add_argument(
        "--log-level", choices=["debug", "info", "warning", "error"], default="info", help="least severe level logged"
    )
    group.add_argument(
        "--log-format", choices=LOG_FORMATS, default="text", help="json: one object a line, decisions with timings"
    )
    group.add_argument(
        "--no-status-page",
        dest="status_page",
        action="store_false",
        help="no status page at GET / (default: served; /status, /ready, /metrics stay)",
    )
    group.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="export traces to this OTLP/HTTP receiver (clef-cuda[otel]; default: off)",
    )


def add_memory_flags(group) -> None:
    """The memory plan, int8 and the vocabulary tables, the engine's batch, KV blocks and caches."""
    group.add_argument(
        "--quantize", choices=QUANTIZE_MODES, default="none", help="int8: W8A16 weights, half the f16 bytes"
    )
    group.add_argument(
        "--vocab-tables",
        choices=VOCAB_TABLES,
        default="auto",
        help="embedding, LM-head tables on the device or in pinned host memory",
    )
    group.add_argument(
        "--plan", action="store_true", help="print the memory plan and exit: 0 if it fits, 3 if it does not"
    )
    group.add_argument(
        "--gpu-memory", metavar="SIZE", help="memory to plan for, e.g. 16GiB (default: free memory of --d)"
    )
    group.add_argument(
        "--max-num-seqs", type=_positive_int, default=4, metavar="N", help="records prefilled together in a step"
    )
    group.add_argument(
        "--kv-fraction",
        type=_fraction,
        default=0.30,
        metavar="FRACTION",
        help="of free device memory after weights, for KV blocks and states",
    )
    group.add_argument(
        "--prefill-chunk-size", type=_positive_int, default=1024, metavar="TOKENS", help="new tokens a record a step"
    )
    group.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=None,
        metavar="TOKENS",
        help="token budget of one record (default: 16384, or the release's limit if less)",
    )
    group.add_argument(
        "--allow-long-context", action="store_true", help="--max-model-len past the release's limit (extrapolation)"
    )
    group.add_argument("--block-size", type=_positive_int, default=16, metavar="TOKENS", help="tokens per KV block")
    group.add_argument("--disable-prefix-cache", action="store_true", help="turn the prefix cache off")
    group.add_argument(
        "--vision-cache-mib",
        type=_positive_int,
        default=256,
        metavar="MIB",
        help="vision-tower outputs kept by image digest",
    )


def add_verification_flags(group) -> None:
    """The start-up self-check, the autotune and kernel trials, the timed self-check and the shadow."""
    group.add_argument(
        "--selfcheck",
        choices=SELFCHECK_MODES,
        default="enforce",
        help="kernel self-check before /ready; warn: serve anyway, loudly",
    )
    group.add_argument(
        "--autotune",
        choices=AUTOTUNE_MODES,
        default="fast",
        help="time each op's checked kernels at start-up, run the fastest",
    )
    group.add_argument(
        "--autotune-cache",
        default=str(Path.home() / ".cache" / "clef-cuda" / "autotune"),
        metavar="DIR",
        help="the autotune's cache, '' for none (default: ~/.cache/clef-cuda/autotune)",
    )
    group.add_argument(
        "--kernel-trials",
        choices=KERNEL_TRIALS,
        default="auto",
        help="where new kernels first run (auto: a child process on a GPU)",
    )
    group.add_argument(
        "--selfcheck-interval",
        type=_duration,
        default=None,
        metavar="DURATION",
        help="repeat the self-check when idle, e.g. 1h (default: off)",
    )
    group.add_argument(
        "--shadow-rate",
        type=_rate,
        default=0.01,
        metavar="FRACTION",
        help="of answered records re-decided on the reference ops, when idle",
    )
    group.add_argument(
        "--shadow-mode",
        choices=SELFCHECK_MODES,
        default="enforce",
        help="enforce: mismatches turn /ready and decisions 503",
    )
    group.add_argument(
        "--shadow-max-mismatches",
        type=_positive_int,
        default=1,
        metavar="N",
        help="mismatches before enforce stops answering",
    )
    group.add_argument(
        "--shadow-min-interval",
        type=_duration,
        default=300.0,
        metavar="DURATION",
        help="under full load, a shadow chunk after this long; off: never (default: 5m)",
    )
    group.add_argument(
        "--selfcheck-only", action="store_true", help="run the self-check, print it, exit 0 (passed) or 1"
    )


def add_clients_flags(group) -> None:
    """What a client may send and how it is answered: answers' confidence, limits, timeouts, images."""
    group.add_argument(
        "--confidence",
        choices=["clef", "typesafe"],
        default="clef",
        help="clef: top probability (the reference's); typesafe: TypeSafe's",
    )
    group.add_argument(
        "--state-overflow",
        choices=["reject", "truncate"],
        default="reject",
        help="over --max-model-len: 413, or keep the state's head",
    )
    group.add_argument("--max-queue", type=_positive_int, default=256, metavar="N", help="waiting requests before 503")
    group.add_argument(
        "--max-body-bytes", type=_positive_int, default=48 * 2**20, metavar="BYTES", help="request body limit (413)"
    )
    group.add_argument(
        "--request-timeout", type=_seconds, default=600.0, metavar="SECONDS", help="before a request gives up (503)"
    )
    group.add_argument(
        "--body-timeout", type=_seconds, default=30.0, metavar="SECONDS", help="to receive a request body (408)"
    )
    group.add_argument(
        "--max-json-depth",
        type=_positive_int,
        default=256,
        metavar="LEVELS",
        help="deeper request bodies are refused (422) unparsed",
    )
    group.add_argument(
        "--max-images", type=_positive_int, default=4, metavar="N", help="images a request (4 MiB each, 8 MiB in all)"
    )
    group.add_argument(
        "--max-videos", type=_positive_int, default=2, metavar="N", help="videos a request (MP4 or WebM)"
    )
    group.add_argument(
        "--max-video-mib", type=_positive_int, default=16, metavar="MIB", help="bytes of one video, in MiB"
    )
    group.add_argument(
        "--max-video-seconds", type=_positive_float, default=60.0, metavar="SECONDS", help="length of one video"
    )
    group.add_argument(
        "--video-decode-budget",
        type=_duration,
        default=3.5,
        metavar="DURATION",
        help="to scan and decode a request's videos, then 413; off: none (default: 3.5s)",
    )
    group.add_argument(
        "--max-video-decodes",
        type=_positive_int,
        default=None,
        metavar="N",
        help="requests' videos decoded at once (default: a quarter of the cores, at least 1)",
    )
    group.add_argument(
        "--image-max-pixels",
        type=_positive_int,
        default=None,
        metavar="PIXELS",
        help="resize budget an image; 1048576: Cloudflare's (default: the release's)",
    )
    group.add_argument(
        "--client-special-tokens",
        choices=CLIENT_SPECIAL_TOKENS,
        default="control",
        help="special tokens typed by clients: control (reference) or text",
    )


def add_variants_flags(group) -> None:
    """LoRA variants: the start-up ones and runtime loading."""
    group.add_argument(
        "--adapter",
        "--lora-modules",
        dest="adapters",
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME=DIR",
        help="a clef-finetune checkpoint served as model NAME (repeatable)",
    )
    group.add_argument("--max-adapters", type=_positive_int, default=8, metavar="N", help="variants held at once")
    group.add_argument(
        "--max-adapter-rank", type=_positive_int, default=64, metavar="RANK", help="largest LoRA rank accepted"
    )
    group.add_argument(
        "--adapter-head-dtype", choices=sorted(DTYPES), default="f32", help="dtype of the variants' heads"
    )
    group.add_argument(
        "--enable-adapter-loading",
        action="store_true",
        help="POST /v1/(un)load_lora_adapter; needs --api-key, --adapter-root",
    )
    group.add_argument("--adapter-root", metavar="DIR", help="the one directory adapters load from at run time")


def add_scale_flags(group) -> None:
    """Tensor parallel over the cards of one machine."""
    group.add_argument(
        "--tensor-parallel-size",
        "--tp",
        dest="tensor_parallel_size",
        type=_positive_int,
        default=1,
        metavar="N",
        help="shard the trunk over N cards of this machine: 1, 2 or 4",
    )
    group.add_argument(
        "--tensor-parallel-timeout",
        type=_duration,
        default=60.0,
        metavar="DURATION",
        help="a collective slower than this fails the group: exit 5 (default: 60s)",
    )
