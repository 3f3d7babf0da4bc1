"""Kernel trials: the first run of every kernel on a device happens in a child process, so that one which
faults cannot take the server down.

An illegal or misaligned address inside a CUDA kernel is a sticky error: the process's CUDA context is gone,
every later call fails, and no `except` brings it back; a kernel that deadlocks never returns. A server that
met such a kernel at start-up would die, and Kubernetes would restart it into the same death. So, on a device
with no autotune cache entry, the server (clef_cuda.serving.autotune) starts `python -m
clef_cuda.serving.trial`, which, from the model's config alone (no weights; the whole card is the parent's
minus what it loaded):

1. runs each op's kernel (conv, delta rule, cache write, the fused glue, int8 dequantize) on the self-check's
   inputs at the model's shapes (clef_cuda.serving.selfcheck),
2. runs the start-up autotune's attention candidates: each forced kernel, ours, torch's SDPA backends,
   verified against the reference and timed per bucket,

announcing each unit on stdout before it runs it and synchronising the device after. The parent reads the
announcements: when the child dies (a signal, an exit), hangs past UNIT_TIMEOUT_S, or reports a unit that
left a sticky CUDA error or could not launch, that unit's kernel is recorded as failed (named with what
happened) and a new child runs everything again without it. The last child's report (the tune) and the
failures come back to the parent, which never runs a failed kernel (clef_cuda.serving.guarded_ops) and
caches both. If no child gets through, every kernel not seen to pass is failed, and the server runs the
reference ops: slow, never down.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch

from clef_cuda.model.config import TrunkConfig
from clef_cuda.serving.guarded_ops import GUARDED_OPS, GuardedOps, KernelFault, cuda_error_kind, first_line

log = logging.getLogger("clef_cuda.serving.trial")

# A unit that takes longer than this hung (a kernel that deadlocks never returns); the child's start (torch's
# import, the CUDA context) gets START_TIMEOUT_S.
UNIT_TIMEOUT_S = 120.0
START_TIMEOUT_S = 300.0
STICKY_EXIT = 3  # the child's exit after a unit left the CUDA context unusable


# ---- the parent side ------------------------------------------------------------------------------------
@dataclass
class ChildOutcome:
    report: dict | None = None  # the tune's report (AutotuneReport.to_json), when the child finished
    failed: dict[str, str] = field(default_factory=dict)  # kernels the child itself saw fail
    passed: set[str] = field(default_factory=set)  # units that ended ok
    in_flight: str | None = None  # the unit announced and never finished: the one that took it down
    why: str = ""  # how the child ended, when it did not finish


def trial_spec(trunk, config, mode: str, buckets) -> dict:
    """What the child needs to rebuild the tune from the config alone."""
    from clef_cuda import ops

    device = trunk.device
    return {
        "device": str(device) if device.type != "cuda" else f"cuda:{device.index or 0}",
        "dtype": str(trunk.dtype).removeprefix("torch."),
        "config": asdict(trunk.config),
        "mode": mode,
        "block_size": config.block_size,
        "buckets": [asdict(b) for b in buckets],
        "quantized": trunk.quantized,
        "cpu_isa": ops.cpu_isa() if device.type == "cpu" else None,
        "failed": {},
    }


def tune_in_trials(trunk, config, mode: str, buckets, key: dict):
    """The autotune's report for `trunk`, tuned in trial processes, with every kernel that failed in them in
    `report.failures` (clef_cuda.serving.autotune calls this on a GPU with no cache entry)."""
    from clef_cuda.serving.autotune import AutotuneReport

    spec = trial_spec(trunk, config, mode, buckets)
    failures: dict[str, str] = {}
    passed: set[str] = set()
    attempts = len(GUARDED_OPS) + 12  # every unit failing once, one process each, and then some
    why = "no trial process ran"
    for _ in range(attempts):
        outcome = run_child(spec | {"failed": failures})
        passed |= outcome.passed
        new = {k: v for k, v in outcome.failed.items() if k not in failures}
        failures |= outcome.failed
        if outcome.in_flight is not None:
            failures[outcome.in_flight] = outcome.why
            log.error("kernel %s %s; trying the others in a new trial process", outcome.in_flight, outcome.why)
        if outcome.report is not None:
            report = AutotuneReport.from_json(outcome.report, key, cached=False)
            report.failures, report.trials = failures, "child"
            return report
        why = outcome.why
        if outcome.in_flight is None and not new:
            break  # it died outside any unit: starting it again would do the same
    # No trial process got through: nothing not seen to pass may run here.
    log.error("the kernel trial process failed (%s): every kernel not seen to pass runs the reference ops", why)
    for kernel in all_kernels(trunk.device):
        if kernel not in passed and kernel not in failures:
            failures[kernel] = f"untried: the trial process failed ({why})"
    report = AutotuneReport(mode, key, failures=failures, trials="child")
    return report


def all_kernels(device: torch.device) -> list[str]:
    where = "cuda" if device.type == "cuda" else "cpu"
    attention = ["auto", "simt", "wmma", "wmma2"] if where == "cuda" else ["cpu"]
    return [f"{op}:{where}" for op in GUARDED_OPS] + [f"paged_attention:{k}" for k in attention]


def run_child(spec: dict) -> ChildOutcome:
    """One trial process over `spec`; what it announced, and how it ended."""
    outcome = ChildOutcome()
    with tempfile.TemporaryFile(mode="w+") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "clef_cuda.serving.trial"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        try:
            process.stdin.write(json.dumps(spec))
            process.stdin.close()
        except OSError:  # it died before reading its spec (BrokenPipeError): how it ended is read below
            pass
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in process.stdout] + [lines.put(None)], daemon=True).start()
        started = False
        while True:
            timeout = UNIT_TIMEOUT_S if started else START_TIMEOUT_S
            try:
                line = lines.get(timeout=timeout)
            except queue.Empty:  # a unit (or the start) that never answered: a kernel that hangs
                process.kill()
                process.wait()
                outcome.why = f"hung its trial process (no answer in {timeout:.0f} s)"
                return outcome
            if line is None:
                break
            try:
                event = json.loads(line)
            except ValueError:
                continue  # not ours (the child sends its own output to stderr, but a library may print)
            kind = event.get("event")
            started = True
            if kind == "begin":
                outcome.in_flight = event["unit"]
            elif kind == "end":
                if event["result"] == "ok":
                    outcome.passed.add(event["unit"])
                elif event["result"].startswith("left a CUDA error"):
                    outcome.failed[event["unit"]] = event["result"]
                outcome.in_flight = None
            elif kind == "failed":
                outcome.failed[event["kernel"]] = event["why"]
            elif kind == "report":
                outcome.report = event["report"]
        code = process.wait()
        stderr.seek(0)
        tail = [line.strip() for line in stderr.read().splitlines() if line.strip()]
    if outcome.report is not None and code == 0:
        outcome.in_flight = None
        return outcome
    outcome.report = None
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
    outcome.why = f"crashed its trial process ({how})" + (f": {tail[-1][:200]}" if tail else "")
    return outcome


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
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as error:
            kernel = error.kernel if isinstance(error, KernelFault) else unit
            kind = "sticky" if isinstance(error, KernelFault) else cuda_error_kind(error)
            if kind == "sticky":
                if kernel != unit:
                    self.failed(kernel, f"left a CUDA error: {first_line(error)}")
                self.emit(event="end", unit=unit, result=f"left a CUDA error: {first_line(error)}")
                os._exit(STICKY_EXIT)
            if kind == "launch":
                self.failed(kernel, f"could not launch: {first_line(error)}")
            self.emit(event="end", unit=unit, result=f"raised: {first_line(error)}")
            raise
        self.emit(event="end", unit=unit, result="ok")


def _trunk_config(data: dict) -> TrunkConfig:
    return TrunkConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def main() -> int:
    # stdout carries the announcements alone: anything else a library prints goes to stderr.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    spec = json.loads(sys.stdin.read())

    from clef_cuda import ops
    from clef_cuda.serving.autotune import AutotuneReport, Bucket, TuneTarget, tune_attention
    from clef_cuda.serving.selfcheck import op_trial_units

    if spec.get("cpu_isa"):
        ops.set_cpu_isa(spec["cpu_isa"])
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    announce = _Announcer(out, device)
    announce.emit(event="started")
    library = GuardedOps(ops._default, spec["failed"], on_failure=announce.failed)
    target = TuneTarget(library, _trunk_config(spec["config"]), device, getattr(torch, spec["dtype"]))
    report = AutotuneReport(spec["mode"], {}, failures=dict(spec["failed"]))
    with torch.inference_mode():
        for unit, run in op_trial_units(target, spec["block_size"], spec["quantized"]):
            if unit in spec["failed"]:
                continue
            with contextlib.suppress(Exception), announce(unit):  # a raise is the self-check's to judge
                run()
        buckets = [Bucket(**b) for b in spec["buckets"]]
        tune_attention(target, buckets, spec["mode"], spec["block_size"], report, trial=announce)
    announce.emit(event="report", report=report.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
