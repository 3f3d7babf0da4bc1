"""clef-serve: the command line, flag-compatible with the candle-vllm Deployment it replaces
(--w /mnt/models/clef-flash --d 0 --dtype f16 --p 8080 --max-num-seqs 4 --kv-fraction 0.30
--prefill-chunk-size 1024). A bad flag or model directory is a one-line error naming it, exit code 2."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from pathlib import Path

from app.logs import LOG_FORMATS, configure_logging
from clef_cuda.model.config import QUANTIZE_MODES
from clef_cuda.request.encoding import CLIENT_SPECIAL_TOKENS

EXIT_USAGE = 2
EXIT_PLAN_DOES_NOT_FIT = 3  # --plan: the release does not fit the memory planned for
# What a failed on-device self-check (app.server) or shadow check (clef_cuda.verification.shadow) does.
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


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _rate(text: str) -> float:
    value = float(text)
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


def build_parser(
    prog: str = "clef-serve", description: str = "Serve a clef-flash release over TypeSafe's System One API."
) -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description=description, allow_abbrev=False, formatter_class=_HelpWithDefaults)
    # --help in the groups a reader looks for a flag in (README, docs/operations.md#flags)
    serving = p.add_argument_group("serving: the model, the device, the listener")
    memory = p.add_argument_group("memory: the plan, int8, the engine's batch and caches")
    verification = p.add_argument_group(
        "verification: the self-check, autotune, kernel trials, shadow (docs/verifying.md)"
    )
    clients = p.add_argument_group("clients: requests, answers and their limits (docs/clients.md)")
    variants = p.add_argument_group("variants: fine-tuned LoRA checkpoints served beside the base")
    scale = p.add_argument_group("scale: tensor parallel over the cards of one machine")
    serving.add_argument(
        "--w", "--weights", dest="weights", metavar="DIR", help="release directory (default: the embedded demo model)"
    )
    serving.add_argument(
        "--d", "--device", dest="device", metavar="DEVICE", help="GPU index, cuda:N or cpu (default: GPU 0, else cpu)"
    )
    serving.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="activations; bf16 on sm_80+ and AVX512-BF16 CPUs (default: f16 GPU, f32 CPU)",
    )
    memory.add_argument(
        "--quantize", choices=QUANTIZE_MODES, default="none", help="int8: W8A16 weights, half the f16 bytes"
    )
    scale.add_argument(
        "--tensor-parallel-size",
        "--tp",
        dest="tensor_parallel_size",
        type=int,
        default=1,
        metavar="N",
        help="shard the trunk over N cards of this machine: 1, 2 or 4",
    )
    scale.add_argument(
        "--tensor-parallel-timeout",
        type=_duration,
        default=60.0,
        metavar="DURATION",
        help="a collective slower than this fails the group: exit 5 (default: 60s)",
    )
    memory.add_argument(
        "--vocab-tables",
        choices=VOCAB_TABLES,
        default="auto",
        help="embedding, LM-head tables on the device or in pinned host memory",
    )
    memory.add_argument(
        "--plan", action="store_true", help="print the memory plan and exit: 0 if it fits, 3 if it does not"
    )
    memory.add_argument(
        "--gpu-memory", metavar="SIZE", help="memory to plan for, e.g. 16GiB (default: free memory of --d)"
    )
    serving.add_argument(
        "--p", "--port", dest="port", type=_positive_int, default=8080, metavar="PORT", help="TCP port"
    )
    serving.add_argument("--host", default="0.0.0.0", metavar="ADDRESS", help="address to listen on")
    memory.add_argument(
        "--max-num-seqs", type=_positive_int, default=4, metavar="N", help="records prefilled together in a step"
    )
    memory.add_argument(
        "--kv-fraction",
        type=_fraction,
        default=0.30,
        metavar="FRACTION",
        help="of free device memory after weights, for KV blocks and states",
    )
    memory.add_argument(
        "--prefill-chunk-size", type=_positive_int, default=1024, metavar="TOKENS", help="new tokens a record a step"
    )
    memory.add_argument(
        "--max-model-len", type=_positive_int, default=16384, metavar="TOKENS", help="token budget of one record"
    )
    memory.add_argument("--block-size", type=_positive_int, default=16, metavar="TOKENS", help="tokens per KV block")
    memory.add_argument("--disable-prefix-cache", action="store_true", help="turn the prefix cache off")
    serving.add_argument(
        "--api-key",
        default=os.environ.get("CLEF_API_KEY"),
        metavar="KEY",
        help="require Authorization: Bearer KEY (default: $CLEF_API_KEY; none: no auth)",
    )
    serving.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model name clients send (default: the release's: clef-flash, clef)",
    )
    clients.add_argument(
        "--confidence",
        choices=["clef", "typesafe"],
        default="clef",
        help="clef: top probability (the reference's); typesafe: TypeSafe's",
    )
    clients.add_argument(
        "--state-overflow",
        choices=["reject", "truncate"],
        default="reject",
        help="over --max-model-len: 413, or keep the state's head",
    )
    clients.add_argument(
        "--max-queue", type=_positive_int, default=256, metavar="N", help="waiting requests before 503"
    )
    clients.add_argument(
        "--max-body-bytes", type=_positive_int, default=32 * 2**20, metavar="BYTES", help="request body limit (413)"
    )
    clients.add_argument(
        "--request-timeout", type=float, default=600.0, metavar="SECONDS", help="before a request gives up (503)"
    )
    clients.add_argument(
        "--body-timeout", type=float, default=30.0, metavar="SECONDS", help="to receive a request body (408)"
    )
    serving.add_argument(
        "--drain-timeout",
        type=float,
        default=90.0,
        metavar="SECONDS",
        help="on SIGTERM, for in-flight requests to finish (new ones: 503)",
    )
    serving.add_argument(
        "--cors-origins", default="", metavar="ORIGINS", help="comma-separated CORS origins (default: none)"
    )
    serving.add_argument(
        "--no-vllm-metric-aliases",
        dest="vllm_metric_aliases",
        action="store_false",
        help="no copies of the gauges under vLLM's names in /metrics",
    )
    serving.add_argument(
        "--log-level", choices=["debug", "info", "warning", "error"], default="info", help="least severe level logged"
    )
    serving.add_argument(
        "--log-format", choices=LOG_FORMATS, default="text", help="json: one object a line, decisions with timings"
    )
    verification.add_argument(
        "--selfcheck",
        choices=SELFCHECK_MODES,
        default="enforce",
        help="kernel self-check before /ready; warn: serve anyway, loudly",
    )
    verification.add_argument(
        "--autotune",
        choices=AUTOTUNE_MODES,
        default="fast",
        help="time each op's checked kernels at start-up, run the fastest",
    )
    verification.add_argument(
        "--autotune-cache",
        default=str(Path.home() / ".cache" / "clef-cuda" / "autotune"),
        metavar="DIR",
        help="the autotune's cache, '' for none (default: ~/.cache/clef-cuda/autotune)",
    )
    verification.add_argument(
        "--kernel-trials",
        choices=KERNEL_TRIALS,
        default="auto",
        help="where new kernels first run (auto: a child process on a GPU)",
    )
    verification.add_argument(
        "--selfcheck-interval",
        type=_duration,
        default=None,
        metavar="DURATION",
        help="repeat the self-check when idle, e.g. 1h (default: off)",
    )
    verification.add_argument(
        "--shadow-rate",
        type=_rate,
        default=0.01,
        metavar="FRACTION",
        help="of answered records re-decided on the reference ops, when idle",
    )
    verification.add_argument(
        "--shadow-mode",
        choices=SELFCHECK_MODES,
        default="enforce",
        help="enforce: mismatches turn /ready and decisions 503",
    )
    verification.add_argument(
        "--shadow-max-mismatches",
        type=_positive_int,
        default=1,
        metavar="N",
        help="mismatches before enforce stops answering",
    )
    verification.add_argument(
        "--shadow-min-interval",
        type=_duration,
        default=300.0,
        metavar="DURATION",
        help="under full load, a shadow chunk after this long; off: never (default: 5m)",
    )
    verification.add_argument(
        "--selfcheck-only", action="store_true", help="run the self-check, print it, exit 0 (passed) or 1"
    )
    clients.add_argument(
        "--max-json-depth",
        type=_positive_int,
        default=256,
        metavar="LEVELS",
        help="deeper request bodies are refused (422) unparsed",
    )
    clients.add_argument(
        "--max-images", type=_positive_int, default=4, metavar="N", help="images a request (4 MiB each, 8 MiB in all)"
    )
    clients.add_argument(
        "--image-max-pixels",
        type=_positive_int,
        default=None,
        metavar="PIXELS",
        help="resize budget an image; 1048576: Cloudflare's (default: the release's)",
    )
    memory.add_argument(
        "--vision-cache-mib",
        type=_positive_int,
        default=256,
        metavar="MIB",
        help="vision-tower outputs kept by image digest",
    )
    variants.add_argument(
        "--adapter",
        "--lora-modules",
        dest="adapters",
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME=DIR",
        help="a clef-finetune checkpoint served as model NAME (repeatable)",
    )
    variants.add_argument("--max-adapters", type=_positive_int, default=8, metavar="N", help="variants held at once")
    variants.add_argument(
        "--max-adapter-rank", type=_positive_int, default=64, metavar="RANK", help="largest LoRA rank accepted"
    )
    variants.add_argument(
        "--adapter-head-dtype", choices=sorted(DTYPES), default="f32", help="dtype of the variants' heads"
    )
    variants.add_argument(
        "--enable-adapter-loading",
        action="store_true",
        help="POST /v1/(un)load_lora_adapter; needs --api-key, --adapter-root",
    )
    variants.add_argument("--adapter-root", metavar="DIR", help="the one directory adapters load from at run time")
    clients.add_argument(
        "--client-special-tokens",
        choices=CLIENT_SPECIAL_TOKENS,
        default="control",
        help="special tokens typed by clients: control (reference) or text",
    )
    return p


def resolve_device(text: str | None):
    import torch

    if text is None:
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    text = text.strip().lower()
    if text.isdigit():
        text = f"cuda:{text}"
    try:
        device = torch.device(text)
    except RuntimeError as error:
        raise ValueError(f"--d {text!r} is not a device (use a GPU index, 'cuda:N' or 'cpu')") from error
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--d {text}: no CUDA device is available on this machine")
        if (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"--d {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise ValueError(f"--d {text}: only CUDA devices and 'cpu' are supported")
    return device


def make_decider(args, on_lost=None):
    """Load the release onto the serving device in the serving dtype."""
    import torch

    from clef_cuda import Decider
    from clef_cuda.request.images import ImageLimits

    device = resolve_device(args.device)
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    group = None
    if args.tensor_parallel_size > 1:
        from clef_cuda.parallel.tensor_parallel import TensorParallel

        group = TensorParallel(args.tensor_parallel_size, on_lost=on_lost, timeout=args.tensor_parallel_timeout or 60.0)
    return Decider.from_release(
        args.weights,
        device=device,
        dtype=dtype,
        max_length=args.max_model_len,
        state_overflow=args.state_overflow,
        confidence=args.confidence,
        client_special_tokens=args.client_special_tokens,
        image_limits=ImageLimits(max_images=args.max_images),
        image_max_pixels=args.image_max_pixels,
        progress=args.log_format == "text",  # a progress bar is not a JSON line
        quantize=args.quantize,
        vocab_tables=args.vocab_tables if args.vocab_tables != "auto" else "device",
        tensor_parallel=group,
    )


def check_tensor_parallel(args, release, log) -> None:
    """--tensor-parallel-size: before the load, one line for what cannot shard (the heads, the cards, the
    variants)."""
    import torch

    from clef_cuda.model.shard import check_shardable

    size = args.tensor_parallel_size
    check_shardable(release.trunk, size)
    if size == 1:
        return
    if args.adapters or args.enable_adapter_loading:
        raise ValueError(
            f"--tensor-parallel-size {size}: LoRA variants (--adapter, --enable-adapter-loading) are not sharded "
            "across ranks yet; serve them with --tensor-parallel-size 1"
        )
    device = resolve_device(args.device)
    if device.type == "cuda" and (device.index or 0) + size > torch.cuda.device_count():
        raise ValueError(
            f"--tensor-parallel-size {size} from {device}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )


def parse_adapters(values: list[str]) -> list[tuple[str, str]]:
    """NAME=DIR (or vLLM's JSON form) -> (name, directory); ValueError naming the bad one."""
    import json

    from clef_cuda.model.adapters import check_variant_name

    pairs = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                item = json.loads(value)
                name, directory = item["name"], item["path"]
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f'--adapter {value!r}: expected NAME=DIR or {{"name": ..., "path": ...}}') from error
        else:
            name, sep, directory = value.partition("=")
            if not sep or not name or not directory:
                raise ValueError(f"--adapter {value!r}: expected NAME=DIR")
        try:
            check_variant_name(str(name))
        except ValueError as error:
            raise ValueError(f"--adapter {value!r}: {error}") from None
        pairs.append((str(name), str(directory)))
    names = [name for name, _ in pairs]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"--adapter: the name {name!r} is given twice")
    return pairs


def make_adapters(args, decider):
    """The variant registry with the start-up adapters loaded (None when adapters are off)."""
    import torch

    from clef_cuda.model.adapters import AdapterRegistry

    if not args.adapters and not args.enable_adapter_loading:
        return None
    registry = AdapterRegistry(
        decider.config,
        decider.trunk.lm_head,
        decider.trunk.dtype,
        max_adapters=args.max_adapters,
        max_rank=args.max_adapter_rank,
        head_dtype=getattr(torch, DTYPES[args.adapter_head_dtype]),
    )
    for name, directory in parse_adapters(args.adapters):
        registry.load(name, Path(directory))
    return registry


def engine_config(args):
    from clef_cuda.serving.engine import EngineConfig
    from clef_cuda.verification.shadow import ShadowConfig

    return EngineConfig(
        shadow=ShadowConfig(args.shadow_rate, args.shadow_mode, args.shadow_max_mismatches, args.shadow_min_interval),
        selfcheck_interval=args.selfcheck_interval if args.selfcheck != "off" else None,
        selfcheck_mode=args.selfcheck,
        max_num_seqs=args.max_num_seqs,
        prefill_chunk_size=args.prefill_chunk_size,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        kv_fraction=args.kv_fraction,
        prefix_cache=not args.disable_prefix_cache,
        max_queue=args.max_queue,
        state_overflow=args.state_overflow,
        confidence=args.confidence,
        vision_cache_bytes=args.vision_cache_mib * 2**20,
    )


def make_engine(args, on_lost=None):
    """Load the release and build the engine (runs on the loader thread; errors surface on /ready). on_lost: what
    a tensor-parallel group calls when a rank is lost, from the moment its workers start."""
    from clef_cuda.serving.engine import Engine

    decider = make_decider(args, on_lost)
    try:
        adapters = make_adapters(args, decider)
        return Engine(decider, engine_config(args), adapters)
    except BaseException:
        if decider.trunk.peers is not None:  # no worker outlives a failed start
            decider.trunk.peers.stop()
        raise


def resolve_dtype(args) -> tuple[int, str] | None:
    """--dtype for the device: the default it should serve in (f32 on sm_61 and the CPU), and a one-line error for
    bf16 on a GPU without bf16 arithmetic. Returns the line serving_dtype has to log (the default on sm_61; on the
    CPU, what its GEMMs do with bf16) as (level, text), for the caller to log once every other check has passed:
    a bad invocation's error stays the only line it prints."""
    import torch

    from clef_cuda.decider import serving_dtype

    if getattr(args, "plan", False) and args.gpu_memory is not None:
        # A plan for a card named by its memory, not this machine's device: its dtype is --dtype, else a GPU's
        # default (make_plan), whatever this machine would serve in.
        return None
    device = resolve_device(args.device)
    dtype, why = serving_dtype(device, getattr(torch, DTYPES[args.dtype]) if args.dtype else None)
    args.dtype = next(name for name, value in DTYPES.items() if getattr(torch, value) == dtype)
    if not why:
        return None
    return (logging.INFO if device.type == "cpu" and dtype == torch.float32 else logging.WARNING), why


def make_plan(args, quantize: str | None = None, vocab_tables: str | None = None):
    """The memory plan for args (clef_cuda.serving.plan) on --gpu-memory (a card's total: its CUDA context still
    to come), or on --d's free memory now (after emptying torch's cache: the context already out of it)."""
    import torch

    from clef_cuda.model.adapters import adapter_pool_bytes
    from clef_cuda.model.config import load_release_config
    from clef_cuda.serving.plan import parse_memory_size, plan_serving, plan_tensor_parallel

    device = resolve_device(args.device)
    context_counted = True
    if args.gpu_memory is not None:
        try:
            device_bytes = parse_memory_size(args.gpu_memory)
        except ValueError as error:
            raise ValueError(f"--gpu-memory: {error}") from None
        on_gpu, where = True, "--gpu-memory"
    elif device.type == "cuda":
        torch.cuda.empty_cache()
        device_bytes, _ = torch.cuda.mem_get_info(device)
        on_gpu, where, context_counted = True, f"free on {device} ({torch.cuda.get_device_name(device)})", False
    else:
        import psutil

        device_bytes, on_gpu, where = psutil.virtual_memory().available, False, "available host memory"
    dtype = getattr(torch, DTYPES[args.dtype or ("f16" if on_gpu else "f32")])
    config = load_release_config(args.weights)
    reserved = 0
    if args.adapters or args.enable_adapter_loading:  # the pool the registry will reserve
        head_dtype = getattr(torch, DTYPES[args.adapter_head_dtype])
        reserved = adapter_pool_bytes(config, dtype, args.max_adapters, args.max_adapter_rank, head_dtype)
    tables = vocab_tables or (args.vocab_tables if args.vocab_tables != "auto" else "device")
    planner = plan_serving
    if args.tensor_parallel_size > 1:  # every rank's plan, on cards like this one
        planner = functools.partial(plan_tensor_parallel, ranks=args.tensor_parallel_size)
    plan = planner(
        args.weights,
        config,
        engine_config(args),
        device_bytes,
        dtype=dtype,
        quantize=quantize or args.quantize,
        on_gpu=on_gpu,
        where=where,
        reserved_bytes=reserved,
        vocab_tables=tables if on_gpu else "device",  # on the CPU the host is the device
        context_counted=context_counted,
        image_max_pixels=args.image_max_pixels,
    )
    if device.type == "cuda" and args.gpu_memory is None:  # the card itself: say what its kernels are
        from dataclasses import replace

        from clef_cuda.kernels import ops

        props = torch.cuda.get_device_properties(device)
        smem = getattr(props, "shared_memory_per_block_optin", 48 * 1024)
        tiles = ops.paged_attention_tiles(config.trunk.head_dim, 10 * props.major + props.minor, smem)
        plan = replace(plan, kernels=f"head dim {config.trunk.head_dim} on sm_{props.major}{props.minor}: {tiles}")
    return plan


def check_plan(args, log) -> int | None:
    """--plan: print the plan, return its exit code. Otherwise: a plan that cannot fit raises ValueError
    (one line: the numbers, and whether int8 weights or host tables would fit); one that fits is logged.
    --vocab-tables auto becomes host (on a GPU) when only that fits or the cache then holds more KV blocks
    (clef_cuda.serving.plan.auto_vocab_tables)."""
    from clef_cuda.serving.plan import auto_vocab_tables

    plan = make_plan(args)
    may_host = args.vocab_tables != "device" and plan.on_gpu
    if args.vocab_tables == "auto" and may_host:
        plan, why = auto_vocab_tables(plan, make_plan(args, vocab_tables="host"))
        if why is not None:
            log.info("--vocab-tables auto: the vocabulary tables go to host memory (%s)", why)
    args.vocab_tables = plan.vocab_tables
    hints = []
    if not plan.fits and args.quantize != "int8":
        int8 = make_plan(args, "int8", plan.vocab_tables)
        if not int8.fits and may_host:
            int8 = make_plan(args, "int8", "host")
        if int8.fits:
            hints.append(("--quantize int8" + (" --vocab-tables host" if int8.vocab_tables == "host" else ""), int8))
    hint = f" (with {hints[0][0]} it fits)" if hints else ""
    if args.plan:
        print(plan.describe())
        for flags, other in hints:
            print(f"  {flags} would fit: {other.summary()}")
        return 0 if plan.fits else EXIT_PLAN_DOES_NOT_FIT
    if not plan.fits:
        raise ValueError(f"{plan.summary()}: {plan.problem}{hint}")
    log.info("%s", plan.describe())
    return None


def selfcheck_only(args) -> int:
    """--selfcheck-only: the report on stdout, exit 0 when every check passed, 1 otherwise."""
    from clef_cuda.verification.selfcheck import run_selfcheck

    trunk = make_decider(args).trunk
    try:
        report = run_selfcheck(trunk, block_size=args.block_size)
    finally:
        if trunk.peers is not None:  # the other ranks checked theirs (rank1.*, ...): they go now
            trunk.peers.stop()
    print(report.table())
    print(f"self-check {report.summary()}")
    return 0 if report.passed else 1


def check_adapters(args, release) -> None:
    """Before the (slow) load: every start-up adapter passes the loading rules (AdapterError naming file and
    tensor or field), names do not shadow the served model, and runtime loading has its key and root."""
    from clef_cuda.model.adapters import load_adapter_tensors

    for name, directory in parse_adapters(args.adapters):
        if name in (args.served_model_name, "jev-latest"):
            raise ValueError(f"--adapter {name}={directory}: the name is the served model's")
        load_adapter_tensors(Path(directory), release, args.max_adapter_rank)
    if len(args.adapters) > args.max_adapters:
        raise ValueError(f"--adapter: {len(args.adapters)} adapters, more than --max-adapters {args.max_adapters}")
    if args.enable_adapter_loading:
        if not args.api_key:
            raise ValueError("--enable-adapter-loading needs --api-key (or $CLEF_API_KEY): loading is an admin action")
        if not args.adapter_root or not Path(args.adapter_root).is_dir():
            raise ValueError(
                f"--enable-adapter-loading needs --adapter-root, an existing directory (got {args.adapter_root!r})"
            )


def served_model(args: argparse.Namespace) -> tuple[str, str]:
    """(the name clients send, the description /v1/models gives): the release's Clef family name (clef for clef
    27B, clef-flash otherwise: clef_cuda.model.config.family_of), or clef-tiny without --w; --served-model-name
    overrides the name. A path never appears in either."""
    from clef_cuda.model.config import family_of, load_release_config

    if args.weights is None:
        from clef_cuda.model.default_model import NAME

        name, description = NAME, "EMBEDDED DEMO MODEL clef-tiny: trained on synthetic tickets, logs and orders"
    else:
        name, description = family_of(load_release_config(args.weights))
    return args.served_model_name or name, description


def check_before_loading(args, parser, log) -> tuple[int | None, str]:
    """Everything that can be checked before the (slow) load, each failure one line and exit 2: (the --plan
    exit code, or None to go on; the model's description for /v1/models). Fills in --w with the embedded
    model when it is absent."""
    from clef_cuda.errors import ReleaseError
    from clef_cuda.model.adapters import AdapterError
    from clef_cuda.model.config import load_release_config
    from clef_cuda.model.weights import check_not_prequantized

    try:
        import clef_cuda.kernels.ops  # noqa: F401  (applies CLEF_CPU_ISA: ValueError for a variant this CPU lacks)

        resolve_device(args.device)
        dtype_line = resolve_dtype(args)
        if args.weights is not None and not Path(args.weights).is_dir():
            raise ValueError(f"--w {args.weights}: not a directory (expected a Clef release)")
        args.served_model_name, description = served_model(args)  # before --w is filled in with the embedded model
        if args.weights is None:
            from clef_cuda.model import default_model

            args.weights = str(default_model.default_release())
            log.warning("!" * 100)
            log.warning(default_model.NOTICE)
            log.warning("!" * 100)
        check_adapters(args, load_release_config(args.weights))
        check_tensor_parallel(args, load_release_config(args.weights), log)
        check_not_prequantized(args.weights, load_release_config(args.weights).fp8_block_size)
        if dtype_line:
            log.log(*dtype_line)
        return check_plan(args, log), description
    except (ValueError, ImportError, ReleaseError, AdapterError) as error:
        parser.exit(EXIT_USAGE, f"{parser.prog}: error: {error}\n")


def server_settings(args, description: str):
    from app.server import ServerSettings

    return ServerSettings(
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
        body_timeout=args.body_timeout,
        model_description=description,
        release_dir=args.weights,
        cors_origins=tuple(o.strip() for o in args.cors_origins.split(",") if o.strip()),
        selfcheck=args.selfcheck,
        max_json_depth=args.max_json_depth,
        adapter_root=args.adapter_root if args.enable_adapter_loading else None,
        vllm_metric_aliases=args.vllm_metric_aliases,
        autotune=args.autotune,
        autotune_cache=args.autotune_cache or None,
        kernel_trials=args.kernel_trials,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["batch"]:
        return batch_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.selfcheck_only and args.selfcheck == "off":
        parser.error("--selfcheck-only runs the self-check: it cannot be combined with --selfcheck off")
    configure_logging(args.log_level, args.log_format)
    log = logging.getLogger("clef_serve")
    planned, description = check_before_loading(args, parser, log)
    if planned is not None:
        return planned
    if args.selfcheck_only:
        from clef_cuda.errors import ReleaseError

        try:
            return selfcheck_only(args)
        except ReleaseError as error:  # a tensor the config check could not see: still the model's fault
            parser.exit(EXIT_USAGE, f"clef-serve: error: {error}\n")

    from app.server import DrainingServer, create_app

    settings = server_settings(args, description)
    app = create_app(
        settings, load_engine=lambda: make_engine(args, lambda *lost: app.state.tensor_parallel_lost(*lost))
    )
    log.info("listening on %s:%d (model loading in the background; /ready says when it is done)", args.host, args.port)
    # Request bodies and the API key are never logged (no access log; errors name no body or header).
    DrainingServer.run_app(app, args.host, args.port, args.log_level, args.drain_timeout)
    return 0


def build_batch_parser() -> argparse.ArgumentParser:
    """clef-serve batch: the serving flags and its own group."""
    parser = build_parser(
        "clef-serve batch",
        "Score a file of System One requests (JSON lines) into OUTPUT, in input order, with the serving flags' "
        "model and engine; a rerun resumes.",
    )
    batch_flags = parser.add_argument_group("batch: the files and how the engine is fed (docs/clients.md)")
    batch_flags.add_argument(
        "input",
        metavar="INPUT.jsonl",
        help="one request a line: a System One body or "
        '{"custom_id", "method", "url", "body"} (the OpenAI / vLLM batch form)',
    )
    batch_flags.add_argument("output", metavar="OUTPUT.jsonl", help="one record a line, in input order; appended to")
    batch_flags.add_argument(
        "--max-in-flight",
        type=_positive_int,
        metavar="ROWS",
        help="submitted at once (default: 4 x --max-num-seqs)",
    )
    batch_flags.add_argument(
        "--read-ahead",
        type=_positive_int,
        default=1024,
        metavar="ROWS",
        help="read ahead of the last written; a state's rows group in it",
    )
    batch_flags.add_argument(
        "--no-progress", action="store_true", help="no progress bar (the summary is still printed)"
    )
    batch_flags.add_argument(
        "--retry-failed",
        action="store_true",
        help="resuming, ask the rows OUTPUT records as failed again",
    )
    return parser


def batch_main(argv: list[str]) -> int:
    """clef-serve batch INPUT.jsonl OUTPUT.jsonl [the serving flags]: app/batch.py."""
    import asyncio

    from app import batch

    parser = build_batch_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    log = logging.getLogger("clef_serve")
    if args.log_level != "debug":  # a line per row would bury the progress bar: the summary counts them
        logging.getLogger("clef_serve.requests").setLevel(logging.WARNING)
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        source, sink = batch.check_paths(args.input, args.output)
        batch.resume_point(source, sink)  # another file's OUTPUT is refused before the model loads
    except batch.BatchFileError as error:
        parser.exit(EXIT_USAGE, f"{parser.prog}: error: {error}\n")
    planned, description = check_before_loading(args, parser, log)
    if planned is not None:
        return planned
    from app.server import create_app
    from clef_cuda.errors import ReleaseError

    try:
        engine = make_engine(args)
    except ReleaseError as error:
        parser.exit(EXIT_USAGE, f"{parser.prog}: error: {error}\n")
    app = create_app(server_settings(args, description), engine=engine)
    in_flight = args.max_in_flight or 4 * args.max_num_seqs
    try:
        summary = asyncio.run(
            batch.run(
                app,
                source,
                sink,
                in_flight,
                max(args.read_ahead, in_flight),
                not args.no_progress,
                log,
                retry_failed=args.retry_failed,
            )
        )
    except RuntimeError as error:  # the model never became ready (a failed self-check, a lost rank)
        print(f"{parser.prog}: {error}", file=sys.stderr)
        return batch.EXIT_FAILED
    except KeyboardInterrupt:  # the second Ctrl-C: OUTPUT holds every row written so far, whole
        print(f"{parser.prog}: stopped; rerun the same command to resume", file=sys.stderr)
        return batch.EXIT_INTERRUPTED
    print(summary.describe(), file=sys.stderr)
    if summary.stopped is not None:  # the rows from stopped_at on are unwritten: the rerun asks them
        print(
            f"{parser.prog}: stopped: the server refuses to answer (lines from {summary.stopped_at} on not written): "
            f"{summary.stopped}",
            file=sys.stderr,
        )
        return batch.EXIT_FAILED
    if summary.interrupted:
        return batch.EXIT_INTERRUPTED
    return batch.EXIT_FAILED if summary.failed else 0


if __name__ == "__main__":
    sys.exit(main())
