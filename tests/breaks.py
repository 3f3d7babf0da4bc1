"""Every "shown failing when broken" claim of the suite that is not a compiled-in kernel fault (those are
tests/kernel_faults.py's), as a break anyone can apply: an edit of the source (each `old` found exactly once, so a
break that no longer matches the code fails loudly instead of passing), made in a copy of the tree, and the tests
that must then fail. tests/test_breaks.py runs the quick ones in make test; scripts/show_breaks.py runs any of them
(the live Prometheus scenarios take minutes each) and prints the table benchmarks/RESULTS.md records.

Groups:
- lifecycle: clef_cuda/lifecycle.py's fail-safes (enforce and warn, the most mismatches, the hooks, the drain, the
  statuses), against tests/test_lifecycle.py;
- alerts: each alert of deploy/prometheus/clef-rules.yml edited so that it cannot fire in its scenario, and the
  scenarios' drivers without the fault or load each alert needs, against the live Prometheus tests of
  tests/test_prometheus_rules.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIFECYCLE_TESTS = ("tests/test_lifecycle.py",)
SERVER_ALERTS_TEST = ("tests/test_prometheus_rules.py::test_a_real_prometheus_sees_each_servers_own_alerts_fire",)
POD_ALERTS_TEST = (
    "tests/test_prometheus_rules.py::"
    "test_a_real_prometheus_sees_a_pods_faults_and_restarts_and_the_exit_code_alerts_resolve",
)


@dataclass(frozen=True)
class Break:
    name: str
    group: str  # lifecycle | alerts
    path: str  # the file edited, from the tree's root
    edits: tuple[tuple[str, str], ...]  # (old, new): each old found exactly once in the file
    tests: tuple[str, ...]  # pytest node ids, of which at least one must fail


def _one(name: str, group: str, path: str, old: str, new: str, tests: tuple[str, ...]) -> Break:
    return Break(name, group, path, ((old, new),), tests)


LIFECYCLE = "clef_cuda/lifecycle.py"
RULES = "deploy/prometheus/clef-rules.yml"
DRIVER = "tests/test_prometheus_rules.py"

BREAKS = (
    # ---- the lifecycle's fail-safes ------------------------------------------------------------------------------
    _one(
        "a failed timed self-check ignored under enforce",
        "lifecycle",
        LIFECYCLE,
        '        self.fail(TIMED_SELFCHECK, f"the on-device kernel self-check {report.summary()}")',
        "        return",
        LIFECYCLE_TESTS,
    ),
    _one(
        "--selfcheck warn enforced for the timed self-check",
        "lifecycle",
        LIFECYCLE,
        '        if self.settings.selfcheck != "enforce":',
        '        if self.settings.selfcheck == "off":',
        LIFECYCLE_TESTS,
    ),
    _one(
        "--shadow-max-mismatches ignored",
        "lifecycle",
        LIFECYCLE,
        "        if mismatches < shadow.max_mismatches:\n            return\n",
        "",
        LIFECYCLE_TESTS,
    ),
    _one(
        "--shadow-mode warn enforced",
        "lifecycle",
        LIFECYCLE,
        '        if shadow.mode != "enforce":',
        '        if shadow.mode == "off":',
        LIFECYCLE_TESTS,
    ),
    _one(
        "the shadow's verdicts not wired to the lifecycle",
        "lifecycle",
        LIFECYCLE,
        "        engine.shadow.on_mismatch = self.shadow_mismatch\n",
        "",
        LIFECYCLE_TESTS,
    ),
    _one(
        "the timed self-check not wired to the lifecycle",
        "lifecycle",
        LIFECYCLE,
        "        engine.on_timed_selfcheck_failed = self.timed_selfcheck_failed\n",
        "",
        LIFECYCLE_TESTS,
    ),
    _one(
        "a FAILED server's engine not drained",
        "lifecycle",
        LIFECYCLE,
        "        if self.engine is not None:\n            self.engine.drain()",
        "        if self.engine is not None and self.phase is not Phase.FAILED:\n            self.engine.drain()",
        LIFECYCLE_TESTS,
    ),
    _one(
        "a verification failure's status said as failed",
        "lifecycle",
        LIFECYCLE,
        '            return "verification_failed" if kind in VERIFICATION else "failed"',
        '            return "failed"',
        LIFECYCLE_TESTS,
    ),
    _one(
        "a failed start-up self-check under --selfcheck warn stops the start",
        "lifecycle",
        LIFECYCLE,
        '        if self.settings.selfcheck == "warn":',
        "        if False:",
        LIFECYCLE_TESTS,
    ),
    _one(
        "FAILED not final: a later failure replaces the first",
        "lifecycle",
        LIFECYCLE,
        "            if self.phase is Phase.FAILED:\n                return\n            self.phase, self.failure",
        "            self.phase, self.failure",
        LIFECYCLE_TESTS,
    ),
    _one(
        "handlers not counted in flight (a drain would not wait for them)",
        "lifecycle",
        LIFECYCLE,
        "            self.in_flight += 1",
        "            pass",
        LIFECYCLE_TESTS,
    ),
    _one(
        "a failed warm-up decision leaves the server warming for ever",
        "lifecycle",
        LIFECYCLE,
        '                self.fail(LOAD, f"the warm-up decision failed: {type(error).__name__}: {error}")',
        "                pass",
        LIFECYCLE_TESTS,
    ),
    # ---- each alert, edited so that its scenario cannot fire it ----------------------------------------------------
    _one(
        "ClefNotReady on a value never exported",
        "alerts",
        RULES,
        "expr: clef_ready == 0",
        "expr: clef_ready == 2",
        SERVER_ALERTS_TEST,
    ),  # fmt: skip
    _one(
        "ClefSelfCheckFailed on a value never exported",
        "alerts",
        RULES,
        "clef_selfcheck_passed == 0",
        "clef_selfcheck_passed == -1",
        SERVER_ALERTS_TEST,
    ),  # fmt: skip
    _one(
        "ClefShadowMismatch on a misspelt result",
        "alerts",
        RULES,
        '{result="mismatch"} > 0',
        '{result="mismatched"} > 0',
        SERVER_ALERTS_TEST,
    ),  # fmt: skip
    _one(
        "ClefShadowMarginal past five marginal verdicts",
        "alerts",
        RULES,
        '{result="marginal"}[1h]) > 0',
        '{result="marginal"}[1h]) > 5',
        SERVER_ALERTS_TEST,
    ),  # fmt: skip
    _one(
        "ClefQueueNearFull past a full queue",
        "alerts",
        RULES,
        "clef:queue:fill_ratio > 0.8",
        "clef:queue:fill_ratio > 1",
        SERVER_ALERTS_TEST,
    ),  # fmt: skip
    _one(
        "ClefRefusingRequests on a job that does not exist",
        "alerts",
        RULES,
        "expr: clef:requests_refused:ratio_rate5m > 0.05",
        'expr: clef:requests_refused:ratio_rate5m{job="elsewhere"} > 0.05',
        SERVER_ALERTS_TEST,
    ),  # fmt: skip
    _one(
        "ClefLatencyOverSLO against a thousand times the objective",
        "alerts",
        RULES,
        "> on() group_left() clef:latency_slo_seconds",
        "> on() group_left() (clef:latency_slo_seconds * 1000)",
        SERVER_ALERTS_TEST,
    ),  # fmt: skip
    _one(
        "ClefKernelFailed on a value never exported",
        "alerts",
        RULES,
        "clef_kernel_failed == 1",
        "clef_kernel_failed == 2",
        POD_ALERTS_TEST,
    ),  # fmt: skip
    _one(
        "ClefKernelFault on another exit code",
        "alerts",
        RULES,
        '{container="clef-serve"} == 4\n',
        '{container="clef-serve"} == 40\n',
        POD_ALERTS_TEST,
    ),  # fmt: skip
    _one(
        "ClefTensorParallelRankLost on another exit code",
        "alerts",
        RULES,
        '{container="clef-serve"} == 5\n',
        '{container="clef-serve"} == 50\n',
        POD_ALERTS_TEST,
    ),  # fmt: skip
    Break(
        "ClefRestarting past twenty restarts",
        "alerts",
        RULES,
        (
            ("changes(clef_start_time_seconds[1h]) >= 2", "changes(clef_start_time_seconds[1h]) >= 20"),
            ('restarts_total{container="clef-serve"}[1h]) >= 2', 'restarts_total{container="clef-serve"}[1h]) >= 20'),
        ),
        POD_ALERTS_TEST,
    ),
    # ---- the scenarios' drivers without what makes each alert fire ---------------------------------------------
    _one(
        "the seed server without the seed's fault",
        "alerts",
        DRIVER,
        'faults={"CLEF_TEST_FAULT": "key_band"},',
        "faults={},",
        SERVER_ALERTS_TEST,
    ),  # fmt: skip
    _one(
        "the busy server's marginal verdicts never armed",
        "alerts",
        DRIVER,
        "        armed.touch()  # from here the busy server's shadow verdicts are marginal",
        '        (tmp_path / "elsewhere").touch()  # from here the busy server\'s shadow verdicts are marginal',
        SERVER_ALERTS_TEST,
    ),  # fmt: skip
    _one(
        "the busy server never loaded",
        "alerts",
        DRIVER,
        'clients.append(Clients(servers["busy"].url, 4, long_decision))',
        'clients.append(Clients(servers["busy"].url, 0, long_decision))',
        SERVER_ALERTS_TEST,
    ),  # fmt: skip
    _one(
        "the pod's exits never reach kube-state-metrics",
        "alerts",
        DRIVER,
        "        kube.terminated(exit_code)\n",
        "",
        POD_ALERTS_TEST,
    ),  # fmt: skip
)
BY_NAME = {b.name: b for b in BREAKS}


@dataclass(frozen=True)
class Outcome:
    caught: bool  # the tests failed (pytest's exit code 1), as they must
    exit_code: int
    seconds: float
    last_lines: str


class Tree:
    """A copy of this tree (tracked files and untracked ones git does not ignore, the built extension, the caches'
    links) where breaks are applied one at a time: the tests there import the copy's clef_cuda and app (the tree's
    pyproject puts its root first on sys.path, before the editable install's finder)."""

    LINKED = (".cache", ".oracles", ".venv-video-oracle")  # built once, read by the tests: shared, not copied

    def __init__(self) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="clef-breaks-")
        self.root = Path(self._folder.name)
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.split(b"\0")
        built = [p.relative_to(ROOT) for p in (ROOT / "clef_cuda").glob("_C*.so")] + [
            Path("clef_cuda/BUILT_WITH_TORCH")
        ]
        for relative in [Path(name.decode()) for name in listed if name] + built:
            source = ROOT / relative
            if source.is_file():
                (self.root / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, self.root / relative)
        for name in self.LINKED:
            if (ROOT / name).exists():
                (self.root / name).symlink_to(ROOT / name)

    def imports_its_own_package(self) -> bool:
        """Whether Python started in the copy imports the copy's clef_cuda and app (not the editable install's)."""
        found = subprocess.run(
            [sys.executable, "-c", "import app, clef_cuda; print(clef_cuda.__file__); print(app.__file__)"],
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout.split()
        return len(found) == 2 and all(Path(f).resolve().is_relative_to(self.root.resolve()) for f in found)

    def run(self, tests: tuple[str, ...], brk: Break | None = None, timeout: float = 900) -> Outcome:
        """`tests` in this tree with `brk` applied (None: as it is), the file restored afterwards."""
        assert tests, "no tests named"
        path = self.root / brk.path if brk is not None else None
        original = path.read_text() if path is not None else None
        if brk is not None:
            text = original
            for old, new in brk.edits:
                count = text.count(old)
                if count != 1:
                    raise AssertionError(f"break {brk.name!r}: {old!r} is in {brk.path} {count} times, not once")
                text = text.replace(old, new)
            path.write_text(text)
        started = time.monotonic()
        try:
            done = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                cwd=self.root,
                capture_output=True,
                text=True,
                timeout=timeout,
                env=os.environ | {"PYTHONDONTWRITEBYTECODE": "1"},
            )
            code, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as expired:
            code, output = -1, f"no result within {timeout:.0f} s: {expired}"
        finally:
            if path is not None:
                path.write_text(original)
        lines = "\n".join(output.strip().splitlines()[-3:])
        return Outcome(code == 1, code, time.monotonic() - started, lines)

    def close(self) -> None:
        self._folder.cleanup()
