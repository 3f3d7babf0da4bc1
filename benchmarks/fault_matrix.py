#!/usr/bin/env python3
"""Where the fail-safes meet: every injected fault under one device and under tensor parallel over two ranks, each
with the shadow (every record) and int8 weights on, served by clef-serve as its own process on the CPU (gloo; the
test-only fault hooks of tests/faulty_clef_serve.py, tests/tp_worker_faults.py and tests/trial_faults.py, put in
by tests/live.py's launcher). What a client and an operator see, one row each: the failing request's status, the
next request's, /ready after both, the exit code if the process ended, the seconds from the fault to the exit (or
to the recovery: the next answer), whether the next answer equals a healthy one-device server's, the KV blocks and
state slots leaked (idle: in use beyond what the prefix cache and a shadow run hold), and what proves the fault
fired. Table last.

    python benchmarks/fault_matrix.py                 # every row, TP=1 and TP=2 (about 7 minutes on 2 cores)
    python benchmarks/fault_matrix.py --rows hung,overflow --tp 2
    python benchmarks/fault_matrix.py --check         # exit 1 if a row breaks a rule (below)
    python benchmarks/fault_matrix.py --empty-hooks --check   # every hook a no-op: exit 1 if a row still passes

The rules (--check): the fault fired (each row names its evidence: the failing request's status and error message,
the kernels or trials /ready lists, the shadow verdict it caused, or a line of the log); no hang past the row's
stated timeout; a request-level fault never takes the server down (no exit, the next request answered); an answer
after a recovered fault equals the healthy one (no silently wrong answer); nothing leaked; a fault that kills the
device or the group ends the process with its exit code (4 or 5) within 15 s of the fault (of the tensor-parallel
timeout's end, for a hung rank), after a 503 with the contract's error body. --empty-hooks runs each row with its
hook doing nothing (the fault variables set to no fault, the harness's kill or SIGSTOP not sent): the rules must
then fail every row, or the row would pass without its fault.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "tests"))
sys.path.append(str(ROOT))

from live import ClefServe  # noqa: E402 (tests/ on the path first)

REQUEST = {
    "model": "clef-flash",
    "state": "09:12:04 ERROR db: connection refused\n09:12:15 ERROR queue: write failed " * 20,
    "questions": {
        "down": {"type": "noul", "instructions": "Is a service down?"},
        "which": {"type": "choice", "criteria": {"db": None, "queue": None, "api": None}},
    },
}
EXIT_DEADLINE_S = 15.0  # from the fault to the process's exit, where the fault ends it
TP_TIMEOUT_S = 5.0  # --tensor-parallel-timeout in these runs: a hung rank is a 503 within it
# Each fault variable's value that installs its hook but fires nothing (--empty-hooks).
NO_FAULT = {
    "CLEF_TEST_FAULT": "none",
    "CLEF_TEST_TP_FAULT": "none",
    "CLEF_TEST_CANDIDATE_SET": "",
    "CLEF_TEST_TRIAL_FAULT": "",
}


@dataclass
class Row:
    name: str
    tp: int
    what: str  # the fault, in words
    expect: str  # "serves on" | "exits 4" | "exits 5"
    failing: str = "-"  # the failing request's status ("no answer (...)", "503 WITHOUT the contract's body")
    failing_message: str = ""  # its error body's message
    following: str = "-"
    ready: str = "-"
    exit_code: str = "-"
    seconds: float | None = None  # serves on: from the fault to the next answer; exits: from the fault to the exit
    same_answer: str = "-"
    leaked: str = "-"
    shadow_before: dict = field(default_factory=dict)  # /ready's shadow verdicts when the fault was injected
    shadow_after: dict = field(default_factory=dict)  # ... and once it had played out
    failures: dict = field(default_factory=dict)  # /ready's failed kernels (kernel -> why)
    trials: str = ""  # /ready's kernel trials ("child", "unavailable: ...")
    log: str = ""  # the server's output
    problems: list[str] = field(default_factory=list)

    @property
    def evidence(self) -> str:
        """What /ready and the failing request say the fault did, for the table."""
        parts = []
        if self.failing_message:
            parts.append(self.failing_message)
        if self.shadow_after:
            s = self.shadow_after
            parts.append(f"shadow {s['match']}/{s.get('marginal', 0)}/{s['mismatch']}/{s['dropped']}")
        if self.trials.startswith("unavailable"):
            parts.append(f"trials unavailable ({len(self.failures)} kept off)")
        elif self.failures:
            parts.append(f"{len(self.failures)} kernel(s) failed")
        return ", ".join(parts) or "-"


class Server(ClefServe):
    """clef-serve through tests/live.py's launcher with the fault hooks, int8, the shadow on every record."""

    def __init__(self, tp: int, faults: dict, extra: tuple[str, ...], cache: str) -> None:
        from releases import tiny_release

        argv = ["--w", str(tiny_release()), "--d", "cpu", "--tp", str(tp), "--quantize", "int8", "--shadow-rate", "1"]
        argv += ["--shadow-mode", "enforce", "--tensor-parallel-timeout", f"{TP_TIMEOUT_S:g}s"]
        argv += ["--max-model-len", "4096", "--kv-fraction", "0.05", "--autotune-cache", cache, *extra]
        super().__init__(*argv, faults=faults)

    def post(self, timeout: float = 60) -> tuple[str, str, dict | None]:
        """(status, its error message, the body of a 200)."""
        try:
            response = httpx.post(self.url + "/v1/systemone", json=REQUEST, timeout=timeout)
        except httpx.HTTPError as error:
            return f"no answer ({type(error).__name__})", "", None
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code == 200:
            return "200", "", body
        detail = body.get("detail") if isinstance(body, dict) else None
        if not (isinstance(detail, dict) and {"error_type", "message"} <= detail.keys()):
            return f"{response.status_code} WITHOUT the contract's body", "", None
        return str(response.status_code), str(detail["message"]), None

    def ready_body(self) -> dict:
        try:
            return httpx.get(self.url + "/ready", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return {}

    def ready_status(self) -> str:
        try:
            return str(httpx.get(self.url + "/ready", timeout=2).status_code)
        except httpx.HTTPError:
            return "down"

    def verdicts(self) -> int:
        s = self.ready_body().get("shadow")
        return s["match"] + s.get("marginal", 0) + s["mismatch"] + s["dropped"] if s else -1

    def leaked(self) -> str:
        """Blocks and slots in use beyond the prefix cache's and a shadow run's, once idle ('-' when down)."""
        from prometheus_client.parser import text_string_to_metric_families

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                text = httpx.get(self.url + "/metrics", timeout=2).text
            except httpx.HTTPError:
                return "-"
            m = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
            blocks = m["clef_kv_blocks_used"] - m["clef_prefix_cache_blocks"] - m["clef_shadow_kv_blocks"]
            slots = m["clef_state_slots_used"] - m["clef_prefix_cache_entries"]
            if m["clef_running_sequences"] == 0 and m["clef_queue_depth"] == 0 and m["clef_shadow_kv_blocks"] == 0:
                return "none" if blocks == 0 and slots == 0 else f"{blocks:.0f} blocks, {slots:.0f} slots"
            time.sleep(0.2)
        return "busy"


def same(a: dict | None, b: dict | None) -> str:
    """Whether two answers agree: the same choices and probabilities within 1e-4 (rounding at the 4th decimal)."""
    if a is None or b is None:
        return "-"

    def close(x, y) -> bool:
        if isinstance(x, dict) and isinstance(y, dict):
            return x.keys() == y.keys() and all(close(x[k], y[k]) for k in x)
        if isinstance(x, float | int) and isinstance(y, float | int) and not isinstance(x, bool):
            return abs(x - y) <= 1.01e-4
        return x == y

    return "yes" if close(a["answers"], b["answers"]) else "NO"


# ---- the rows ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fired:
    """What proves that a row's fault happened: every field given must hold once the row has run."""

    status: str | None = None  # the failing request's status (a non-200 with the contract's error body)
    says: tuple[str, ...] = ()  # words its error message holds (any case)
    kernels: tuple[str, ...] = ()  # kernels /ready lists as failed (each a prefix of one: "silu_mul:")
    trials: str | None = None  # how /ready's kernel trials begin ("unavailable")
    shadow: str | None = None  # the shadow verdict whose count the fault raised ("dropped", "marginal")
    log: tuple[str, ...] = ()  # words one line of the server's output holds


@dataclass(frozen=True)
class Scenario:
    what: str  # the fault, in words
    faults: dict  # the test-only hooks' variables that inject it (tests/live.py ClefServe's `faults`)
    trigger: str  # "arm" (the hook's file), "kill" / "stop" (a worker), "kill-before" (a loading worker), "none"
    expect: str  # "serves on", "exits 4", "exits 5"
    fired: Fired  # what proves it fired
    sizes: tuple[int, ...] = (1, 2)  # the tensor-parallel sizes it applies to
    flags: tuple[str, ...] = ()

    def emptied(self) -> Scenario:
        """The same row with its hook doing nothing: each fault variable at its no-fault value, no kill or stop."""
        faults = {k: NO_FAULT.get(k, v) for k, v in self.faults.items()}
        return replace(self, faults=faults, trigger="none" if self.trigger != "kill-before" else "wait-before")

    @property
    def exit_deadline(self) -> float:
        """Seconds from the fault to the exit: a hung rank is seen at the tensor-parallel timeout's end."""
        return EXIT_DEADLINE_S + (TP_TIMEOUT_S if self.trigger == "stop" else 0.0)


def scenarios() -> dict[str, Scenario]:
    trials = ("--kernel-trials", "child")
    # The server's last words: "clef-serve: <why>; exiting (<code>)".
    lost, kernel_fault = ("clef-serve: ", "exiting (5)"), ("clef-serve: ", "rms_norm_rope", "exiting (4)")
    return {
        "overflow": Scenario(
            "an f16 overflow record (every rank, after the all-reduces)",
            {"CLEF_TEST_FAULT": "tp:overflow_once_when_armed"},
            "arm",
            "serves on",
            Fired(status="500", says=("non-finite hidden states",)),
        ),
        "rank0-oom": Scenario(
            "rank 0 out of memory mid-step",
            {"CLEF_TEST_FAULT": "tp:oom_once_when_armed"},
            "arm",
            "serves on",
            Fired(status="503", says=("out of memory",)),
        ),
        "worker-oom": Scenario(
            "rank 1 out of memory mid-step",
            {"CLEF_TEST_TP_FAULT": "oom_once_when_armed"},
            "arm",
            "serves on",
            Fired(status="503", says=("rank 1", "out of memory")),
            (2,),
        ),
        "killed-before": Scenario(
            "a worker killed before the rendezvous",
            {"CLEF_TEST_TP_FAULT": "hang_at_start"},
            "kill-before",
            "exits 5",
            Fired(log=("clef-serve: tensor-parallel rank 1", "SIGKILL", "exiting (5)")),
            (2,),
        ),
        "killed-after": Scenario(
            "a worker killed while serving",
            {},
            "kill",
            "exits 5",
            Fired(status="503", says=("tensor-parallel",), log=lost),
            (2,),
        ),
        "hung": Scenario(
            "a worker hung (SIGSTOP)",
            {},
            "stop",
            "exits 5",
            Fired(status="503", says=("within the tensor-parallel timeout",), log=lost),
            (2,),
        ),
        "trial-sticky": Scenario(
            "kernels that crash or poison their trial process",
            {"CLEF_TEST_CANDIDATE_SET": "crash,sticky"},
            "none",
            "serves on",
            Fired(kernels=("paged_attention:test-crash", "paged_attention:test-sticky")),
            flags=trials,
        ),
        "sticky-rank0": Scenario(
            "a sticky CUDA fault while serving, on rank 0",
            {"CLEF_TEST_FAULT": "tp:sticky_when_armed"},
            "arm",
            "exits 4",
            Fired(status="503", says=("CUDA fault in rms_norm_rope",), log=kernel_fault),
        ),
        "sticky-worker": Scenario(
            "a sticky CUDA fault while serving, on rank 1",
            {"CLEF_TEST_TP_FAULT": "sticky_when_armed"},
            "arm",
            "exits 4",
            Fired(status="503", says=("CUDA fault in rms_norm_rope",), log=kernel_fault),
            (2,),
        ),
        "launch": Scenario(
            "a launch error while serving (no kernel image)",
            {"CLEF_TEST_FAULT": "tp:launch_when_armed"},
            "arm",
            "serves on",
            Fired(status="200", kernels=("silu_mul:",)),
        ),
        "trials-unavailable": Scenario(
            "a trial process that cannot start (device busy)",
            {"CLEF_TEST_TRIAL_FAULT": "busy_at_start"},
            "none",
            "serves on",
            Fired(trials="unavailable: could not start on the device"),
            flags=trials,
        ),
        "shadow-oom": Scenario(
            "out of memory in the shadow run",
            {"CLEF_TEST_FAULT": "shadow_oom_when_armed"},
            "arm",
            "serves on",
            Fired(shadow="dropped"),
        ),
        "near-tolerance": Scenario(
            "a healthy record past the shadow's probability tolerance",
            {"CLEF_TEST_FAULT": "near_tolerance_when_armed"},
            "arm",
            "serves on",
            Fired(shadow="marginal"),
        ),
    }


def run_row(name: str, tp: int, healthy: dict | None, empty_hooks: bool = False) -> Row:
    """Row `name` at `tp` ranks, judged; `empty_hooks`: its hook doing nothing (the rules must then fail it)."""
    scenario = scenarios()[name]
    if empty_hooks:
        scenario = scenario.emptied()
    row = Row(name, tp, scenario.what, scenario.expect)
    with tempfile.TemporaryDirectory() as tmp:
        armed = Path(tmp) / "armed"
        faults = scenario.faults | {"CLEF_TEST_TP_FAULT_ARMED": str(armed)}
        server = Server(tp, faults, scenario.flags, str(Path(tmp) / "autotune"))
        try:
            _exercise(server, row, scenario, armed, healthy)
        finally:
            server.stop()
            server.kill()
            row.log = server.text()
    _judge(row)
    return row


def _exercise(server: Server, row: Row, scenario: Scenario, armed: Path, healthy: dict | None) -> None:
    trigger = scenario.trigger
    if trigger in ("kill-before", "wait-before"):
        deadline = time.monotonic() + 120
        while not server.workers() and time.monotonic() < deadline and server.process.poll() is None:
            time.sleep(0.1)
        if not server.workers():
            row.problems.append("no worker rank started")
            return
        started = time.monotonic()
        if trigger == "kill-before":
            server.workers()[0].kill()
        _await_exit(server, row, scenario, started)
        row.ready = server.ready_status()
        return
    if not server.wait_ready(300):
        row.problems.append("did not become ready: " + " / ".join(server.text().strip().splitlines()[-2:])[-300:])
        row.exit_code = str(server.process.poll())
        return
    row.ready = server.ready_status()
    deadline = time.monotonic() + 60
    while 0 <= server.verdicts() < 1 and time.monotonic() < deadline:  # the warm-up's shadow verdict first
        time.sleep(0.05)
    row.shadow_before = server.ready_body().get("shadow") or {}
    started = time.monotonic()
    if trigger == "arm":
        armed.touch()
    elif trigger in ("kill", "stop"):
        worker = server.workers()[0]
        worker.kill() if trigger == "kill" else os.kill(worker.pid, signal.SIGSTOP)
    before = server.verdicts()
    row.failing, row.failing_message, _ = server.post(timeout=120)
    if trigger == "arm" and row.failing == "200":  # a fault the request outlives (the shadow's): its verdict first
        deadline = time.monotonic() + 60
        while 0 <= server.verdicts() <= before and time.monotonic() < deadline:
            time.sleep(0.05)
    armed.unlink(missing_ok=True)
    if row.expect == "serves on":  # the recovery: the next answer
        row.following, _, body = server.post(timeout=120)
        if row.following == "200":
            row.seconds = time.monotonic() - started
            row.same_answer = same(body, healthy)
    else:  # what the next client meets while the process goes down; the exit is timed from the fault, not from it
        row.following, _, _ = server.post(timeout=10)
        _await_exit(server, row, scenario, started)
    row.ready = server.ready_status()
    if server.process.poll() is None:
        row.leaked = server.leaked()
        ready = server.ready_body()
        row.shadow_after = ready.get("shadow") or {}
        row.failures = (ready.get("autotune") or {}).get("failures", {})
        row.trials = str((ready.get("autotune") or {}).get("trials", ""))


def _await_exit(server: Server, row: Row, scenario: Scenario, fault_at: float) -> None:
    """Wait for the exit a little past the row's deadline (so a late one is measured), from the fault."""
    try:
        server.process.wait(max(0.0, fault_at + scenario.exit_deadline + 15 - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    server.process.poll()
    while server.process.returncode is not None and server.exited_at is None:  # the watcher's timestamp
        time.sleep(0.01)
    row.exit_code = "-" if server.process.returncode is None else str(server.process.returncode)
    if server.exited_at is not None:
        row.seconds = server.exited_at - fault_at


def fault_not_seen(row: Row, fired: Fired) -> list[str]:
    """What of the row's evidence is missing: each a reason the fault may never have fired."""
    missing = []
    if fired.status is not None and row.failing != fired.status:
        missing.append(f"the failing request got {row.failing}, not the fault's {fired.status}")
    for word in fired.says:
        if word.lower() not in row.failing_message.lower():
            missing.append(f"the failing request's message does not say {word!r} ({row.failing_message[:100]!r})")
    for kernel in fired.kernels:
        if not any(failed.startswith(kernel) for failed in row.failures):
            missing.append(f"/ready lists no failed kernel {kernel}")
    if fired.trials is not None and not row.trials.startswith(fired.trials):
        missing.append(f"/ready's trials are {row.trials or 'absent'!r}, not {fired.trials!r}")
    if fired.shadow is not None and row.shadow_after.get(fired.shadow, 0) <= row.shadow_before.get(fired.shadow, 0):
        missing.append(f"no shadow verdict {fired.shadow!r} after the fault")
    if fired.log and not any(all(word in line for word in fired.log) for line in row.log.splitlines()):
        missing.append(f"no log line with {' and '.join(map(repr, fired.log))}")
    return missing


def _judge(row: Row) -> None:
    scenario = scenarios()[row.name]
    row.problems += [f"fault not seen: {why}" for why in fault_not_seen(row, scenario.fired)]
    if row.expect == "serves on":
        if row.exit_code != "-":
            row.problems.append(f"exited ({row.exit_code}) on a fault it should serve through")
        if row.following != "200" or row.ready != "200":
            row.problems.append(f"next request {row.following}, /ready {row.ready}: not serving on")
        if row.same_answer == "NO":
            row.problems.append("SILENTLY WRONG: the answer after the fault differs from a healthy server's")
        if row.leaked not in ("none", "-"):
            row.problems.append(f"leaked {row.leaked}")
        return
    code = row.expect.split()[-1]
    if row.exit_code != code:
        row.problems.append(f"exit {row.exit_code}, expected {code}")
    if scenario.trigger != "kill-before" and row.failing != "503":
        row.problems.append(f"the failing request got {row.failing}, not a 503 with the contract's body")
    if row.seconds is None or row.seconds > scenario.exit_deadline:
        took = "no exit" if row.seconds is None else f"the exit {row.seconds:.1f} s"
        row.problems.append(f"{took} after the fault (the rule: within {scenario.exit_deadline:.0f} s)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(scenarios()), help="comma-separated row names")
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes to run each row under")
    parser.add_argument("--check", action="store_true", help="exit 1 if any row breaks a rule")
    parser.add_argument(
        "--empty-hooks",
        action="store_true",
        help="each hook a no-op: the rules must fail every row (--check: exit 1 if one passes)",
    )
    args = parser.parse_args()
    names, sizes = args.rows.split(","), args.tp.split(",")
    unknown = [n for n in names if n not in scenarios()] + [n for n in sizes if n not in ("1", "2")]
    if unknown:
        print(
            f"fault_matrix.py: error: unknown --rows or --tp {', '.join(unknown)} (rows: {', '.join(scenarios())}; "
            "sizes: 1, 2)",
            file=sys.stderr,
        )
        return 2
    sizes = [int(n) for n in sizes]
    rows = []
    healthy = {}  # per size, the answer of a healthy server (int8 shards are quantized per rank: not bit-equal)
    for tp in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            server = Server(tp, {}, (), str(Path(tmp) / "autotune"))
            try:
                server.assert_ready(300)
                status, message, healthy[tp] = server.post()
                assert status == "200", (status, message)
            finally:
                server.stop()
    for name in names:
        for tp in sizes:
            if tp not in scenarios()[name].sizes:
                continue
            started = time.monotonic()
            row = run_row(name, tp, healthy[tp], args.empty_hooks)
            rows.append(row)
            print(f"{name} tp={tp}: {time.monotonic() - started:.0f} s, {'ok' if not row.problems else row.problems}")
    hooks = "every hook EMPTIED (a no-op): each row must fail" if args.empty_hooks else "the shadow on every record"
    print(f"\nfault matrix: clef-serve on the CPU, int8 weights, {hooks}")
    print(f"(--tensor-parallel-timeout {TP_TIMEOUT_S:g}s; 'seconds': from the fault to the exit or to the next answer;")
    print(" 'evidence': the failing request's message, the shadow's verdicts match/marginal/mismatch/dropped, and")
    print(" the kernels /ready lists as failed)")
    header = f"{'fault':52s} {'tp':>2s} {'failing':>8s} {'next':>8s} {'/ready':>6s} {'exit':>4s} {'seconds':>7s}"
    print(f"{header} {'same':>4s} {'leaked':>7s}  {'evidence':50s} verdict")
    for r in rows:
        seconds = f"{r.seconds:7.1f}" if r.seconds is not None else f"{'-':>7s}"
        if args.empty_hooks:
            verdict = "caught: " + r.problems[0] if r.problems else "NOT CAUGHT: passes with its hook emptied"
        else:
            verdict = "ok" if not r.problems else "FAIL: " + "; ".join(r.problems)
        print(
            f"{r.what[:52]:52s} {r.tp:>2d} {r.failing[:8]:>8s} {r.following[:8]:>8s} {r.ready:>6s} {r.exit_code:>4s} "
            f"{seconds} {r.same_answer:>4s} {r.leaked[:7]:>7s}  {r.evidence[:50]:50s} {verdict}"
        )
    broken = [r for r in rows if not r.problems] if args.empty_hooks else [r for r in rows if r.problems]
    return 1 if args.check and broken else 0


if __name__ == "__main__":
    sys.exit(main())
