"""What the flags describe: the device and dtype, the release loaded onto it (the decider), the LoRA variants, the
engine and its configuration, the HTTP server's settings. Each function imports torch and clef_cuda inside it:
--help stays instant."""

from __future__ import annotations

import logging
from pathlib import Path

from app.cli.flags import DTYPES


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


def make_decider(args, on_lost=None):
    """Load the release onto the serving device in the serving dtype."""
    import torch

    from clef_cuda import Decider
    from clef_cuda.request.images import ImageLimits
    from clef_cuda.request.videos import VideoLimits

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
        allow_long_context=args.allow_long_context,
        state_overflow=args.state_overflow,
        confidence=args.confidence,
        client_special_tokens=args.client_special_tokens,
        image_limits=ImageLimits(max_images=args.max_images),
        video_limits=VideoLimits(
            max_videos=args.max_videos,
            max_bytes=args.max_video_mib * 2**20,
            max_seconds=args.max_video_seconds,
            max_decode_seconds=args.video_decode_budget,
            decode_threads=video_decode_threads(args),
        ),
        image_max_pixels=args.image_max_pixels,
        progress=args.log_format == "text",  # a progress bar is not a JSON line
        quantize=args.quantize,
        vocab_tables=args.vocab_tables if args.vocab_tables != "auto" else "device",
        tensor_parallel=group,
    )


def video_decodes(args) -> int:
    """--max-video-decodes, or its default from the cores (app.context.default_video_decodes)."""
    from app.context import default_video_decodes

    return args.max_video_decodes or default_video_decodes()


def video_decode_threads(args) -> int:
    """FFmpeg's threads for one video: its slot's share of the cores (at least 1), so concurrent decodes do not
    oversubscribe the cores; FFmpeg's own choice for one decode, the cores + 1, was no faster on 2 cores
    (benchmarks/video_worst_case.py)."""
    from app.context import usable_cores

    return max(1, usable_cores() // video_decodes(args))


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
        max_num_seqs=args.max_num_seqs,
        prefill_chunk_size=args.prefill_chunk_size,
        max_model_len=args.max_model_len,
        allow_long_context=args.allow_long_context,
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
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        status_page=args.status_page,
        quantize=args.quantize,
        tensor_parallel_size=args.tensor_parallel_size,
        max_video_decodes=video_decodes(args),
    )
