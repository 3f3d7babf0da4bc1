"""The start-up autotune: the tunes (clef_cuda.tuning.tunes) run once per device and configuration, their choices
installed on the trunk with the guarded op library, cached on disk and reported.

The table (op, bucket, candidate, ms, what happened) is logged, returned by /ready and exported
(clef_kernel_choice). Choices are cached on disk keyed by device name, driver, torch and package version, dtype,
shapes and buckets, so a restart with the same key pays nothing.

Fail-safe on a GPU: a kernel that has never run on this device can fault in a way no exception handler
survives (an illegal address destroys the CUDA context). So with no cache entry for the device the whole
first tune, and a trial of every other op's kernel at the model's shapes, runs in a child process
(clef_cuda.tuning.trials); a kernel that crashes, hangs or poisons that process is recorded in the report
as failed, and the child is started again without it. The serving trunk runs on a GuardedOps library
(clef_cuda.verification.guarded_ops) that keeps every failed kernel from running: its op runs the reference, or
attention another kernel. A fault that still happens while serving is recorded in the same cache
(record_kernel_failure), so the next start skips that kernel too. `failures` in the report, /ready and the
log list them.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

import clef_cuda
from clef_cuda.kernels import ops
from clef_cuda.kernels.cpu_features import cpu_gemm_features, cpu_model
from clef_cuda.model.trunk import Trunk
from clef_cuda.tuning.tunes import (
    AUTOTUNE_MODES,
    KERNEL_TRIALS,
    AttentionImpl,
    AttentionPolicy,
    AutotuneReport,
    Bucket,
    DeltaRulePolicy,
    TuneTarget,
    attention_buckets,
    attention_candidates,
    candidate_kernel,
    delta_rule_buckets,
    int8_policy,
    int8_tuning_weight,
    tune_attention,
    tune_delta_rule,
    tune_int8_linear,
)
from clef_cuda.verification.guarded_ops import GuardedOps

log = logging.getLogger("clef_cuda.tuning.autotune")


# ---- the cache and the entry point --------------------------------------------------------------------
NVIDIA_DRIVER_FILE = Path("/proc/driver/nvidia/version")


def cuda_driver_version(driver_file: Path = NVIDIA_DRIVER_FILE) -> str:
    """The NVIDIA driver's version ("580.159.04"), which JIT-compiles PTX and so belongs in the cache key; else
    the CUDA version the driver supports ("cuda 13000", from libcuda); else "unknown". Never raises: torch has
    no public call for it (torch 2.11 has neither torch.cuda.driver_version nor _cuda_getDriverVersion, and
    the first GPU run of the autotune failed on that)."""
    try:
        match = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)", driver_file.read_text())
        if match:
            return match.group(1)
    except OSError:
        pass
    try:
        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            return f"cuda {version.value}"
    except (OSError, AttributeError):
        pass
    return "unknown"


def cache_key(trunk: Trunk, config, mode: str, buckets: list[Bucket]) -> dict:
    """What makes a tuning valid: the device and its software, the model's attention shapes, the buckets."""
    device = trunk.device
    if device.type == "cuda":
        where = {"device": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}
        where["driver"] = cuda_driver_version()
    else:
        where = {"device": f"cpu {platform.processor() or platform.machine()}", "cpu_isa": ops.cpu_isa()}
        where["cpu_model"] = cpu_model()
        # What torch's GEMMs may use here: a cap on oneDNN (CLEF_CPU_ISA, ONEDNN_MAX_CPU_ISA) changes their speed.
        where["gemm"] = cpu_gemm_features(where["cpu_isa"]).describe()
        where["threads"] = torch.get_num_threads()
    c = trunk.config
    return where | {
        "torch": torch.__version__,
        "clef_cuda": clef_cuda.__version__,
        "mode": mode,
        "dtype": str(trunk.dtype),
        "quantized": trunk.quantized,
        "shapes": [c.num_attention_heads, c.num_key_value_heads, c.head_dim, config.block_size],
        "buckets": [asdict(b) for b in buckets],
        "delta_rule": [
            [c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim],
            [asdict(b) for b in delta_rule_buckets(config)] if mode != "off" else [],
        ],
    }


def cache_file(directory: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return directory / f"autotune-{digest}.json"


def autotune(
    trunk: Trunk, config, mode: str = "fast", cache_dir: str | Path | None = None, trials: str = "auto"
) -> AutotuneReport | None:
    """Tune `trunk` for an engine with `config` (EngineConfig), install the choices and the guarded op library
    on it (trunk.attention_choice, trunk.ops) and return the report. A cache file with the same key is used
    instead of tuning. `trials` says where never-run kernels are first tried (KERNEL_TRIALS; auto: in a child
    process on a GPU, where even --autotune off tries every kernel there first). None: mode "off" inline."""
    if mode not in AUTOTUNE_MODES:
        raise ValueError(f"--autotune must be one of {', '.join(AUTOTUNE_MODES)}, got {mode!r}")
    if trials not in KERNEL_TRIALS:
        raise ValueError(f"--kernel-trials must be one of {', '.join(KERNEL_TRIALS)}, got {trials!r}")
    in_child = trials == "child" or (trials == "auto" and trunk.device.type == "cuda")
    if mode == "off" and not in_child:
        install(trunk, AutotuneReport(mode, {}), [], None, config)
        return None
    buckets = (
        []
        if mode == "off"
        else attention_buckets(mode, config.max_num_seqs, config.prefill_chunk_size, config.max_model_len)
    )
    key = cache_key(trunk, config, mode, buckets)
    path = cache_file(Path(cache_dir), key) if cache_dir else None
    report = read_cached(path, key) if path is not None else None
    if report is None:
        started = time.monotonic()
        if in_child:
            from clef_cuda.tuning.trials import tune_in_trials

            report = tune_in_trials(trunk, config, mode, buckets, key)
        else:
            report = AutotuneReport(mode, key)
            with torch.inference_mode():
                tune_attention(TuneTarget.of(trunk), buckets, mode, config.block_size, report)
                if mode != "off":
                    tune_delta_rule(TuneTarget.of(trunk), config, mode, report)
                if trunk.quantized and mode != "off":  # (a trial process tunes it there, on its shape)
                    tune_int8_linear(TuneTarget.of(trunk), int8_tuning_weight(trunk), config, mode, report)
        report.seconds = time.monotonic() - started
        if path is not None and report.cacheable:
            _write(path, {"key": key, "report": report.to_json()})
    install(trunk, report, buckets, path if report.cacheable else None, config)
    if not report.cacheable:
        log.error(
            "kernel trials %s: this process keeps every untried kernel from running (a restart tries again)",
            report.trials,
        )
    if report.failures:
        log.error(
            "kernels that failed on this device and will not run: %s",
            "; ".join(f"{kernel} ({why})" for kernel, why in report.failures.items()),
        )
    return report


def read_cached(path: Path, key: dict) -> AutotuneReport | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("key") == key:
            return AutotuneReport.from_json(data["report"], key)
    except (OSError, ValueError, KeyError, TypeError) as error:
        log.warning("autotune cache %s is unreadable (%s): tuning again", path, error)
    return None


def install(
    trunk: Trunk,
    report: AutotuneReport,
    buckets: list[Bucket],
    cache_path: Path | None = None,
    config=None,
    on_failure: Callable[[str, str], None] | None = None,
) -> None:
    """The guarded op library (every failed kernel kept from running; a launch failure while serving added to
    the report and its cache file, or handed to `on_failure`) and the attention choices that do not run a failed
    kernel. Under tensor parallel the same decisions go to every worker rank, and a kernel a worker marks failed
    is recorded here too."""
    base = trunk.ops.base if isinstance(trunk.ops, GuardedOps) else trunk.ops

    def record(kernel: str, why: str) -> None:
        report.failures[kernel] = why
        if cache_path is not None and report.key:
            record_kernel_failure(cache_path, report.key, kernel, why)

    trunk.ops = GuardedOps(base, report.failures, on_failure or record)
    attention = {
        bucket: candidate
        for bucket, candidate in report.choices.get("paged_attention", {}).items()
        if candidate_kernel(candidate) not in report.failures
    }
    trunk.attention_choice = AttentionPolicy(buckets, attention, attributed_candidates(trunk))
    delta_rule = {
        bucket: kernel
        for bucket, kernel in report.choices.get("gated_delta_rule_chunk", {}).items()
        if f"gated_delta_rule_chunk:{kernel}" not in report.failures
    }
    use = delta_rule and config is not None
    trunk.delta_rule_choice = DeltaRulePolicy(delta_rule_buckets(config), delta_rule, trunk.ops.failed) if use else None
    int8 = report.choices.get("int8_linear", {}) if config is not None else {}
    if f"int8_linear:{trunk.device.type}" in report.failures:  # the guarded library would run the reference
        int8 = {bucket: impl for bucket, impl in int8.items() if impl != "fused"}
        trunk.int8_by_rows = int8_policy(int8, config) if int8 else [(sys.maxsize, "dequantize+gemm")]
    elif int8:
        trunk.int8_by_rows = int8_policy(int8, config)
    if trunk.peers is not None and config is not None:
        trunk.peers.on_kernel_failed = trunk.ops.mark_failed
        trunk.peers.install(trunk, report, buckets, config)


def attributed_candidates(trunk: Trunk) -> dict[str, AttentionImpl]:
    """The attention candidates on the trunk's guarded library, each naming its kernel as the last launch
    before it runs, so that a fault inside torch's SDPA is pinned on that backend, not on our last kernel."""
    guarded = trunk.ops

    def attributed(impl: AttentionImpl, kernel: str) -> AttentionImpl:
        def run(*args):
            guarded.last_launch = kernel
            return impl(*args)

        return run

    return {
        name: impl if name.startswith("ours") else attributed(impl, candidate_kernel(name))
        for name, impl in attention_candidates(trunk).items()
    }


def record_kernel_failure(path: Path, key: dict, kernel: str, why: str) -> None:
    """Add a failed kernel to the cache file of `key` (created if missing), so the next start with this key
    skips it. Never raises: it runs on the way out of a process whose GPU just faulted."""
    try:
        data = json.loads(path.read_text()) if path.is_file() else None
        if not data or data.get("key") != key:
            data = {"key": key, "report": AutotuneReport(key.get("mode", "fast"), key).to_json()}
        data["report"].setdefault("failures", {})[kernel] = why
        _write(path, data)
    except Exception as error:  # the log line is all that can be done
        log.error("could not record the failed kernel %s in %s: %s", kernel, path, error)


def _write(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError as error:  # a read-only home in a container: tune again next time
        log.warning("the autotune cache %s could not be written (%s)", path, error)
