"""Kernel trials: the first run of every kernel on a device happens in a child process, so that one which
faults cannot take the server down.

An illegal or misaligned address inside a CUDA kernel is a sticky error: the process's CUDA context is gone,
every later call fails, and no `except` brings it back; a kernel that deadlocks never returns. A server that
met such a kernel at start-up would die, and Kubernetes would restart it into the same death. So, on a device
with no autotune cache entry, the server (clef_cuda.tuning.autotune) starts `python -m
clef_cuda.tuning.trials` (clef_cuda.runtime.children: the start budget, reaped on every way out), which, from the
model's config alone (no weights; the whole card is the parent's minus what it loaded), runs everything the
server will run:

1. each op's kernel (conv, each delta rule kernel, cache write, the fused glue, int8 dequantize and the fused int8
   GEMM) on the self-check's inputs at the model's shapes (clef_cuda.verification.selfcheck),
2. the self-check's real-layer checks, one delta net and one attention layer through the ops, on random weights
   of the model's layer shapes (int8 with --quantize int8),
3. the start-up autotune's attention candidates (each forced kernel, ours, torch's SDPA backends, verified
   against the reference and timed per bucket), its delta rule kernels (serial, chunked) the same way and, with
   int8 weights, its int8 GEMM candidates on a random weight of the model's largest shape,

announcing each unit on stdout before it runs it, each of our kernels as it launches, and synchronising the
device after each. The parent reads the announcements: when the child dies (a signal, an exit), hangs past
UNIT_TIMEOUT_S, or reports a unit that left a sticky CUDA error or could not launch, the kernel in flight (else
the unit) is recorded as failed (named with what happened) and a new child runs everything again without it.
The last child's report (the tune) and the failures come back to the parent, which never runs a failed kernel
(clef_cuda.verification.guarded_ops; a failed real-layer unit fails that self-check) and caches both.

A child that cannot start (it dies before it has a CUDA context, or reports the device busy or out of memory:
an exclusive-process GPU, a transient out-of-memory) says nothing about any kernel: the trials are
"unavailable", logged and shown in /ready, every untried kernel is kept from running in this process only, and
nothing is cached, so the next start tries again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from types import SimpleNamespace

import torch

from clef_cuda.model.config import FULL_ATTENTION, LINEAR_ATTENTION, TrunkConfig
from clef_cuda.runtime.children import START_TIMEOUT_S, Child, die_with_parent
from clef_cuda.runtime.cuda_errors import LAUNCH, OUT_OF_MEMORY, STICKY, TRANSIENT, classify, first_line
from clef_cuda.verification.guarded_ops import GUARDED_OPS, KERNEL_CHOICES, GuardedOps, KernelFault

log = logging.getLogger("clef_cuda.tuning.trials")

# A unit that takes longer than this hung (a kernel that deadlocks never returns); the child's start (torch's
# import, the CUDA context) has the supervisor's START_TIMEOUT_S.
UNIT_TIMEOUT_S = 120.0
STICKY_EXIT = 3  # the child's exit after a unit left the CUDA context unusable
UNAVAILABLE_EXIT = 5  # the child's exit when it could not get going on the device
START_ATTEMPTS, START_RETRY_S = 3, 1.0  # a child that cannot start is tried this often (a transient out-of-memory)
# The real-layer units, named as failures name them: a crash outside our kernels fails the self-check's check.
LAYER_UNITS = {"selfcheck:delta_net": LINEAR_ATTENTION, "selfcheck:attention": FULL_ATTENTION}
# The command that starts a trial process (its spec comes on stdin). Never read from the environment: only a test's
# own launcher replaces it, with a script that installs a fault and then runs main() (tests/trial_faults.py).
CHILD_COMMAND: tuple[str, ...] = (sys.executable, "-m", "clef_cuda.tuning.trials")


# ---- the parent side ------------------------------------------------------------------------------------
@dataclass
class ChildOutcome:
    report: dict | None = None  # the tune's report (AutotuneReport.to_json), when the child finished
    failed: dict[str, str] = field(default_factory=dict)  # kernels the child itself saw fail
    passed: set[str] = field(default_factory=set)  # units that ended ok
    in_flight: str | None = None  # the unit announced and never finished
    launched: str | None = None  # the kernel launched and not done: the one that took the child down
    started: bool = False  # the child got going on its device (its announcements began)
    why: str = ""  # how the child ended, when it did not finish

    @property
    def culprit(self) -> str | None:
        return self.launched or self.in_flight


def trial_spec(trunk, config, mode: str, buckets) -> dict:
    """What the child needs to rebuild the tune and the checks from the config alone."""
    from clef_cuda.kernels import ops
    from clef_cuda.tuning.tunes import int8_tuning_weight

    device = trunk.device
    int8_weight = int8_tuning_weight(trunk) if trunk.quantized else None
    return {
        "device": str(device) if device.type != "cuda" else f"cuda:{device.index or 0}",
        "dtype": str(trunk.dtype).removeprefix("torch."),
        "config": asdict(trunk.config),
        "mode": mode,
        "block_size": config.block_size,
        "buckets": [asdict(b) for b in buckets],
        "quantized": trunk.quantized,
        "int8_shape": list(int8_weight.shape) if int8_weight is not None else None,
        "int8_config": {"max_num_seqs": config.max_num_seqs, "prefill_chunk_size": config.prefill_chunk_size},
        "cpu_isa": ops.cpu_isa() if device.type == "cpu" else None,
        "parent": os.getpid(),
        "failed": {},
    }


def tune_in_trials(trunk, config, mode: str, buckets, key: dict):
    """The autotune's report for `trunk`, tuned in trial processes, with every kernel that failed in them in
    `report.failures` (clef_cuda.tuning.autotune calls this on a GPU with no cache entry)."""
    from clef_cuda.tuning.tunes import AutotuneReport

    spec = trial_spec(trunk, config, mode, buckets)
    failures: dict[str, str] = {}
    passed: set[str] = set()
    attempts = len(GUARDED_OPS) + len(LAYER_UNITS) + 12  # every unit failing once, one process each, and then some
    why = "no trial process ran"
    starts = 0
    for _ in range(attempts):
        outcome = run_child(spec | {"failed": failures})
        passed |= outcome.passed
        new = {k: v for k, v in outcome.failed.items() if k not in failures}
        failures |= outcome.failed
        if outcome.report is not None:
            report = AutotuneReport.from_json(outcome.report, key, cached=False)
            report.failures, report.trials = failures, "child"
            return report
        why = outcome.why
        if not outcome.started:  # it never got going: nothing is known about any kernel
            starts += 1
            if starts >= START_ATTEMPTS:
                return _unavailable(trunk, mode, key, failures, passed, why)
            log.warning("the kernel trial process %s; starting it again", why)
            time.sleep(START_RETRY_S)
            continue
        if outcome.culprit is not None:
            failures[outcome.culprit] = outcome.why
            log.error("kernel %s %s; trying the others in a new trial process", outcome.culprit, outcome.why)
        elif not new:
            break  # it died outside any unit: starting it again would do the same
    return _unavailable(trunk, mode, key, failures, passed, why)


def _unavailable(trunk, mode: str, key: dict, failures: dict[str, str], passed: set[str], why: str):
    """No trial process got through: the kernels it did not see pass may not run in this process (they keep
    their op on the reference), and none of that is cached (report.cacheable is false)."""
    from clef_cuda.tuning.tunes import AutotuneReport

    log.error(
        "kernel trials unavailable (%s): every kernel not seen to pass runs the reference ops until a restart", why
    )
    untried = {k: f"untried: the kernel trials were unavailable ({why})" for k in all_kernels(trunk.device)}
    kept = {k: v for k, v in untried.items() if k not in passed and k not in failures}
    return AutotuneReport(mode, key, failures=failures | kept, trials=f"unavailable: {why}")


def all_kernels(device: torch.device) -> list[str]:
    where = "cuda" if device.type == "cuda" else "cpu"
    attention = ["auto", "simt", "wmma", "wmma2"] if where == "cuda" else ["cpu"]
    delta_rule = ["auto", "serial", "chunked"] if where == "cuda" else ["cpu"]
    return (
        [f"{op}:{where}" for op in GUARDED_OPS]
        + [f"paged_attention:{k}" for k in attention]
        + [f"gated_delta_rule_chunk:{k}" for k in delta_rule]
    )


def run_child(spec: dict) -> ChildOutcome:
    """One trial process over `spec`; what it announced, and how it ended. The child is reaped on every way out."""
    outcome = ChildOutcome()
    with tempfile.TemporaryFile(mode="w+") as stderr:
        child = Child(
            "the kernel trial process",
            list(CHILD_COMMAND),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        try:
            hung = _follow(child, spec, outcome)
            code = child.process.wait() if hung is None else None
        finally:
            if child.alive():
                child.process.kill()
            child.reap(1.0)
        stderr.seek(0)
        tail = [line.strip() for line in stderr.read().splitlines() if line.strip()]
    if hung is not None:
        outcome.why = hung
        return outcome
    if outcome.report is not None and code == 0:
        outcome.in_flight = outcome.launched = None
        return outcome
    outcome.report = None
    if not outcome.why:
        outcome.why = f"crashed its trial process ({child.how_ended()})" + (f": {tail[-1][:200]}" if tail else "")
    return outcome


def _follow(child: Child, spec: dict, outcome: ChildOutcome) -> str | None:
    """Read the child's announcements into `outcome` until it ends; what happened when it hung (it is killed)."""
    process = child.process
    try:
        process.stdin.write(json.dumps(spec))
        process.stdin.close()
    except OSError:  # it died before reading its spec (BrokenPipeError): how it ended is read by the caller
        pass
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in process.stdout] + [lines.put(None)], daemon=True).start()
    while True:
        timeout = UNIT_TIMEOUT_S if outcome.started else max(0.0, child.started + START_TIMEOUT_S - time.monotonic())
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:  # a unit (or the start) that never answered: a kernel that hangs
            process.kill()
            if not outcome.started:
                return f"did not start within {START_TIMEOUT_S:.0f} s"
            return f"hung its trial process (no answer in {timeout:.0f} s)"
        if line is None:
            return None
        try:
            event = json.loads(line)
        except ValueError:
            continue  # not ours (the child sends its own output to stderr, but a library may print)
        kind = event.get("event")
        if kind == "started":
            outcome.started = True
        elif kind == "unavailable":
            outcome.why = f"could not start on the device: {event['why']}"
        elif kind == "begin":
            outcome.in_flight, outcome.launched = event["unit"], None
        elif kind == "launch":
            outcome.launched = event["kernel"]
        elif kind == "done":
            outcome.launched = None
        elif kind == "end":
            if event["result"] == "ok":
                outcome.passed.add(event["unit"])
            elif event["result"].startswith("left a CUDA error"):
                outcome.failed[outcome.launched or event["unit"]] = event["result"]
            outcome.in_flight = outcome.launched = None
        elif kind == "failed":
            outcome.failed[event["kernel"]] = event["why"]
        elif kind == "report":
            outcome.report = event["report"]


# ---- the child side -------------------------------------------------------------------------------------
class _Announcer:
    """The child's units: each announced before it runs, the device synchronised after; a unit that leaves a
    sticky CUDA error ends the process (nothing can run on the device after it)."""

    def __init__(self, out, device: torch.device) -> None:
        self.out, self.device = out, device

    def emit(self, **event) -> None:
        self.out.write(json.dumps(event) + "\n")
        self.out.flush()

    def failed(self, kernel: str, why: str) -> None:
        self.emit(event="failed", kernel=kernel, why=why)

    @contextlib.contextmanager
    def __call__(self, unit: str) -> Iterator[None]:
        self.emit(event="begin", unit=unit)
        try:
            yield
            self.synchronize()
        except Exception as error:
            kernel = error.kernel if isinstance(error, KernelFault) else unit
            kind = STICKY if isinstance(error, KernelFault) else classify(error)
            if kind == STICKY:
                if kernel != unit:
                    self.failed(kernel, f"left a CUDA error: {first_line(error)}")
                self.emit(event="end", unit=unit, result=f"left a CUDA error: {first_line(error)}")
                os._exit(STICKY_EXIT)
            if kind == LAUNCH:
                self.failed(kernel, f"could not launch: {first_line(error)}")
            self.emit(event="end", unit=unit, result=f"raised: {first_line(error)}")
            raise
        self.emit(event="end", unit=unit, result="ok")

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class _AnnouncedOps:
    """An op library that announces each of our kernels as it launches and synchronises after it, so that a
    crash inside a unit (a real layer runs several kernels) is pinned on the kernel that was running."""

    def __init__(self, base, announce: _Announcer) -> None:
        self.base, self.announce = base, announce

    def __getattr__(self, name: str):
        target = getattr(self.base, name)
        if name not in GUARDED_OPS and name not in KERNEL_CHOICES:
            return target

        def run(*args, **kwargs):
            where = "cuda" if self.announce.device.type == "cuda" else "cpu"
            kernel = f"{name}:{where}"
            if name in KERNEL_CHOICES and where == "cuda":  # the kernel this call runs, by name
                chosen = kwargs.get("kernel", "auto")
                if chosen == "auto":
                    dispatch, positions, _ = KERNEL_CHOICES[name]
                    chosen = getattr(self.base, dispatch)(*(args[i] for i in positions))
                kernel = f"{name}:{chosen}"
            self.announce.emit(event="launch", kernel=kernel)
            out = target(*args, **kwargs)
            self.announce.synchronize()
            self.announce.emit(event="done")
            return out

        return run


def _trunk_config(data: dict) -> TrunkConfig:
    return TrunkConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def layer_trunk(config: TrunkConfig, dtype: torch.dtype, device: torch.device, quantized: bool, ops_):
    """A trunk of two layers at the model's layer shapes, a delta net then an attention layer, on random weights
    (int8 when `quantized`): what the self-check's real-layer checks run on in a trial process."""
    from clef_cuda.model.quantize import is_quantized_name, quantize_int8
    from clef_cuda.model.trunk import Trunk
    from clef_cuda.model.weights import trunk_shapes

    two = replace(config, layer_types=(LINEAR_ATTENTION, FULL_ATTENTION))
    generator = torch.Generator().manual_seed(3)
    weights: dict = {"embed_tokens.weight": None, "lm_head.weight": None}
    for name, shape in trunk_shapes(two).items():
        if name in weights:
            continue
        floating = name.endswith(("norm.weight", "A_log", "dt_bias", "conv1d.weight"))
        tensor = torch.randn(shape, generator=generator) * (0.1 if floating else 0.02)
        tensor = tensor.to(device, torch.float32 if floating else dtype)
        weights[name] = quantize_int8(tensor, dtype) if quantized and is_quantized_name(name) else tensor
    return Trunk(two, weights, dtype, ops=ops_)


def _start_on(device: torch.device) -> None:
    """Get going on the device (its CUDA context)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.zeros(1, device=device).add_(1)


def main() -> int:
    # stdout carries the announcements alone: anything else a library prints goes to stderr.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    spec = json.loads(sys.stdin.read())
    die_with_parent(spec["parent"])

    from clef_cuda.kernels import ops
    from clef_cuda.tuning.tunes import (
        AutotuneReport,
        Bucket,
        TuneTarget,
        random_int8_weight,
        tune_attention,
        tune_delta_rule,
        tune_int8_linear,
    )
    from clef_cuda.verification.selfcheck import SelfCheckCases, op_trial_units

    if spec.get("cpu_isa"):
        ops.set_cpu_isa(spec["cpu_isa"])
    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    announce = _Announcer(out, device)
    try:
        _start_on(device)
    except Exception as error:
        if classify(error) in (TRANSIENT, OUT_OF_MEMORY, STICKY) or "cuda" in str(error).lower():
            announce.emit(event="unavailable", why=first_line(error))
            return UNAVAILABLE_EXIT
        raise
    announce.emit(event="started")
    library = GuardedOps(_AnnouncedOps(ops._default, announce), spec["failed"], on_failure=announce.failed)
    config = _trunk_config(spec["config"])
    target = TuneTarget(library, config, device, dtype)
    report = AutotuneReport(spec["mode"], {}, failures=dict(spec["failed"]))
    with torch.inference_mode():
        for unit, run in op_trial_units(target, spec["block_size"], spec["quantized"]):
            if unit in spec["failed"]:
                continue
            with contextlib.suppress(Exception), announce(unit):  # a raise is the self-check's to judge
                run()
        layers = None
        for unit, kind in LAYER_UNITS.items():
            if unit in spec["failed"] or (kind == FULL_ATTENTION and not config.attention_layers):
                continue
            with contextlib.suppress(Exception), announce(unit):
                layers = layers or layer_trunk(config, dtype, device, spec["quantized"], library)
                index = 0 if kind == LINEAR_ATTENTION else 1
                SelfCheckCases.of(layers, spec["block_size"]).layer_check(unit, index)
        del layers
        buckets = [Bucket(**b) for b in spec["buckets"]]
        tune_attention(target, buckets, spec["mode"], spec["block_size"], report, trial=announce)
        step_config = SimpleNamespace(**spec["int8_config"])  # --max-num-seqs, --prefill-chunk-size
        if spec["mode"] != "off":
            tune_delta_rule(target, step_config, spec["mode"], report, trial=announce)
        if spec["int8_shape"] is not None and spec["mode"] != "off":
            weight = random_int8_weight(tuple(spec["int8_shape"]), dtype, device)
            tune_int8_linear(target, weight, step_config, spec["mode"], report, trial=announce)
    announce.emit(event="report", report=report.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
