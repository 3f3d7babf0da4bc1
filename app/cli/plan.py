"""--plan and the plan every start checks: the memory plan for the flags on --gpu-memory or the device's free
memory (clef_cuda.serving.plan), printed with exit 0 or EXIT_PLAN_DOES_NOT_FIT, or a one-line error before the load."""

from __future__ import annotations

import functools

from app.cli.engine import engine_config, resolve_device
from app.cli.flags import DTYPES

EXIT_PLAN_DOES_NOT_FIT = 3  # --plan: the release does not fit the memory planned for


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
