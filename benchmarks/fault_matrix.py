#!/usr/bin/env python3
"""Where the fail-safes meet: every injected fault under one device and under tensor parallel over two ranks, each
with the shadow (every record) and int8 weights on, served by clef-serve as its own process on the CPU (gloo, the
test-only fault hooks of tests/tp_worker_faults.py, tests/faulty_clef_serve.py, tests/trial_candidates.py and
clef_cuda.serving.trial). What a client and an operator see, one row each: the failing request's status, the
next request's, /ready after both, the exit code if the process ended, the seconds from the fault to the 503 (or
to the recovery: the next answer), whether the next answer equals a healthy one-device server's, and the KV
blocks and state slots leaked (idle: in use beyond what the prefix cache and a shadow run hold). Table last.

    python benchmarks/fault_matrix.py                 # every row, TP=1 and TP=2 (about 10 minutes on 2 cores)
    python benchmarks/fault_matrix.py --rows hung,overflow --tp 2
    python benchmarks/fault_matrix.py --check         # exit 1 if a row breaks a rule (below)

The rules (--check): no hang past the row's stated timeout; a request-level fault never takes the server down
(no exit, the next request answered); an answer after a recovered fault equals the healthy one (no silently wrong
answer); nothing leaked; a fault that kills the device or the group ends the process with its exit code (4 or 5)
within 15 s, after a 503 with the contract's body.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "tests"))
sys.path.append(str(ROOT))

FAULTY = str(ROOT / "tests" / "faulty_clef_serve.py")
WORKER_FAULTS = str(ROOT / "tests" / "tp_worker_faults.py")
CANDIDATES = str(ROOT / "tests" / "trial_candidates.py")
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


@dataclass
class Row:
    name: str
    tp: int
    what: str  # the fault, in words
    expect: str  # "serves on" | "exits 4" | "exits 5"
    failing: str = "-"
    following: str = "-"
    ready: str = "-"
    exit_code: str = "-"
    seconds: float | None = None
    same_answer: str = "-"
    leaked: str = "-"
    evidence: str = "-"  # from /ready: the shadow's verdicts (match/marginal/mismatch/dropped), kernels failed
    problems: list[str] = field(default_factory=list)


class Server:
    """clef-serve (through tests/faulty_clef_serve.py) on a free port, its output kept."""

    def __init__(self, tp: int, env: dict, extra: tuple[str, ...], cache: str) -> None:
        from live import free_port
        from releases import tiny_release

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, FAULTY, "--w", str(tiny_release()), "--d", "cpu", "--host", "127.0.0.1"]
        argv += ["--p", str(self.port), "--tp", str(tp), "--quantize", "int8", "--shadow-rate", "1"]
        argv += [
            "--shadow-mode",
            "enforce",
            "--tensor-parallel-timeout",
            f"{TP_TIMEOUT_S:g}s",
            "--max-model-len",
            "4096",
        ]
        argv += ["--kv-fraction", "0.05", "--autotune-cache", cache, *extra]
        self.process = subprocess.Popen(
            argv, cwd=ROOT, env=os.environ | env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.output: list[str] = []
        threading.Thread(target=lambda: self.output.extend(self.process.stdout), daemon=True).start()

    def wait_ready(self, timeout: float = 300) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        return False

    def post(self, timeout: float = 60) -> tuple[str, dict | None]:
        try:
            response = httpx.post(self.url + "/v1/systemone", json=REQUEST, timeout=timeout)
        except httpx.HTTPError as error:
            return f"no answer ({type(error).__name__})", None
        body = response.json()
        if response.status_code != 200 and not (
            isinstance(body.get("detail"), dict) and "error_type" in body["detail"]
        ):
            return f"{response.status_code} WITHOUT the contract's body", None
        return str(response.status_code), body

    def evidence(self) -> str:
        """What /ready says the fault did: the shadow's verdicts, the kernels failed, the trials."""
        try:
            body = httpx.get(self.url + "/ready", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return "-"
        parts = []
        if body.get("shadow"):
            s = body["shadow"]
            parts.append(f"shadow {s['match']}/{s.get('marginal', 0)}/{s['mismatch']}/{s['dropped']}")
        autotune = body.get("autotune") or {}
        if str(autotune.get("trials", "")).startswith("unavailable"):
            parts.append(f"trials unavailable ({len(autotune.get('failures', {}))} kept off)")
        elif autotune.get("failures"):
            parts.append(f"{len(autotune['failures'])} kernel(s) failed")
        return ", ".join(parts) or "-"

    def verdicts(self) -> int:
        try:
            s = httpx.get(self.url + "/ready", timeout=2).json()["shadow"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return -1
        return s["match"] + s.get("marginal", 0) + s["mismatch"] + s["dropped"]

    def ready(self) -> str:
        try:
            return str(httpx.get(self.url + "/ready", timeout=2).status_code)
        except httpx.HTTPError:
            return "down"

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

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def workers(self) -> list[psutil.Process]:
        try:
            children = psutil.Process(self.process.pid).children()
        except psutil.NoSuchProcess:
            return []
        return [p for p in children if "tensor_parallel" in " ".join(p.cmdline())]


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
class Scenario:
    what: str  # the fault, in words
    env: dict  # the test-only hooks that inject it
    trigger: str  # "arm" (the hook's file), "kill" / "stop" (a worker), "kill-before" (a loading worker), "none"
    expect: str  # "serves on", "exits 4", "exits 5"
    sizes: tuple[int, ...] = (1, 2)  # the tensor-parallel sizes it applies to
    flags: tuple[str, ...] = ()


def scenarios() -> dict[str, Scenario]:
    worker = {"CLEF_TEST_TP_WORKER_OPS": WORKER_FAULTS}
    trials = ("--kernel-trials", "child")
    candidates = {"CLEF_TEST_ATTENTION_CANDIDATES": CANDIDATES, "CLEF_TEST_CANDIDATE_SET": "crash,sticky"}
    return {
        "overflow": Scenario(
            "an f16 overflow record (every rank, after the all-reduces)",
            {"CLEF_TEST_FAULT": "tp:overflow_once_when_armed"},
            "arm",
            "serves on",
        ),
        "rank0-oom": Scenario(
            "rank 0 out of memory mid-step", {"CLEF_TEST_FAULT": "tp:oom_once_when_armed"}, "arm", "serves on"
        ),
        "worker-oom": Scenario(
            "rank 1 out of memory mid-step",
            worker | {"CLEF_TEST_TP_FAULT": "oom_once_when_armed"},
            "arm",
            "serves on",
            (2,),
        ),
        "killed-before": Scenario(
            "a worker killed before the rendezvous",
            worker | {"CLEF_TEST_TP_FAULT": "hang_at_start"},
            "kill-before",
            "exits 5",
            (2,),
        ),
        "killed-after": Scenario("a worker killed while serving", {}, "kill", "exits 5", (2,)),
        "hung": Scenario("a worker hung (SIGSTOP)", {}, "stop", "exits 5", (2,)),
        "trial-sticky": Scenario(
            "kernels that crash or poison their trial process", candidates, "none", "serves on", flags=trials
        ),
        "sticky-rank0": Scenario(
            "a sticky CUDA fault while serving, on rank 0",
            {"CLEF_TEST_FAULT": "tp:sticky_when_armed"},
            "arm",
            "exits 4",
        ),
        "sticky-worker": Scenario(
            "a sticky CUDA fault while serving, on rank 1",
            worker | {"CLEF_TEST_TP_FAULT": "sticky_when_armed"},
            "arm",
            "exits 4",
            (2,),
        ),
        "launch": Scenario(
            "a launch error while serving (no kernel image)",
            {"CLEF_TEST_FAULT": "tp:launch_when_armed"},
            "arm",
            "serves on",
        ),
        "trials-unavailable": Scenario(
            "a trial process that cannot start (device busy)",
            {"CLEF_TEST_TRIAL_FAULT": "busy_at_start"},
            "none",
            "serves on",
            flags=trials,
        ),
        "shadow-oom": Scenario(
            "out of memory in the shadow run", {"CLEF_TEST_FAULT": "shadow_oom_when_armed"}, "arm", "serves on"
        ),
        "near-tolerance": Scenario(
            "a healthy record past the shadow's probability tolerance",
            {"CLEF_TEST_FAULT": "near_tolerance_when_armed"},
            "arm",
            "serves on",
        ),
    }


def run_row(name: str, tp: int, healthy: dict | None) -> Row:
    scenario = scenarios()[name]
    row = Row(name, tp, scenario.what, scenario.expect)
    with tempfile.TemporaryDirectory() as tmp:
        armed = Path(tmp) / "armed"
        env = {"CLEF_TEST_FAULT": "none"} | scenario.env | {"CLEF_TEST_TP_FAULT_ARMED": str(armed)}
        server = Server(tp, env, scenario.flags, str(Path(tmp) / "autotune"))
        try:
            _exercise(server, row, scenario.trigger, armed, healthy)
        finally:
            server.stop()
            if server.process.poll() is None:
                server.process.kill()
    _judge(row)
    return row


def _exercise(server: Server, row: Row, trigger: str, armed: Path, healthy: dict | None) -> None:
    if trigger == "kill-before":
        deadline = time.monotonic() + 120
        while not server.workers() and time.monotonic() < deadline:
            time.sleep(0.1)
        server.workers()[0].kill()
        started = time.monotonic()
        try:
            server.process.wait(60)
            row.seconds = time.monotonic() - started
        except subprocess.TimeoutExpired:
            row.problems.append("still running 60 s after its worker died")
        row.exit_code = str(server.process.poll())
        row.ready = server.ready()
        return
    if not server.wait_ready():
        row.problems.append("did not become ready: " + "".join(server.output[-5:]).strip()[-300:])
        row.exit_code = str(server.process.poll())
        return
    row.ready = server.ready()
    deadline = time.monotonic() + 60
    while 0 <= server.verdicts() < 1 and time.monotonic() < deadline:  # the warm-up's shadow verdict first
        time.sleep(0.05)
    if trigger == "arm":
        armed.touch()
    elif trigger in ("kill", "stop"):
        worker = server.workers()[0]
        worker.kill() if trigger == "kill" else os.kill(worker.pid, signal.SIGSTOP)
    started = time.monotonic()
    before = server.verdicts()
    row.failing, _ = server.post(timeout=120)
    failed_at = time.monotonic()
    if trigger == "arm" and row.failing == "200":  # a fault the request outlives (the shadow's): its verdict first
        deadline = time.monotonic() + 60
        while 0 <= server.verdicts() <= before and time.monotonic() < deadline:
            time.sleep(0.05)
    armed.unlink(missing_ok=True)
    # The 503 or the recovery: /ready 503 seen, or the next answer.
    row.following, body = server.post(timeout=120)
    if row.following == "200":
        row.seconds = time.monotonic() - started
        row.same_answer = same(body, healthy)
    else:
        row.seconds = failed_at - started
    row.ready = server.ready()
    if server.process.poll() is None and row.expect != "serves on":
        try:
            server.process.wait(EXIT_DEADLINE_S)
        except subprocess.TimeoutExpired:
            row.problems.append(f"still running {EXIT_DEADLINE_S:.0f} s after the fault")
    row.exit_code = "-" if server.process.poll() is None else str(server.process.poll())
    if server.process.poll() is None:
        row.leaked = server.leaked()
        row.evidence = server.evidence()


def _judge(row: Row) -> None:
    if row.expect == "serves on":
        if row.exit_code != "-":
            row.problems.append(f"exited ({row.exit_code}) on a fault it should serve through")
        if row.following != "200" or row.ready != "200":
            row.problems.append(f"next request {row.following}, /ready {row.ready}: not serving on")
        if row.same_answer == "NO":
            row.problems.append("SILENTLY WRONG: the answer after the fault differs from a healthy server's")
        if row.leaked not in ("none", "-"):
            row.problems.append(f"leaked {row.leaked}")
    else:
        code = row.expect.split()[-1]
        if row.exit_code != code:
            row.problems.append(f"exit {row.exit_code}, expected {code}")
        if row.failing not in ("503", "-") and not row.failing.startswith("no answer") and row.name != "killed-before":
            row.problems.append(f"the failing request got {row.failing}, not a 503")
        if row.seconds is not None and row.seconds > EXIT_DEADLINE_S + TP_TIMEOUT_S:
            row.problems.append(f"{row.seconds:.1f} s to the 503 or the exit")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(scenarios()), help="comma-separated row names")
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes to run each row under")
    parser.add_argument("--check", action="store_true", help="exit 1 if any row breaks a rule")
    args = parser.parse_args()
    sizes = [int(x) for x in args.tp.split(",")]
    rows = []
    healthy = {}  # per size, the answer of a healthy server (int8 shards are quantized per rank: not bit-equal)
    for tp in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            server = Server(tp, {"CLEF_TEST_FAULT": "none"}, (), str(Path(tmp) / "autotune"))
            try:
                assert server.wait_ready(), "".join(server.output[-20:])
                status, healthy[tp] = server.post()
                assert status == "200", status
            finally:
                server.stop()
    for name in args.rows.split(","):
        for tp in sizes:
            if tp not in scenarios()[name].sizes:
                continue
            started = time.monotonic()
            row = run_row(name, tp, healthy[tp])
            rows.append(row)
            print(f"{name} tp={tp}: {time.monotonic() - started:.0f} s, {'ok' if not row.problems else row.problems}")
    print("\nfault matrix: clef-serve on the CPU, int8 weights, the shadow on every record")
    print(f"(--tensor-parallel-timeout {TP_TIMEOUT_S:g}s; 'seconds': to the 503 or the exit, or to the next answer;")
    print(" '/ready says': the shadow's verdicts match/marginal/mismatch/dropped, the kernels failed)")
    header = f"{'fault':52s} {'tp':>2s} {'failing':>8s} {'next':>8s} {'/ready':>6s} {'exit':>4s} {'seconds':>7s}"
    print(f"{header} {'same':>4s} {'leaked':>7s}  {'/ready says':50s} verdict")
    for r in rows:
        seconds = f"{r.seconds:7.1f}" if r.seconds is not None else f"{'-':>7s}"
        verdict = "ok" if not r.problems else "FAIL: " + "; ".join(r.problems)
        print(
            f"{r.what[:52]:52s} {r.tp:>2d} {r.failing[:8]:>8s} {r.following[:8]:>8s} {r.ready:>6s} {r.exit_code:>4s} "
            f"{seconds} {r.same_answer:>4s} {r.leaked[:7]:>7s}  {r.evidence[:50]:50s} {verdict}"
        )
    return 1 if args.check and any(r.problems for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
