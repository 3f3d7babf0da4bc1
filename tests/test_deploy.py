"""What can be checked of the image and the Kubernetes manifests without a Docker engine or a cluster:
stages, the arch argument, the entrypoint and every path the Dockerfile copies; selectors, labels, ports,
probe paths and arguments against the app itself."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib
import yaml

from app.cli import build_parser
from app.metrics import Metrics
from app.server import ServerSettings, create_app

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"


def dockerfile() -> list[str]:
    """Instructions with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_dockerfile_is_a_two_stage_cuda12_build_for_sm70():
    lines = dockerfile()
    stages = [re.match(r"FROM (\S+) AS (\S+)", line) for line in lines if line.startswith("FROM")]
    assert [m.group(2) for m in stages] == ["build", "runtime"]
    assert "-devel-" in stages[0].group(1) and "-runtime-" in stages[1].group(1)
    args = dict(re.match(r"ARG (\w+)=?(.*)", line).groups() for line in lines if line.startswith("ARG"))
    assert args["TORCH_CUDA_ARCH_LIST"] == "7.0"
    assert args["CUDA_VERSION"].startswith("12.")  # the last toolkit line that targets sm_70
    assert "cu12" in args["TORCH_INDEX_URL"]
    build = lines[: next(i for i, line in enumerate(lines) if line.startswith("FROM") and "AS runtime" in line)]
    assert any(
        "CLEF_CUDA_BUILD=cuda" in line and 'TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}"' in line for line in build
    )


def test_runtime_stage_is_slim_non_root_with_entrypoint_and_healthcheck():
    lines = dockerfile()
    runtime = lines[next(i for i, line in enumerate(lines) if "AS runtime" in line) :]
    assert any(line.startswith("USER 10001") for line in runtime)
    assert 'ENTRYPOINT ["clef-serve"]' in runtime
    health = next(line for line in runtime if line.startswith("HEALTHCHECK"))
    assert "/health" in health and "8080" in health
    assert not any("build-essential" in line or "-dev" in line for line in runtime if line.startswith("RUN"))
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["clef-serve"] == "app.cli:main"
    cmd = next(line for line in runtime if line.startswith("CMD"))
    build_parser().parse_args(yaml.safe_load(cmd[len("CMD") :]))  # the default arguments parse


def test_every_path_the_dockerfile_copies_exists():
    for line in dockerfile():
        if line.startswith("COPY") and "--from" not in line:
            sources = line.split()[1:-1]
            for source in sources:
                assert (ROOT / source).exists(), source


def manifests() -> dict[str, dict]:
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[doc["kind"]] = doc
    return docs


def test_deployment_replaces_the_seed_in_place():
    seed = (
        yaml.safe_load((ROOT.parent / "shared" / "seed" / "clef-candle-deployment.yaml").read_text())
        if (ROOT.parent / "shared" / "seed" / "clef-candle-deployment.yaml").exists()
        else None
    )
    deployment = manifests()["Deployment"]
    spec, pod = deployment["spec"], deployment["spec"]["template"]["spec"]
    assert deployment["metadata"]["namespace"] == "llm-serving"
    assert spec["strategy"]["type"] == "Recreate" and spec["replicas"] == 1
    assert pod["runtimeClassName"] == "nvidia"
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert spec["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    mount = next(m for m in container["volumeMounts"] if m["name"] == "models")
    assert mount["readOnly"] is True and mount["mountPath"] == "/mnt/models"
    assert (
        next(v for v in pod["volumes"] if v["name"] == "models")["persistentVolumeClaim"]["claimName"] == "llm-models"
    )
    args = build_parser().parse_args(container["args"])  # every flag is one clef-serve knows
    if seed is not None:  # the seed's arguments are all there, unchanged
        seed_args = seed["spec"]["template"]["spec"]["containers"][0]["args"]
        assert container["args"][: len(seed_args)] == seed_args
        assert deployment["metadata"]["name"] == seed["metadata"]["name"]
        assert spec["selector"] == seed["spec"]["selector"]
    assert pod["terminationGracePeriodSeconds"] > args.drain_timeout


def test_probes_ports_and_service_match_the_app():
    docs = manifests()
    deployment, service = docs["Deployment"], docs["Service"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(container["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == args.port == 8080
    routes = {route.path for route in create_app(ServerSettings()).routes}
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready" in routes
    assert container["livenessProbe"]["httpGet"]["path"] == "/health" in routes
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] in routes
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60  # an 18 GB load from a PVC
    assert service["metadata"]["name"] == "clef-serve" and service["metadata"]["namespace"] == "llm-serving"
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    assert port["port"] == 80 and port["targetPort"] in ("http", 8080)


def test_pdb_and_hpa_target_the_deployment():
    docs = manifests()
    labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = docs["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == docs["Deployment"]["metadata"]["name"]
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    exported = {family.name for family in Metrics().registry.collect()}
    assert metric in exported


@pytest.mark.parametrize("doc", ["docs/operations.md", "README.md"])
def test_documents_name_the_exact_build_and_sizing(doc):
    text = (ROOT / doc).read_text()
    if doc == "README.md":
        assert "TORCH_CUDA_ARCH_LIST=7.0" in text
    else:
        assert "--kv-fraction" in text and "V100" in text and "rollout undo" in text
