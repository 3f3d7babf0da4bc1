"""The Prometheus rules an operator loads (deploy/prometheus/clef-rules.yml, and the same groups as the Operator's
PrometheusRule in deploy/k8s/monitoring/): promtool's own checks and unit tests (every alert firing and not), every
series they read is one clef-serve exports, and a real Prometheus scraping a running clef-serve with the rules loaded
sees the series arrive and the shadow-mismatch alert fire on a fault injected through the tests' launcher.

promtool and prometheus are Debian's `prometheus` package (make test's set-up installs it, as it does haproxy)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest
import yaml
from live import ClefServe, free_port, wait_until

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


def test_promtool_checks_the_rules_and_the_operators_copy_is_the_same(tmp_path):
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    operator = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert (operator["apiVersion"], operator["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert operator["spec"] == rules(), "deploy/k8s/monitoring/prometheusrule.yaml differs from clef-rules.yml"
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


def test_a_broken_alert_fails_its_unit_test(tmp_path):
    """The unit tests can fail: each of these edits to the rules is caught."""
    text = RULES.read_text()
    broken = {
        "the self-check alert on the wrong value": ("clef_selfcheck_passed == 0", "clef_selfcheck_passed == 1"),
        "the mismatch alert on a misspelt result": ('{result="mismatch"}', '{result="mismatched"}'),
        "the not-ready alert after 30 minutes": ("        for: 20m\n", "        for: 30m\n"),
        "the objective raised": ("expr: vector(5)", "expr: vector(50)"),
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
DECISION = {
    "model": "clef-tiny",
    "state": "12:00 api: ok\n12:01 db: timeout\n12:02 api: error",
    "questions": {"db": {"type": "noul", "instructions": "Did the database fail?"}},
}


class Prometheus:
    """prometheus on 127.0.0.1 scraping `target` every second with the rules loaded (evaluated every second)."""

    def __init__(self, target: str, work: Path) -> None:
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "clef", "static_configs": [{"targets": [target]}]}],
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

    def firing(self) -> set[str]:
        return {a["labels"]["alertname"] for a in self.get("/api/v1/alerts")["alerts"] if a["state"] == "firing"}

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


def test_a_real_prometheus_sees_the_series_and_the_mismatch_alert_fire():
    """clef-serve (the embedded model, every answered record shadow-checked) scraped by prometheus with the rules
    loaded, the seed's fault injected through the tests' launcher (the conv's key band zeroed, served anyway under
    --selfcheck warn): decisions arrive as series and recording rules, the shadow's re-decisions on the reference ops
    differ, and ClefShadowMismatch and ClefSelfCheckFailed fire, ClefKernelFault and ClefNotReady do not. Bounded:
    every wait is a hang guard, both processes are stopped whatever happens."""
    with tempfile.TemporaryDirectory(prefix="clef-prometheus-") as tmp:
        server = ClefServe(
            "--d", "cpu", "--autotune", "off", "--selfcheck", "warn", "--shadow-rate", "1", "--shadow-mode", "warn",
            faults={"CLEF_TEST_FAULT": "key_band"},
        )  # fmt: skip
        prometheus = None
        try:
            server.assert_ready()
            prometheus = Prometheus(f"127.0.0.1:{server.port}", Path(tmp))
            wait_until(prometheus.ready, "prometheus to start")
            for _ in range(3):
                assert httpx.post(server.url + "/v1/systemone", json=DECISION, timeout=60).status_code == 200
            wait_until(
                lambda: (
                    prometheus.query('clef_requests_total{status="200"} >= 3')
                    and prometheus.query("clef:requests:rate5m")
                    and prometheus.query("clef_queue_limit == 256")
                ),
                "the decisions' series and a recording rule in prometheus",
            )
            wait_until(
                lambda: {"ClefShadowMismatch", "ClefSelfCheckFailed"} <= prometheus.firing(),
                "ClefShadowMismatch and ClefSelfCheckFailed to fire",
            )
            assert not {"ClefKernelFault", "ClefNotReady", "ClefTensorParallelRankLost"} & prometheus.firing()
            (mismatch,) = prometheus.query('clef_shadow_checks_total{result="mismatch"} > 0')
            assert mismatch["metric"]["job"] == "clef"
            assert httpx.get(server.url + "/ready", timeout=5).json()["shadow"]["mismatch"] >= 1
        finally:
            if prometheus is not None:
                prometheus.stop()
            server.kill()
        assert prometheus.process.poll() is not None and server.process.poll() is not None


@pytest.mark.parametrize("name", ["promtool", "prometheus"])
def test_a_missing_tool_is_named(monkeypatch, name):
    monkeypatch.setattr(shutil, "which", lambda _: None)
    monkeypatch.setattr(Path, "exists", lambda self: False)
    with pytest.raises(RuntimeError, match=f"{name} is not installed .*apt-get install prometheus"):
        tool(name)
