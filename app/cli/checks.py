"""Everything checked before the (slow) load, each failure one line and exit 2: the device and dtype, the release,
the adapters, tensor parallel, the memory plan; and the served model's name and description."""

from __future__ import annotations

import argparse
from pathlib import Path

from app.cli.engine import parse_adapters, resolve_device, resolve_dtype
from app.cli.flags import EXIT_USAGE
from app.cli.plan import check_plan


def check_before_loading(args, parser, log) -> tuple[int | None, str]:
    """Everything that can be checked before the (slow) load, each failure one line and exit 2: (the --plan
    exit code, or None to go on; the model's description for /v1/models). Fills in --w with the embedded
    model when it is absent."""
    from clef_cuda.errors import ReleaseError
    from clef_cuda.model.adapters import AdapterError
    from clef_cuda.model.config import context_length, load_release_config, past_training
    from clef_cuda.model.weights import check_not_prequantized

    try:
        import clef_cuda.kernels.ops  # noqa: F401  (applies CLEF_CPU_ISA: ValueError for a variant this CPU lacks)

        resolve_device(args.device)
        if args.otlp_traces_endpoint:  # the URL and the optional packages, before the load
            from app.tracing import check_available, traces_url

            traces_url(args.otlp_traces_endpoint)
            check_available()
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
        release = load_release_config(args.weights)
        args.max_model_len = context_length(release.trunk, args.max_model_len, args.allow_long_context)
        if args.plan and (warning := past_training(release.trunk, args.max_model_len)):
            log.warning(warning)  # a start warns from the Decider as it loads; --plan loads nothing
        check_adapters(args, release)
        check_tensor_parallel(args, release, log)
        check_not_prequantized(args.weights, release.fp8_block_size)
        if dtype_line:
            log.log(*dtype_line)
        return check_plan(args, log), description
    except (ValueError, ImportError, ReleaseError, AdapterError) as error:
        parser.exit(EXIT_USAGE, f"{parser.prog}: error: {error}\n")


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
