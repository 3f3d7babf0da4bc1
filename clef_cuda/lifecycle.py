"""The server's lifecycle: whether it may answer, and what each fail-safe does. The heart of "never silently
wrong" in one object, readable and testable without HTTP (app/ maps it onto /ready and the decision routes).

    LOADING -> TUNING -> SELF_CHECKING -> WARMING -> READY -> DRAINING
                  \\            \\              \\         \\          \\
                   `------------`--------------`---------`-----------`--> FAILED (a reason; an exit code where the
                                                                              process ends)

- LOADING: the weights load (on the loader's thread; /health answers meanwhile). A load that raises: FAILED, the
  process stays up unready; a tensor-parallel rank that could not start (`fatal` on the error): FAILED, exit
  EXIT_TENSOR_PARALLEL_LOST.
- TUNING: the autotune and kernel trials (clef_cuda.tuning.autotune: on a GPU every never-run kernel in a child
  process first). Never fatal: a tune that raises leaves the dispatch rule's kernels, each one guarded.
- SELF_CHECKING: every kernel against the references on this device (clef_cuda.verification.selfcheck). A failure
  under `--selfcheck enforce`: FAILED ("selfcheck_failed"), never answers, the process stays up so /ready says why;
  `warn`: logged loudly and serving goes on; `off`: not run.
- WARMING: the engine starts and answers one warm-up decision.
- READY: decisions are answered. The engine's own verification while it serves reports here: a failed timed
  self-check (timed_selfcheck_failed) under `--selfcheck enforce`, or --shadow-max-mismatches shadow mismatches
  (shadow_mismatch) under `--shadow-mode enforce`: FAILED ("verification_failed"), the process stays up, out of
  rotation, until an operator restarts it; `warn`: logged loudly and serving goes on.
- DRAINING: a SIGTERM or shutdown: new decisions are refused, in-flight ones finish (wait_until_idle).
- FAILED from anywhere: a sticky CUDA fault (kernel_fault: the kernel recorded as failed in the autotune cache, exit
  EXIT_KERNEL_FAULT) or a lost tensor-parallel rank (rank_lost: exit EXIT_TENSOR_PARALLEL_LOST), each after
  `exit_delay` seconds so in-flight requests get their 503 first. FAILED is final: nothing leaves it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

from clef_cuda.parallel.tensor_parallel import TensorParallelLost
from clef_cuda.tuning.autotune import AutotuneReport, autotune, cache_file, install, record_kernel_failure
from clef_cuda.verification.guarded_ops import KernelFault
from clef_cuda.verification.selfcheck import SelfCheckReport, run_selfcheck

log = logging.getLogger("clef_serve")

# A sticky CUDA error killed this process's GPU context (clef_cuda.verification.guarded_ops): the kernel is recorded
# as failed in the autotune cache and the process exits with this, for its supervisor to start it again.
EXIT_KERNEL_FAULT = 4
EXIT_TENSOR_PARALLEL_LOST = 5  # a tensor-parallel rank died, hung or failed a collective
SELFCHECK_MODES = ("enforce", "warn", "off")


class Phase(Enum):
    LOADING = "loading"
    TUNING = "tuning"
    SELF_CHECKING = "self-checking"
    WARMING = "warming"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


# Why a FAILED server failed (Failure.kind, clef_failed{kind}).
LOAD, SELFCHECK, KERNEL_FAULT, RANK_LOST = "load", "selfcheck", "kernel_fault", "rank_lost"
TIMED_SELFCHECK, SHADOW_MISMATCH = "timed_selfcheck", "shadow_mismatch"  # while serving: /ready "verification_failed"
VERIFICATION = (TIMED_SELFCHECK, SHADOW_MISMATCH)


@dataclass(frozen=True)
class Failure:
    kind: str  # LOAD, SELFCHECK, KERNEL_FAULT, RANK_LOST, TIMED_SELFCHECK or SHADOW_MISMATCH
    reason: str
    exit_code: int | None  # the process ends with it, `exit_delay` seconds later; None: it stays up, unready


@dataclass(frozen=True)
class Refusal:
    """Why a decision is not answered now: `status` as /ready says it, `message` as the 503 says it."""

    status: str
    message: str


@dataclass(frozen=True)
class LifecycleSettings:
    served_model_name: str = "clef-flash"
    selfcheck: str = "enforce"  # SELFCHECK_MODES
    autotune: str = "off"  # clef_cuda.tuning.autotune's modes: fast, full, off
    autotune_cache: str | None = None  # where the autotune's choices (and kernels failed here) are kept
    kernel_trials: str = "auto"  # where never-run kernels are first tried: auto, child, inline
    warm_up: bool = True  # one decision before READY
    exit_delay: float = 1.0  # seconds from a fatal fault to the exit


class Observer(Protocol):
    """What the lifecycle reports as it goes (the app's metrics)."""

    def ready(self, ready: bool) -> None: ...
    def failed(self, kind: str) -> None: ...
    def selfcheck(self, report: SelfCheckReport) -> None: ...
    def autotune(self, report: AutotuneReport) -> None: ...
    def adapters_loaded(self, count: int) -> None: ...


class _Silent:
    def ready(self, ready: bool) -> None:
        pass

    def failed(self, kind: str) -> None:
        pass

    def selfcheck(self, report: SelfCheckReport) -> None:
        pass

    def autotune(self, report: AutotuneReport) -> None:
        pass

    def adapters_loaded(self, count: int) -> None:
        pass


def _exit_later(code: int, delay: float) -> None:
    timer = threading.Timer(delay, lambda: os._exit(code))
    timer.daemon = True
    timer.start()


class Lifecycle:
    """One server's lifecycle (the module's doc). `engine` is the clef_cuda.serving.engine.Engine once WARMING began;
    `exit_later(code, delay)` ends the process (tests pass their own). Thread-safe: the loader, the engine's
    fault callbacks, tensor parallel's watchdog and the HTTP handlers all call in."""

    def __init__(
        self,
        settings: LifecycleSettings = LifecycleSettings(),
        observer: Observer | None = None,
        exit_later: Callable[[int, float], None] = _exit_later,
    ) -> None:
        if settings.selfcheck not in SELFCHECK_MODES:
            raise ValueError(f"--selfcheck must be one of {', '.join(SELFCHECK_MODES)}, got {settings.selfcheck!r}")
        self.settings, self.observer, self._exit_later = settings, observer or _Silent(), exit_later
        self._lock = threading.RLock()
        self.phase = Phase.LOADING
        self.failure: Failure | None = None
        self.engine: Any = None  # the started engine (from WARMING on; it answers once READY)
        self.selfcheck: SelfCheckReport | None = None  # the start-up self-check's report
        self.autotune: AutotuneReport | None = None
        self.in_flight = 0  # decisions being handled (a drain waits for them)

    # ---- transitions --------------------------------------------------------------------------------
    def _enter(self, phase: Phase) -> bool:
        """Move to `phase`; False (and nothing changes) once FAILED or DRAINING: a start-up step that finds the
        server failed or draining under it stops."""
        with self._lock:
            if self.phase in (Phase.FAILED, Phase.DRAINING):
                return False
            self.phase = phase
            return True

    def fail(self, kind: str, reason: str, exit_code: int | None = None, detail: str | None = None) -> None:
        """FAILED for `reason`: /ready turns 503 and decisions are refused; with `exit_code`, the process ends
        `exit_delay` seconds later (in-flight requests get their 503 first), its last log line "clef-serve: <reason>;
        [<detail>; ]exiting (<code>)". The first failure is the one kept."""
        with self._lock:
            if self.phase is Phase.FAILED:
                return
            self.phase, self.failure = Phase.FAILED, Failure(kind, reason, exit_code)
        self.observer.ready(False)
        self.observer.failed(kind)
        if exit_code is not None:
            log.critical("clef-serve: %s; %sexiting (%d)", reason, f"{detail}; " if detail else "", exit_code)
            self._exit_later(exit_code, self.settings.exit_delay)

    def load(self, load_engine: Callable[[], Any]) -> None:
        """LOADING: `load_engine()` (on the caller's thread), then start()."""
        try:
            engine = load_engine()
        except Exception as error:
            log.exception("loading the model failed")
            fatal = getattr(error, "fatal", False)  # a tensor-parallel rank could not start: restart them all
            if fatal:
                self.fail(LOAD, str(error), EXIT_TENSOR_PARALLEL_LOST)
            else:
                self.fail(LOAD, f"{type(error).__name__}: {error}")
            return
        self.start(engine)

    def start(self, engine: Any) -> None:
        """TUNING -> SELF_CHECKING -> WARMING -> READY for a loaded `engine`; stops where a step fails."""
        peers = engine.decider.trunk.peers
        if peers is not None:  # tensor parallel: a rank lost from here on takes the server down
            peers.on_lost = self.rank_lost
            if peers.lost is not None:
                self.rank_lost(peers.lost)
                return
        if not self._enter(Phase.TUNING):
            return
        self._tune(engine)  # first: on a GPU it tries every kernel where a fault costs nothing
        if not self._enter(Phase.SELF_CHECKING) or not self._passes_selfcheck(engine):
            return
        with self._lock:
            if not self._enter(Phase.WARMING):
                return
            self.engine = engine  # from here a drain or shutdown reaches the engine's threads
        # Its verification from the warm-up decision on (that decision's shadow check may be the first verdict).
        engine.on_timed_selfcheck_failed = self.timed_selfcheck_failed
        engine.shadow.on_mismatch = self.shadow_mismatch
        if engine.adapters is not None:  # the start-up loads (runtime ones are counted as they happen)
            self.observer.adapters_loaded(engine.adapters.loads["ok"])
        engine.start()
        if self.settings.warm_up and not self._warms_up(engine):
            return
        with self._lock:
            if self.phase is not Phase.WARMING:  # failed or draining meanwhile
                return
            self.phase = Phase.READY
        self.observer.ready(True)
        log.info("ready: serving %s", self.settings.served_model_name)

    def _warms_up(self, engine: Any) -> bool:
        """One decision through the whole path before READY; a failure is FAILED (unless a drain or fault got
        there first), never a server stuck in WARMING."""
        try:
            engine.decide(
                {
                    "model": self.settings.served_model_name,
                    "state": "warm-up",
                    "questions": {"ready": {"type": "noul", "instructions": "Is the server ready?"}},
                },
                timeout=600,
            )
        except Exception as error:
            if self.phase is Phase.WARMING:
                log.exception("the warm-up decision failed")
                self.fail(LOAD, f"the warm-up decision failed: {type(error).__name__}: {error}")
            return False
        return True

    def _tune(self, engine: Any) -> None:
        """Every kernel tried and the fastest verified implementation per op and call shape chosen, on this device;
        the trunk then runs on the guarded op library. Never fatal: a failure leaves the dispatch rule's kernels."""
        trunk = engine.decider.trunk
        engine.on_kernel_fault = lambda fault: self.kernel_fault(None, fault)  # wired whatever the autotune does
        s = self.settings
        try:
            report = autotune(trunk, engine.config, s.autotune, s.autotune_cache, s.kernel_trials)
        except Exception:
            log.exception("the autotune failed: serving on the default kernels, each one guarded")
            try:  # a fault is still named by kernel, a launch error still routed to the reference
                install(trunk, AutotuneReport(s.autotune, {}), [], None, engine.config)
            except Exception:
                log.exception("installing the guarded op library failed")
            return
        engine.on_kernel_fault = lambda fault: self.kernel_fault(report, fault)
        if report is not None:
            self.autotune = report
            self.observer.autotune(report)
            log.info("%s", report.table())

    def _passes_selfcheck(self, engine: Any) -> bool:
        """The kernels proven on this device before any traffic; False when the server must not answer."""
        if self.settings.selfcheck == "off":
            log.warning("the on-device kernel self-check is off (--selfcheck off): kernels are not verified here")
            return True
        try:
            report = run_selfcheck(engine.decider.trunk, block_size=engine.config.block_size)
        except KernelFault as fault:  # a kernel the trials never ran at these shapes took the device down
            self.kernel_fault(self.autotune, fault)
            return False
        except TensorParallelLost as error:
            self.rank_lost(str(error), error.kernel_fault)
            return False
        self.selfcheck = report
        self.observer.selfcheck(report)
        if report.passed:
            log.info("on-device kernel self-check %s\n%s", report.summary(), report.table())
            return True
        banner = "!" * 100
        log.error("%s\non-device kernel self-check %s\n%s\n%s", banner, report.summary(), report.table(), banner)
        if self.settings.selfcheck == "warn":
            log.error("--selfcheck warn: SERVING ANYWAY on kernels that failed their self-check; answers may be wrong")
            return True
        self.fail(SELFCHECK, f"the on-device kernel self-check {report.summary()}")
        return False

    def kernel_fault(self, report: AutotuneReport | None, fault: KernelFault) -> None:
        """A sticky CUDA error: this process can run nothing more on its GPU. The kernel is recorded as failed in the
        autotune cache (the next start skips it), then FAILED with EXIT_KERNEL_FAULT."""
        where = "not recorded (no --autotune-cache: the next start tries it again)"
        cache = self.settings.autotune_cache
        if report is not None and cache and report.key:
            path = cache_file(Path(cache), report.key)
            record_kernel_failure(path, report.key, fault.kernel, f"faulted while serving: {fault.error}")
            where = "recorded as failed in the autotune cache: the next start runs without it"
        self.fail(KERNEL_FAULT, str(fault), EXIT_KERNEL_FAULT, detail=where)

    def rank_lost(self, reason: str, fault: KernelFault | None = None) -> None:
        """A tensor-parallel rank is gone (exited, hung past --tensor-parallel-timeout, a collective failed, or it
        never started): no step can run again, FAILED with EXIT_TENSOR_PARALLEL_LOST (the restart starts every rank
        afresh); a worker's sticky CUDA fault is a kernel fault instead."""
        if fault is not None:
            self.kernel_fault(self.autotune, fault)
            return
        self.fail(RANK_LOST, reason, EXIT_TENSOR_PARALLEL_LOST)

    def timed_selfcheck_failed(self, report: SelfCheckReport) -> None:
        """The engine's timed self-check (--selfcheck-interval) failed while serving: under `--selfcheck enforce`
        FAILED (TIMED_SELFCHECK; the process stays up, unready, its answers refused); `warn`: logged, serving on."""
        if self.settings.selfcheck != "enforce":
            log.error("--selfcheck warn: SERVING ANYWAY on kernels that failed their self-check; answers may be wrong")
            return
        self.fail(TIMED_SELFCHECK, f"the on-device kernel self-check {report.summary()}")

    def shadow_mismatch(self, mismatches: int, reason: str) -> None:
        """The shadow found an answered record that the reference ops decide differently (`mismatches` so far,
        `reason` naming the first difference): under `--shadow-mode enforce`, from --shadow-max-mismatches on,
        FAILED (SHADOW_MISMATCH; the process stays up, unready, until an operator restarts it: its answers are
        suspect); `warn`: logged, serving on."""
        shadow = self.engine.config.shadow
        if shadow.mode != "enforce":
            log.error("--shadow-mode warn: SERVING ANYWAY on kernels whose answers differed from the reference")
            return
        if mismatches < shadow.max_mismatches:
            return
        if self.phase is not Phase.FAILED:
            log.error("%s; decisions are refused until an operator restarts the server", reason)
        self.fail(SHADOW_MISMATCH, reason)

    def drain(self) -> None:
        """Stop taking decisions (SIGTERM): DRAINING (FAILED stays FAILED), in-flight ones finish."""
        with self._lock:
            if self.phase is not Phase.FAILED:
                self.phase = Phase.DRAINING
        self.observer.ready(False)
        if self.engine is not None:
            self.engine.drain()

    @contextmanager
    def handling(self) -> Iterator[None]:
        """Around a decision's handling: counted in flight (a drain waits for it)."""
        with self._lock:
            self.in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self.in_flight -= 1

    def wait_until_idle(self, timeout: float, poll: float = 0.05) -> bool:
        """After drain(): wait for the decisions in flight (handlers and the engine's queue and steps), at most
        `timeout` seconds; True when idle."""
        deadline = time.monotonic() + timeout
        while not self.idle():
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll)
        return True

    def shutdown(self, timeout: float = 60.0) -> None:
        """The server stops: DRAINING (unless FAILED), then the engine's shutdown."""
        self.drain()
        if self.engine is not None:
            self.engine.stop(timeout)

    # ---- what a decision or a probe asks ------------------------------------------------------------
    @property
    def status(self) -> str:
        """The status /ready names: loading (every start-up phase), ready, draining, selfcheck_failed (at start-up),
        verification_failed (a timed self-check or the shadow, while serving) or failed."""
        if self.phase is Phase.FAILED:
            kind = self.failure.kind if self.failure is not None else None
            if kind == SELFCHECK:
                return "selfcheck_failed"
            return "verification_failed" if kind in VERIFICATION else "failed"
        if self.phase in (Phase.READY, Phase.DRAINING):
            return self.phase.value
        return Phase.LOADING.value

    def refusal(self) -> Refusal | None:
        """Why a decision may not be answered now; None: answer it (with self.engine)."""
        if self.phase is Phase.READY and self.engine is not None:
            return None
        status = self.status
        if status == "loading":
            return Refusal(status, "the model is still loading")
        if status == "draining":
            return Refusal(status, "the server is shutting down")
        failure = self.failure
        if failure is not None and failure.kind == LOAD:
            return Refusal(status, f"the model failed to load: {failure.reason}")
        return Refusal(status, f"this server does not answer: {failure.reason if failure else status}")

    def readiness(self) -> tuple[bool, str, str | None]:
        """/ready: (ready, status, why not: the failure's reason, or the status)."""
        ready = self.phase is Phase.READY
        why = None if ready else self.failure.reason if self.failure is not None else self.status
        return ready, self.status, why

    def selfcheck_report(self) -> SelfCheckReport | None:
        """The latest self-check: the engine's timed one once it ran, else the start-up one."""
        engine = self.engine
        if engine is not None and engine.selfcheck_report is not None:
            return engine.selfcheck_report
        return self.selfcheck

    def idle(self) -> bool:
        engine = self.engine
        return self.in_flight == 0 and (engine is None or (engine.queue_depth == 0 and engine.running == 0))
