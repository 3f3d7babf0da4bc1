"""The Prometheus rules an operator loads (deploy/prometheus/clef-rules.yml, and the same groups as the Operator's
PrometheusRule in deploy/k8s/monitoring/, written from it by `python tests/test_prometheus_rules.py`): promtool's own
checks and unit tests (every alert firing and not), every series they read is one clef-serve exports, and a real
Prometheus, with the same rules loaded in a shorter time frame (live_rules), sees every alert fire: scraping running
clef-serve processes with faults injected through the tests' launcher, and for the series kube-state-metrics would
export (a pod's restarts and last exit code) a stand-in exporter the test updates as it restarts the server.

promtool and prometheus are Debian's `prometheus` package (make test's set-up installs it, as it does haproxy)."""

from __future__ import annotations

import collections
import itertools
import re
import shutil
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml
from live import ClefServe, free_port, wait_until
from tp_worker_faults import ARMED_ENV, FAULT_ENV

from app.metrics import Metrics
from clef_cuda.tuning.tunes import AutotuneReport
from clef_cuda.verification.selfcheck import Check, SelfCheckReport

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "clef-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "clef-rules.test.yml"
PROMETHEUS_RULE = ROOT / "deploy" / "k8s" / "monitoring" / "prometheusrule.yaml"
# Series the rules read that kube-state-metrics exports, not clef-serve.
KUBE_STATE_METRICS = {"kube_pod_container_status_last_terminated_exitcode", "kube_pod_container_status_restarts_total"}


def tool(name: str) -> str:
    found = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if found is None:
        raise RuntimeError(f"{name} is not installed (Debian: apt-get install prometheus; make test's set-up does)")
    return found


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def rules() -> dict:
    return yaml.safe_load(RULES.read_text())


def alerts(groups: dict) -> dict[str, dict]:
    return {rule["alert"]: rule for group in groups["groups"] for rule in group["rules"] if "alert" in rule}


class _LiteralBlocks(yaml.SafeDumper):
    """The longer expressions (several lines) as literal blocks, as clef-rules.yml writes them."""


_LiteralBlocks.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)


def operator_copy() -> str:
    """deploy/k8s/monitoring/prometheusrule.yaml as it must read: its own header (comments, apiVersion, metadata),
    then clef-rules.yml's groups as its spec. `python tests/test_prometheus_rules.py` writes it, so a change to the
    rules (the latency objective included) is made in clef-rules.yml alone."""
    header = PROMETHEUS_RULE.read_text().partition("\nspec:\n")[0]
    return header + "\n" + yaml.dump({"spec": rules()}, Dumper=_LiteralBlocks, sort_keys=False, width=120)


def test_promtool_checks_the_rules_and_the_operators_copy_is_made_from_them(tmp_path):
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    operator = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert (operator["apiVersion"], operator["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert PROMETHEUS_RULE.read_text() == operator_copy(), (
        "deploy/k8s/monitoring/prometheusrule.yaml differs from clef-rules.yml: python tests/test_prometheus_rules.py "
        "writes it from them"
    )
    assert operator["spec"] == rules()
    copy = tmp_path / "operator-rules.yml"
    copy.write_text(yaml.safe_dump(operator["spec"]))
    assert promtool("check", "rules", str(copy)).returncode == 0


def test_promtool_unit_tests_pass_and_cover_every_alert_firing_and_not():
    result = promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    firing, quiet = set(), set()
    for test in tests:
        for case in test["alert_rule_test"]:
            (firing if case["exp_alerts"] else quiet).add(case["alertname"])
    assert set(alerts(rules())) == firing == quiet, "every alert needs a case where it fires and one where it does not"


# The exit-code alerts' condition that a restart followed within 15 minutes (so they resolve).
RESTARTED = (
    "\n                and on(namespace, pod, container)\n"
    '                  increase(kube_pod_container_status_restarts_total{container="clef-serve"}[15m]) > 0'
)


def test_a_broken_alert_fails_its_unit_test(tmp_path):
    """The unit tests can fail: each of these edits to the rules is caught."""
    text = RULES.read_text()
    broken = {
        "the self-check alert on the wrong value": ("clef_selfcheck_passed == 0", "clef_selfcheck_passed == 1"),
        "the mismatch alert on a misspelt result": ('{result="mismatch"}', '{result="mismatched"}'),
        "the not-ready alert after 30 minutes": ("        for: 20m\n", "        for: 30m\n"),
        "the objective raised": ("expr: vector(5)", "expr: vector(50)"),
        "the kernel-fault alert on an old exit code (never resolving)": ("== 4" + RESTARTED, "== 4"),
        "the rank-lost alert on an old exit code (never resolving)": ("== 5" + RESTARTED, "== 5"),
    }
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    for what, (old, new) in broken.items():
        assert old in text, what
        (tmp_path / RULES.name).write_text(text.replace(old, new, 1))
        result = promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
        assert result.returncode != 0, f"{what}: the unit tests passed"


def exported_series() -> set[str]:
    """Every sample name clef-serve's /metrics can carry, its lazily made families (self-check, autotune) made."""
    metrics = Metrics()
    metrics.observe_selfcheck(SelfCheckReport("cpu", "float32", 0.1, (Check("conv1d", 0.0, 1e-5),)))
    metrics.observe_autotune(AutotuneReport("fast", {}, failures={"paged_attention:wmma2": "faulted"}))
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    return {family.name + suffix for family in metrics.registry.collect() for suffix in suffixes[family.type]}


def test_every_series_the_rules_read_is_exported():
    exported = exported_series()
    recorded = {rule["record"] for group in rules()["groups"] for rule in group["rules"] if "record" in rule}
    read = set()
    for group in rules()["groups"]:
        for rule in group["rules"]:
            read |= set(re.findall(r"\b(clef_[a-z_]+|kube_[a-z_]+)\b", rule["expr"]))
            assert set(re.findall(r"\bclef:[a-z_:0-9]+", rule["expr"])) <= recorded, rule
    missing = read - exported - KUBE_STATE_METRICS
    assert not missing, f"the rules read series clef-serve does not export: {sorted(missing)}"
    assert {"clef_failed", "clef_queue_limit", "clef_start_time_seconds"} <= exported


# ---- a real Prometheus ------------------------------------------------------------------------------------------
# The live tests load clef-rules.yml with its time frame shrunk (live_rules): every `for:` and range window divided by
# TIME_SCALE, so a minute of the rules passes in half a second (ClefNotReady's 20 minutes in 10 s, a 5-minute rate
# window in 2.5 s: five scrapes), and the latency objective at LIVE_SLO_SECONDS, above an idle decision of the
# embedded model and below one that waited in a full queue. The expressions are the shipped ones.
TIME_SCALE = 120
SCRAPE = "500ms"  # prometheus's scrape and evaluation interval, and a scrape's timeout
LIVE_SLO_SECONDS = 0.25
UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# What each live test must see fire, on which server (the rest of the rules' alerts: the other test's).
SERVER_ALERTS = {
    "seed": {"ClefSelfCheckFailed", "ClefShadowMismatch", "ClefNotReady", "ClefRefusingRequests"},
    "busy": {"ClefShadowMarginal", "ClefQueueNearFull", "ClefRefusingRequests", "ClefLatencyOverSLO"},
}
POD_ALERTS = {"ClefKernelFault", "ClefKernelFailed", "ClefTensorParallelRankLost", "ClefRestarting"}


def shortened(duration: str) -> str:
    value, unit = re.fullmatch(r"(\d+)([smhd])", duration).groups()
    return f"{int(value) * UNIT_SECONDS[unit] * 1000 // TIME_SCALE}ms"


def live_rules() -> dict:
    """clef-rules.yml as the live tests load it, made from it here (never a second copy to keep): every `for:` and
    range window divided by TIME_SCALE, the latency objective LIVE_SLO_SECONDS, nothing else changed."""
    groups = rules()
    for group in groups["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = shortened(rule["for"])
            rule["expr"] = re.sub(r"\[(\w+)\]", lambda window: f"[{shortened(window[1])}]", rule["expr"])
            if rule.get("record") == "clef:latency_slo_seconds":
                rule["expr"] = f"vector({LIVE_SLO_SECONDS})"
    return groups


def test_the_live_rules_are_the_shipped_ones_in_a_shorter_time(tmp_path):
    shipped, live = rules(), live_rules()
    (tmp_path / "live.yml").write_text(yaml.safe_dump(live))
    checked = promtool("check", "rules", str(tmp_path / "live.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert not re.search(r"\[\d+[smhd]\]", yaml.safe_dump(live)), "a range window was left as shipped"
    durations = re.compile(r"\[\w+\]|vector\([\d.]+\)")  # what live_rules changes: windows, the objective
    for old_group, new_group in zip(shipped["groups"], live["groups"], strict=True):
        for old, new in zip(old_group["rules"], new_group["rules"], strict=True):
            assert old.keys() == new.keys() and all(old[k] == new[k] for k in old.keys() - {"expr", "for"}), new
            assert durations.sub("", old["expr"]) == durations.sub("", new["expr"]), new
            assert "for" not in new or new["for"] == shortened(old["for"]) != old["for"], new
    assert shortened("20m") == "10000ms" and shortened("1h") == "30000ms"
    assert set(alerts(shipped)) == set().union(*SERVER_ALERTS.values(), POD_ALERTS), "an alert no live test drives"


DECISION = {
    "model": "clef-tiny",
    "state": "12:00 api: ok\n12:01 db: timeout\n12:02 api: error",
    "questions": {"db": {"type": "noul", "instructions": "Did the database fail?"}},
}


def long_decision(n: int) -> dict:
    """A record of about 3,500 tokens (a quarter of a second's prefill on 2 cores), the n-th of its kind."""
    return DECISION | {"state": f"run {n}\n" + "12:00:01 INFO api: request served for user 42 in 13 ms\n" * 100}


class Prometheus:
    """prometheus on 127.0.0.1 with live_rules() loaded, scraping each job's targets and evaluating every SCRAPE."""

    def __init__(self, jobs: dict[str, list[str]], work: Path) -> None:
        (work / "rules.yml").write_text(yaml.safe_dump(live_rules()))
        config = {
            "global": {"scrape_interval": SCRAPE, "scrape_timeout": SCRAPE, "evaluation_interval": SCRAPE},
            "rule_files": [str(work / "rules.yml")],
            "scrape_configs": [
                # honor_labels: the exporter's namespace and pod labels kept, as kube-state-metrics' scrape job has it
                {"job_name": job, "honor_labels": job == "kube-state-metrics", "static_configs": [{"targets": targets}]}
                for job, targets in jobs.items()
            ],
        }
        (work / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.process = subprocess.Popen(
            [
                tool("prometheus"),
                f"--config.file={work / 'prometheus.yml'}",
                f"--storage.tsdb.path={work / 'data'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def get(self, path: str, **params) -> dict:
        return httpx.get(self.url + path, params=params, timeout=5).json()["data"]

    def query(self, expr: str) -> list[dict]:
        return self.get("/api/v1/query", query=expr)["result"]

    def firing(self) -> list[dict]:
        """The alerts firing now (their labels)."""
        return [a["labels"] for a in self.get("/api/v1/alerts")["alerts"] if a["state"] == "firing"]

    def fired(self) -> list[dict]:
        """Every alert that has fired since prometheus started (its ALERTS series), with its labels."""
        return [found["metric"] for found in self.query('max_over_time(ALERTS{alertstate="firing"}[1h])')]

    def ready(self) -> bool:
        assert self.process.poll() is None, f"prometheus exited: {self.process.stderr.read()}"
        try:
            return httpx.get(self.url + "/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def among(alerts: list[dict], name: str, **labels: str) -> bool:
    return any(a["alertname"] == name and labels.items() <= a.items() for a in alerts)


def wait_for_alerts(prometheus: Prometheus, wanted: list[tuple[str, dict]], what: str) -> None:
    """Waits until each (alert, labels) of `wanted` has fired; fails naming those that did not and what fires now."""

    def missing() -> list[tuple[str, dict]]:
        fired = prometheus.fired()
        return [(alert, labels) for alert, labels in wanted if not among(fired, alert, **labels)]

    try:
        wait_until(lambda: not missing(), what, poll=0.25)
    except AssertionError as timeout:
        raise AssertionError(f"{timeout}: never fired {missing()}; firing now {prometheus.firing()}") from None


def target(server: ClefServe) -> str:
    return f"127.0.0.1:{server.port}"


class Clients:
    """`clients` threads posting decisions to `url` until stop(), the n-th `body(n)`: the next as soon as one is
    answered, `pause` seconds after a refusal (or while the server does not listen yet). `statuses` counts them."""

    def __init__(self, url: str, clients: int, body, pause: float = 0.05) -> None:
        self.statuses: collections.Counter = collections.Counter()
        self._stop, self._lock, self._numbers = threading.Event(), threading.Lock(), itertools.count()
        self._threads = [threading.Thread(target=self._post, args=(url, body, pause)) for _ in range(clients)]
        for thread in self._threads:
            thread.start()

    def _post(self, url: str, body, pause: float) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                try:
                    status = client.post(url + "/v1/systemone", json=body(next(self._numbers))).status_code
                except httpx.HTTPError:
                    status = None
                with self._lock:
                    self.statuses[status] += 1
                if status != 200:
                    self._stop.wait(pause)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(70)


def test_a_real_prometheus_sees_each_servers_own_alerts_fire(tmp_path):
    """Two clef-serve processes scraped by a real prometheus with the rules loaded (live_rules: the shipped ones in a
    shorter time), each fault through the tests' launcher:
    - seed: the embedded model with the seed's fault (the conv's key band zeroed) under --selfcheck warn, every
      answered record re-decided on the reference ops under --shadow-mode enforce: ClefSelfCheckFailed, and
      ClefShadowMismatch from its first decisions (the warm-up's included), after which it stops answering:
      ClefNotReady, and the decisions a client keeps sending are refused (503), ClefRefusingRequests;
    - busy: one record at a time with a queue of one (--max-num-seqs 1 --max-queue 1), answering; once prometheus has
      its shadow's counts, the near_tolerance fault makes its verdicts marginal (warn: it serves on): two decisions
      fire ClefShadowMarginal (its shadow runs when idle: before the load); then four clients sending long records
      keep the queue full: ClefQueueNearFull, ClefRefusingRequests (the full queue's 503s) and ClefLatencyOverSLO.
    The decisions arrive as series and recording rules, each alert fires on the server that caused it and not on the
    other. Bounded: every wait is a hang guard; the clients, both servers and prometheus are stopped whatever
    happens."""
    armed = tmp_path / "near-tolerance"
    servers: dict[str, ClefServe] = {}
    clients: list[Clients] = []
    prometheus = None
    try:
        servers["seed"] = ClefServe(
            "--d", "cpu", "--autotune", "off", "--selfcheck", "warn", "--shadow-rate", "1", "--shadow-mode", "enforce",
            faults={"CLEF_TEST_FAULT": "key_band"},
        )  # fmt: skip
        servers["busy"] = ClefServe(
            "--d", "cpu", "--autotune", "off", "--shadow-rate", "1", "--shadow-mode", "warn", "--max-num-seqs", "1",
            "--max-queue", "1", "--disable-prefix-cache",
            faults={"CLEF_TEST_FAULT": "near_tolerance_when_armed", ARMED_ENV: str(armed)},
        )  # fmt: skip
        seed, busy = (target(servers[name]) for name in ("seed", "busy"))
        prometheus = Prometheus({"clef": [seed, busy]}, tmp_path)
        wait_until(prometheus.ready, "prometheus to start")
        clients.append(Clients(servers["seed"].url, 1, lambda n: DECISION, pause=0.1))
        servers["busy"].assert_ready()
        for _ in range(3):
            assert httpx.post(servers["busy"].url + "/v1/systemone", json=DECISION, timeout=60).status_code == 200
        wait_until(
            lambda: (
                prometheus.query(f'clef_requests_total{{instance="{busy}", status="200"}} >= 3')
                and prometheus.query(f'clef:requests:rate5m{{instance="{busy}"}}')
                and prometheus.query(f'clef_queue_limit{{instance="{busy}"}} == 1')
                and prometheus.query(f'clef_queue_limit{{instance="{seed}"}} == 256')
                and prometheus.query(f'clef_shadow_checks_total{{instance="{busy}", result="marginal"}} == 0')
            ),
            "the decisions' series and a recording rule in prometheus",
        )
        armed.touch()  # from here the busy server's shadow verdicts are marginal: an increase prometheus sees
        for n in range(2):  # records whose answers differ from the reference's at all (DECISION's do not)
            answer = httpx.post(servers["busy"].url + "/v1/systemone", json=long_decision(n), timeout=60)
            assert answer.status_code == 200, answer.text
        # The shadow re-decides when idle: its verdicts come before the load (under it, its samples are dropped).
        wait_for_alerts(prometheus, [("ClefShadowMarginal", {"instance": busy})], "ClefShadowMarginal to fire")
        clients.append(Clients(servers["busy"].url, 4, long_decision))
        wanted = [
            (alert, {"instance": target(servers[name])}) for name in SERVER_ALERTS for alert in SERVER_ALERTS[name]
        ]
        wait_for_alerts(prometheus, wanted, "every alert of each server to fire")
        fired = prometheus.fired()
        assert not [a for a in fired if a["alertname"] in POD_ALERTS], fired
        assert not among(fired, "ClefSelfCheckFailed", instance=busy), "the busy server's self-check passed"
        assert not among(fired, "ClefQueueNearFull", instance=seed), "nothing waits in the seed's queue"
        assert clients[0].statuses[503] and clients[1].statuses[503], [c.statuses for c in clients]
    finally:
        for running in clients:
            running.stop()
        if prometheus is not None:
            prometheus.stop()
        for server in servers.values():
            server.kill()
    assert prometheus.process.poll() is not None and all(s.process.poll() is not None for s in servers.values())


class KubeStateMetrics:
    """A stand-in for kube-state-metrics, which reads the Kubernetes API (there is none here): the two series of it
    the rules read, for one pod's clef-serve container, in the Prometheus text format, on 127.0.0.1. The test plays the
    kubelet: `terminated(code)` when the container exits, which restarts it at once. The last terminated exit code is
    exposed from the first termination on and kept until the next, as kube-state-metrics does."""

    def __init__(self, namespace: str = "llm-serving", pod: str = "clef-candle-7d9f8-x2k4p") -> None:
        self.labels = f'namespace="{namespace}",pod="{pod}",uid="2f1c5e0a-test",container="clef-serve"'
        self.pod, self.restarts, self.exit_code = pod, 0, None
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = exporter.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.target = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def terminated(self, exit_code: int) -> None:
        self.exit_code, self.restarts = exit_code, self.restarts + 1

    def render(self) -> str:
        lines = [
            "# HELP kube_pod_container_status_restarts_total [STABLE] The number of container restarts per container.",
            "# TYPE kube_pod_container_status_restarts_total counter",
            f"kube_pod_container_status_restarts_total{{{self.labels}}} {self.restarts}",
        ]
        if self.exit_code is not None:
            lines += [
                "# HELP kube_pod_container_status_last_terminated_exitcode Describes the exit code for the last "
                "terminated container.",
                "# TYPE kube_pod_container_status_last_terminated_exitcode gauge",
                f"kube_pod_container_status_last_terminated_exitcode{{{self.labels}}} {self.exit_code}",
            ]
        return "\n".join(lines) + "\n"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def test_a_real_prometheus_sees_a_pods_faults_and_restarts_and_the_exit_code_alerts_resolve(tmp_path):
    """One pod's clef-serve container (tensor parallel over two ranks, the embedded model) and its kube-state-metrics
    series (KubeStateMetrics: the test plays the kubelet, restarting each exit on the same port, so one scrape
    target), scraped by a real prometheus with the rules loaded (live_rules). Its lives:
    1. rank 1's rms_norm_rope leaves a sticky CUDA fault once the test arms it (tests/tp_worker_faults.py): the
       decision gets 503, the server exits 4;
    2. restarted without that kernel (the autotune cache): ClefKernelFault (the last exit code 4 after a recent
       restart) and ClefKernelFailed (its clef_kernel_failed); then its worker rank is killed: exit 5;
    3. restarted: ClefTensorParallelRankLost (exit code 5), ClefRestarting (two restarts: from the server's start
       times and from the restart count); and once it has stayed up for the rules' 15 minutes, the exit-code alert
       resolves while kube-state-metrics still says 5.
    The server's own clef_failed lives the second between a fault and the exit: a scrape may or may not catch it.
    Bounded: every wait is a hang guard; the server, its ranks, the exporter and prometheus are stopped whatever
    happens."""
    from clef_cuda.lifecycle import EXIT_KERNEL_FAULT, EXIT_TENSOR_PARALLEL_LOST

    armed, port = tmp_path / "armed", free_port()
    port_target = f"127.0.0.1:{port}"
    faults = {FAULT_ENV: "sticky_when_armed", ARMED_ENV: str(armed)}
    args = ("--d", "cpu", "--tp", "2", "--autotune-cache", str(tmp_path / "autotune"))
    kube = KubeStateMetrics()
    prometheus = life = None

    def restart(exit_code: int) -> ClefServe:
        kube.terminated(exit_code)
        return ClefServe(*args, faults=faults, port=port)

    try:
        prometheus = Prometheus({"clef": [port_target], "kube-state-metrics": [kube.target]}, tmp_path)
        life = ClefServe(*args, faults=faults, port=port)
        wait_until(prometheus.ready, "prometheus to start")
        life.assert_ready()
        armed.touch()
        assert httpx.post(life.url + "/v1/systemone", json=DECISION, timeout=60).status_code == 503
        assert life.process.wait(30) == EXIT_KERNEL_FAULT
        life = restart(EXIT_KERNEL_FAULT)
        life.assert_ready()
        wait_for_alerts(
            prometheus,
            [
                ("ClefKernelFault", {"pod": kube.pod}),
                ("ClefKernelFailed", {"instance": port_target, "kernel": "rms_norm_rope:cpu"}),
            ],
            "ClefKernelFault (the pod's exit code 4) and ClefKernelFailed to fire",
        )
        (worker,) = life.workers()
        worker.kill()
        assert life.process.wait(30) == EXIT_TENSOR_PARALLEL_LOST
        life = restart(EXIT_TENSOR_PARALLEL_LOST)
        restarted = time.monotonic()
        life.assert_ready()
        wait_for_alerts(
            prometheus,
            [
                ("ClefTensorParallelRankLost", {"pod": kube.pod}),
                ("ClefRestarting", {"pod": kube.pod}),
                ("ClefRestarting", {"instance": port_target}),
            ],
            "ClefTensorParallelRankLost (exit code 5) and ClefRestarting (the pod's and the server's) to fire",
        )
        wait_until(
            lambda: not among(prometheus.firing(), "ClefTensorParallelRankLost"),
            "ClefTensorParallelRankLost to resolve once the restarted container stays up",
        )
        assert time.monotonic() - restarted > 15 * 60 / TIME_SCALE - 1, "resolved before its window passed"
        assert prometheus.query("kube_pod_container_status_last_terminated_exitcode == 5"), "resolved by the window"
        assert httpx.post(life.url + "/v1/systemone", json=DECISION, timeout=60).status_code == 200
        fired = {a["alertname"] for a in prometheus.fired()}
        assert POD_ALERTS <= fired and not {"ClefSelfCheckFailed", "ClefShadowMismatch", "ClefQueueNearFull"} & fired
    finally:
        if life is not None:
            for rank in life.workers():
                rank.kill()
            life.kill()
        if prometheus is not None:
            prometheus.stop()
        kube.stop()
    assert prometheus.process.poll() is not None and life.process.poll() is not None


@pytest.mark.parametrize("name", ["promtool", "prometheus"])
def test_a_missing_tool_is_named(monkeypatch, name):
    monkeypatch.setattr(shutil, "which", lambda _: None)
    monkeypatch.setattr(Path, "exists", lambda self: False)
    with pytest.raises(RuntimeError, match=f"{name} is not installed .*apt-get install prometheus"):
        tool(name)


if __name__ == "__main__":
    PROMETHEUS_RULE.write_text(operator_copy())
    print(f"wrote {PROMETHEUS_RULE.relative_to(ROOT)} from {RULES.relative_to(ROOT)}")
