"""What can be checked of the image and the Kubernetes manifests without a Docker engine or a cluster:
stages, the arch argument, the entrypoint and every path the Dockerfile copies; selectors, labels, ports,
probe paths and arguments against the app itself."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import tomllib
import yaml

from app.cli.flags import build_parser
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


def test_the_two_gpu_variant_differs_from_the_deployment_only_in_its_cards():
    """deploy/k8s/tensor-parallel-2: the same object (name, labels, probes) with --tensor-parallel-size 2, two
    GPUs a pod, a memory-backed /dev/shm for NCCL; every flag one clef-serve knows."""
    one = manifests()["Deployment"]
    (two,) = documents(K8S / "tensor-parallel-2" / "deployment.yaml")
    assert (two["metadata"], two["spec"]["selector"]) == (one["metadata"], one["spec"]["selector"])
    pod_one, pod_two = one["spec"]["template"]["spec"], two["spec"]["template"]["spec"]
    c_one, c_two = pod_one["containers"][0], pod_two["containers"][0]
    args = build_parser().parse_args(c_two["args"])
    assert args.tensor_parallel_size == 2 and args.dtype == "f16" and args.tensor_parallel_timeout == 60
    assert c_two["resources"]["limits"]["nvidia.com/gpu"] == c_two["resources"]["requests"]["nvidia.com/gpu"] == "2"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c_two[probe] == c_one[probe]
    mounts = {m["name"]: m["mountPath"] for m in c_two["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_two["volumes"]}
    assert mounts["shm"] == "/dev/shm" and volumes["shm"]["emptyDir"]["medium"] == "Memory"
    dropped = {"--tensor-parallel-size", "2", "--tensor-parallel-timeout", "60s"}
    assert [a for a in c_two["args"] if a not in dropped] == [a for a in c_one["args"] if a not in dropped]


def test_pdb_and_hpa_target_the_deployment():
    docs = manifests()
    labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = docs["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == docs["Deployment"]["metadata"]["name"]
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    exported = {family.name for family in Metrics().registry.collect()}
    assert metric in exported


@pytest.mark.parametrize("doc", ["docs/operations.md", "docs/development.md"])
def test_documents_name_the_exact_build_and_sizing(doc):
    text = (ROOT / doc).read_text()
    if doc == "docs/development.md":
        assert "TORCH_CUDA_ARCH_LIST=7.0" in text
    else:
        assert "--kv-fraction" in text and "V100" in text and "rollout undo" in text


# Scale-out (deploy/k8s/routing/, docs/operations.md "Scale-out: replicas behind inference routing"): every
# tier's manifests, offline. Each check is a function returning its problems, run on the shipped files and
# on a copy with one injected fault, which it must catch.

ROUTING = K8S / "routing"
INFERENCEPOOL_CRD = K8S / "schemas" / "inference.networking.k8s.io_inferencepools.yaml"
PREFIX_HEADER = "x-clef-prefix-key"
# GIE v1.6.0 supports the three most recent Kubernetes minors (1.35 to 1.37 in August 2026): the ends of that range.
KUBERNETES_VERSIONS = ("1.35.0", "1.37.0")
# Files that are not Kubernetes objects: the chart's values and the EPP's own configuration.
NOT_OBJECTS = {"tier-b-llm-d-router-values.yaml", "tier-b-epp-config.yaml"}
# Kinds from CRDs, which kubernetes-validate has no schema for: the InferencePool is checked against the
# vendored CRD below; the others were checked by hand against their upstream CRDs (Gateway API as bundled by
# Envoy Gateway v1.9.0, its BackendTrafficPolicy, Istio 1.30.3), over 1 MB together, so not vendored.
CUSTOM_KINDS = {
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    ("gateway.envoyproxy.io/v1alpha1", "BackendTrafficPolicy"),
    ("networking.istio.io/v1", "DestinationRule"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),  # its groups: tests/test_prometheus_rules.py
}
# What clef-serve exports (GET /metrics) under its own names: the only names our engineConfig may use.
CLEF_METRICS = {
    "clef_queue_depth",
    "clef_running_sequences",
    "clef_cache_usage_ratio",
    "clef_cache_config_info",
    "clef_lora_requests_info",
    "clef_prefix_cache_queries_total",
    "clef_prefix_cache_hits_total",
}
ENGINE_SPECS = {
    "queuedRequestsSpec": "clef_queue_depth",
    "runningRequestsSpec": "clef_running_sequences",
    "kvUsageSpec": "clef_cache_usage_ratio",
    "cacheInfoSpec": "clef_cache_config_info",
    "loraSpec": "clef_lora_requests_info",
}
# The llm-d Router's PromQL-selector form of a metric spec (its metricSpecRE and metric-name rule).
METRIC_SPEC = re.compile(r"^\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{([^}]*)\})?\s*$")


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def manifest_files() -> list[Path]:
    return sorted(K8S.rglob("*.yaml"))


def kubernetes_objects() -> Iterator[tuple[Path, dict]]:
    for path in manifest_files():
        if path.name not in NOT_OBJECTS:
            for doc in documents(path):
                yield path, doc


def routing_object(kind: str) -> dict:
    (found,) = [doc for path in sorted(ROUTING.glob("*.yaml")) for doc in documents(path) if doc.get("kind") == kind]
    return found


def routing_objects(kind: str) -> dict[str, dict]:
    return {
        doc["metadata"]["name"]: doc
        for path in sorted(ROUTING.glob("*.yaml"))
        if path.name not in NOT_OBJECTS
        for doc in documents(path)
        if doc["kind"] == kind
    }


def epp_config() -> dict:
    (config,) = documents(ROUTING / "tier-b-epp-config.yaml")
    return config


def router_values() -> dict:
    (values,) = documents(ROUTING / "tier-b-llm-d-router-values.yaml")
    return values


def pod_labels() -> dict[str, str]:
    return manifests()["Deployment"]["spec"]["template"]["metadata"]["labels"]


def test_every_manifest_file_parses_and_names_its_object():
    files = manifest_files()
    assert {path.name for path in files} >= {"tier-b-inferencepool.yaml", "tier-b-httproute.yaml", *NOT_OBJECTS}
    for path in files:
        docs = documents(path)
        assert docs and all(isinstance(doc, dict) for doc in docs), path
    for path, doc in kubernetes_objects():
        assert {"apiVersion", "kind", "metadata"} <= doc.keys() and doc["metadata"]["name"], path
        if doc["kind"] != "CustomResourceDefinition":  # the one cluster-scoped object
            assert doc["metadata"]["namespace"] == "llm-serving", path


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_built_in_kinds_validate_strictly(version):
    validated = set()
    for path, doc in kubernetes_objects():
        if (doc["apiVersion"], doc["kind"]) not in CUSTOM_KINDS:
            # Strict: an unknown (misspelt) field fails too. A kind without a schema raises as well, so a
            # new CRD kind must be added to CUSTOM_KINDS on purpose.
            kubernetes_validate.validate(doc, version, strict=True)
            validated.add((path.name, doc["kind"]))
    assert {("deployment.yaml", "Deployment"), ("tier-a-pods-service.yaml", "Service")} <= validated
    service = copy.deepcopy(routing_object("Service"))
    service["spec"]["ports"][0]["port"] = "eighty"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, version, strict=True)
    deployment = copy.deepcopy(manifests()["Deployment"])
    deployment["spec"]["template"]["metadata"]["lables"] = deployment["spec"]["template"]["metadata"].pop("labels")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, version, strict=True)


def cel_rules(node) -> Iterator[str]:
    if isinstance(node, dict):
        for rule in node.get("x-kubernetes-validations", []):
            yield rule["rule"]
        for value in node.values():
            yield from cel_rules(value)
    elif isinstance(node, list):
        for value in node:
            yield from cel_rules(value)


def inference_pool_problems(pool: dict) -> list[str]:
    """The vendored CRD's openAPIV3Schema (jsonschema), plus its two CEL rules, which jsonschema ignores."""
    crd = documents(INFERENCEPOOL_CRD)[0]
    group, version = pool["apiVersion"].split("/")
    if group != crd["spec"]["group"] or pool["kind"] != crd["spec"]["names"]["kind"]:
        return [f"not an InferencePool: {pool['apiVersion']} {pool['kind']}"]
    (schema,) = [v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == version]
    problems = [
        f"{'.'.join(map(str, error.path))}: {error.message}"
        for error in jsonschema.Draft7Validator(schema).iter_errors(pool)
    ]
    spec = pool.get("spec", {})
    numbers = [port.get("number") for port in spec.get("targetPorts", [])]
    if len(numbers) != len(set(numbers)):
        problems.append(f"spec.targetPorts: port number must be unique: {numbers}")
    picker = spec.get("endpointPickerRef")
    if picker is not None and picker.get("kind", "Service") == "Service" and "port" not in picker:
        problems.append("spec.endpointPickerRef: port is required when kind is 'Service'")
    return problems


def test_vendored_inferencepool_crd_names_its_source_and_its_cel_rules_are_the_ones_checked():
    header = INFERENCEPOOL_CRD.read_text().split("apiVersion:", 1)[0]
    assert "kubernetes-sigs/gateway-api-inference-extension@" in header
    assert re.search(r"@[0-9a-f]{40}\b", header)
    crd = documents(INFERENCEPOOL_CRD)[0]
    assert crd["metadata"]["name"] == "inferencepools.inference.networking.k8s.io"
    # If the CRD gains a rule, inference_pool_problems must learn it too.
    assert set(cel_rules(crd)) == {
        "self.kind != 'Service' || has(self.port)",
        "self.all(p1, self.exists_one(p2, p1.number==p2.number))",
    }
    shared = ROOT.parent / "shared" / "k8s-schemas" / INFERENCEPOOL_CRD.name
    if shared.exists():  # a checkout beside the shared folder: the copy is still the same file
        assert documents(shared) == documents(INFERENCEPOOL_CRD)


def test_inference_pool_validates_against_the_vendored_crd():
    pool = routing_object("InferencePool")
    assert inference_pool_problems(pool) == []
    spec = pool["spec"]
    assert spec["targetPorts"] == [{"number": 8080}]
    assert spec["endpointPickerRef"]["failureMode"] == "FailOpen"
    # The CEL rule is what catches a duplicated port; jsonschema alone accepts it.
    duplicated = copy.deepcopy(pool)
    duplicated["spec"]["targetPorts"].append({"number": 8080})
    crd = documents(INFERENCEPOOL_CRD)[0]
    assert jsonschema.Draft7Validator(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]).is_valid(duplicated)
    assert any("unique" in problem for problem in inference_pool_problems(duplicated))


def _set(path: str, value):
    def mutate(pool: dict) -> None:
        *parents, leaf = path.split(".")
        node = pool
        for key in parents:
            node = node[key]
        if value is None:
            del node[leaf]
        else:
            node[leaf] = value

    return mutate


@pytest.mark.parametrize(
    "fault",
    [
        _set("spec.targetPorts", [{"number": 8080}, {"number": 8080}]),
        _set("spec.targetPorts", [{"number": 70000}]),
        _set("spec.targetPorts", [{"number": 8080 + i} for i in range(9)]),
        _set("spec.targetPorts", []),
        _set("spec.endpointPickerRef.failureMode", "FailOpn"),
        _set("spec.endpointPickerRef.port", None),
        _set("spec.appProtocol", "grpc"),
        _set("spec.selector", None),
        _set("spec.selector.matchLabels", {}),
    ],
    ids=[
        "duplicated-port",
        "port-out-of-range",
        "nine-ports",
        "no-ports",
        "failure-mode",
        "picker-without-port",
        "app-protocol",
        "no-selector",
        "empty-selector",
    ],
)
def test_inference_pool_check_rejects_an_injected_fault(fault):
    pool = copy.deepcopy(routing_object("InferencePool"))
    fault(pool)
    assert inference_pool_problems(pool)


def route_problems(route: dict, pool: dict | None, service: dict) -> list[str]:
    """Decisions to the pool (or, without one, to the Service); everything else to the Service's port."""
    problems = []
    namespaces = {route["metadata"]["namespace"], service["metadata"]["namespace"]}
    if pool is not None:
        namespaces.add(pool["metadata"]["namespace"])
    if len(namespaces) != 1:
        problems.append(f"route, pool and Service in different namespaces: {namespaces}")

    def rule_for(prefix: str) -> dict | None:
        for rule in route["spec"]["rules"]:
            for match in rule.get("matches", [{"path": {"type": "PathPrefix", "value": "/"}}]):
                if match.get("path", {}).get("value") == prefix and not match.keys() - {"path"}:
                    return rule
        return None

    service_ports = {port["port"] for port in service["spec"]["ports"]}

    def to_service(rule: dict | None) -> bool:
        refs = (rule or {}).get("backendRefs", [])
        return len(refs) == 1 and (
            refs[0].get("group", "") == ""
            and refs[0].get("kind", "Service") == "Service"
            and refs[0]["name"] == service["metadata"]["name"]
            and refs[0].get("port") in service_ports
        )

    if not to_service(rule_for("/")):
        problems.append(f"the catch-all rule does not send to Service {service['metadata']['name']}:{service_ports}")
    if pool is not None:
        refs = (rule_for("/v1/systemone") or {}).get("backendRefs", [])
        expected = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}
        if [{key: ref.get(key) for key in expected} for ref in refs] != [expected]:
            problems.append(f"/v1/systemone does not go to InferencePool {pool['metadata']['name']}: {refs}")
    return problems


def test_httproutes_send_decisions_to_the_pool_and_the_rest_to_the_service():
    routes, service = routing_objects("HTTPRoute"), manifests()["Service"]
    pool = routing_object("InferencePool")
    assert route_problems(routes["clef-serve-inference"], pool, service) == []
    assert route_problems(routes["clef-serve-hash"], None, service) == []
    wrong_pool = copy.deepcopy(routes["clef-serve-inference"])
    wrong_pool["spec"]["rules"][0]["backendRefs"][0]["name"] = "clef-pool"
    assert route_problems(wrong_pool, pool, service)
    target_port = copy.deepcopy(routes["clef-serve-inference"])
    target_port["spec"]["rules"][1]["backendRefs"][0]["port"] = 8080  # the pod's port, not the Service's
    assert route_problems(target_port, pool, service)


def test_tier_a_policies_hash_on_the_prefix_header_of_the_service():
    service = manifests()["Service"]
    (policy,) = routing_objects("BackendTrafficPolicy").values()
    (target,) = policy["spec"]["targetRefs"]
    assert (target["kind"], target["name"]) == ("HTTPRoute", "clef-serve-hash")
    assert target["name"] in routing_objects("HTTPRoute")
    hashing = policy["spec"]["loadBalancer"]
    assert hashing["type"] == "ConsistentHash" and hashing["consistentHash"]["type"] == "Headers"
    assert hashing["consistentHash"]["headers"] == [{"name": PREFIX_HEADER}]
    (rule,) = routing_objects("DestinationRule").values()
    namespace = service["metadata"]["namespace"]
    assert rule["spec"]["host"] == f"{service['metadata']['name']}.{namespace}.svc.cluster.local"
    assert rule["spec"]["trafficPolicy"]["loadBalancer"]["consistentHash"]["httpHeaderName"] == PREFIX_HEADER


def label_selectors(node) -> Iterator[dict]:
    """Every label selector in a document: matchLabels anywhere (pools, chart values), a Service's selector."""
    if isinstance(node, dict):
        if (node.get("apiVersion"), node.get("kind")) == ("v1", "Service"):
            yield node["spec"]["selector"]
        for key, value in node.items():
            if key == "matchLabels":
                yield value
            else:
                yield from label_selectors(value)
    elif isinstance(node, list):
        for value in node:
            yield from label_selectors(value)


def selector_problems(docs: list[dict], labels: dict[str, str]) -> list[str]:
    return [
        f"selector {selector} does not select pods labelled {labels}"
        for doc in docs
        for selector in label_selectors(doc)
        if not selector or not selector.items() <= labels.items()
    ]


def test_every_routing_selector_selects_the_deployments_pods():
    labels = pod_labels()
    docs = [doc for path in sorted(ROUTING.glob("*.yaml")) for doc in documents(path)]
    assert len([selector for doc in docs for selector in label_selectors(doc)]) >= 3  # pool, pods Service, values
    assert selector_problems(docs, labels) == []
    pool = copy.deepcopy(routing_object("InferencePool"))
    pool["spec"]["selector"]["matchLabels"]["app"] = "clef-candel"
    assert selector_problems([pool], labels)
    # The label was added to the pod template only: the selector (immutable on a live Deployment) is the seed's.
    assert manifests()["Deployment"]["spec"]["selector"] == {"matchLabels": {"app": "clef-candle"}}


def plugin(config: dict, plugin_type: str) -> dict:
    (found,) = [p for p in config["plugins"] if p["type"] == plugin_type]
    return found


def engine_metric_names(engine: dict) -> list[str]:
    """Every metric an engineConfig reads: its *Spec entries and its customMetrics' metricSpec."""
    specs = [value for key, value in engine.items() if key.endswith("Spec") and value]
    specs += [custom["metricSpec"] for custom in engine.get("customMetrics", [])]
    names = []
    for spec in specs:
        match = METRIC_SPEC.match(spec)
        names.append(match.group(1) if match else spec)
    return names


def test_engine_config_reads_only_metrics_clef_serve_exports():
    extractor = plugin(epp_config(), "core-metrics-extractor")["parameters"]
    (engine,) = extractor["engineConfigs"]
    assert engine["name"] == pod_labels()[extractor["engineLabelKey"]] == "clef-serve"
    assert extractor["engineLabelKey"] == "llm-d.ai/engine-type"
    assert set(engine_metric_names(engine)) <= CLEF_METRICS
    assert {key: value for key, value in engine.items() if key.endswith("Spec")} == ENGINE_SPECS
    # The HPA scales on the gauge the EPP's queue scorer reads: one signal for both.
    hpa = manifests()["HorizontalPodAutoscaler"]
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == engine["queuedRequestsSpec"]
    misspelt = dict(engine, kvUsageSpec="clef_cache_usage_ration")
    assert not set(engine_metric_names(misspelt)) <= CLEF_METRICS
    alias = dict(engine, queuedRequestsSpec="vllm:num_requests_waiting")  # the default engine's, not ours
    assert not set(engine_metric_names(alias)) <= CLEF_METRICS
    labelled = dict(engine, customMetrics=[{"attributeKey": "clef.hits", "metricSpec": "clef_prefix_hits{a=b}"}])
    assert engine_metric_names(labelled)[-1] == "clef_prefix_hits"
    assert not set(engine_metric_names(labelled)) <= CLEF_METRICS


def epp_config_problems(config: dict) -> list[str]:
    """References between the config's parts resolve, and the parts are the ones the design names."""
    problems = []
    names = [p.get("name") or p["type"] for p in config["plugins"]]
    types = {p.get("name") or p["type"]: p["type"] for p in config["plugins"]}
    if len(names) != len(set(names)):
        problems.append(f"plugin names repeat: {names}")
    refs = [parser["pluginRef"] for parser in config["requestHandler"]["parsers"]]
    for source in config["dataLayer"]["sources"]:
        refs += [source["pluginRef"], *(extractor["pluginRef"] for extractor in source["extractors"])]
    for profile in config["schedulingProfiles"]:
        refs += [entry["pluginRef"] for entry in profile["plugins"]]
    problems += [f"pluginRef {ref} names no plugin" for ref in refs if ref not in types]
    if [types.get(parser["pluginRef"]) for parser in config["requestHandler"]["parsers"]] != ["passthrough-parser"]:
        problems.append("the only parser must be passthrough-parser (System One bodies are not OpenAI-shaped)")
    (profile,) = config["schedulingProfiles"]
    weights = {types.get(entry["pluginRef"]): entry.get("weight") for entry in profile["plugins"]}
    wanted = {"queue-scorer", "kv-cache-utilization-scorer", "active-request-scorer", "session-affinity-scorer"}
    if not wanted <= weights.keys():
        problems.append(f"the profile lacks scorers: {wanted - weights.keys()}")
    else:
        load = [weights[scorer] for scorer in wanted - {"session-affinity-scorer"}]
        # Bounded affinity: stronger than any one load signal, weaker than all of them together.
        if not max(load) < weights["session-affinity-scorer"] < sum(load):
            problems.append(f"session affinity weight is not bounded by the load weights: {weights}")
    return problems


def test_epp_config_is_passthrough_with_load_scorers_and_header_affinity():
    config = epp_config()
    assert (config["apiVersion"], config["kind"]) == ("llm-d.ai/v1alpha1", "EndpointPickerConfig")
    assert epp_config_problems(config) == []
    affinity = plugin(config, "session-affinity-scorer")["parameters"]
    assert affinity["strategy"] == "session_id"
    assert affinity["sessionIdConfig"]["sources"] == [{"header": PREFIX_HEADER}]
    assert plugin(config, "metrics-data-source")["parameters"]["path"] == "/metrics"
    dangling = copy.deepcopy(config)
    dangling["schedulingProfiles"][0]["plugins"][0]["pluginRef"] = "queue-scorrer"
    assert epp_config_problems(dangling)
    unbounded = copy.deepcopy(config)
    for entry in unbounded["schedulingProfiles"][0]["plugins"]:
        if entry["pluginRef"] == "session-affinity-scorer":
            entry["weight"] = 10
    assert epp_config_problems(unbounded)
    openai = copy.deepcopy(config)
    openai["plugins"].append({"type": "openai-parser"})
    openai["requestHandler"]["parsers"].insert(0, {"pluginRef": "openai-parser"})
    assert epp_config_problems(openai)


def values_problems(values: dict, pool: dict) -> list[str]:
    """What the chart (llm-d-router-gateway v0.10.0, release = pool name) renders must be our pool."""
    router, spec = values["router"], pool["spec"]
    problems = []
    if router["modelServers"]["matchLabels"] != spec["selector"]["matchLabels"]:
        problems.append("chart matchLabels differ from the pool's selector")
    if router["modelServers"]["targetPorts"] != spec["targetPorts"]:
        problems.append("chart targetPorts differ from the pool's")
    if router["modelServers"].get("protocol", "http") != spec.get("appProtocol", "http"):
        problems.append("chart protocol differs from the pool's appProtocol")
    if router["inferencePool"] != {"create": True, "failureMode": spec["endpointPickerRef"]["failureMode"]}:
        problems.append(f"chart inferencePool {router['inferencePool']} is not ours")
    # The chart names its EPP Service <release[:40]>-epp and serves ext_proc on extProcPort (9002 by default).
    picker = spec["endpointPickerRef"]
    if picker["name"] != pool["metadata"]["name"][:40] + "-epp":
        problems.append(f"the pool's picker {picker['name']} is not the chart's EPP Service")
    if picker["port"]["number"] != router["epp"].get("extProcPort", 9002):
        problems.append("the pool's picker port is not the EPP's ext_proc port")
    if router["epp"]["flags"].get("allow-experimental-plugins") is not True:
        problems.append("session-affinity-scorer is Alpha: the EPP needs --allow-experimental-plugins")
    return problems


def test_chart_values_render_our_pool_and_load_our_epp_config():
    values, pool = router_values(), routing_object("InferencePool")
    assert values_problems(values, pool) == []
    renamed = copy.deepcopy(pool)
    renamed["metadata"]["name"] = "clef-pool"
    assert values_problems(values, renamed)
    reselected = copy.deepcopy(values)
    reselected["router"]["modelServers"]["matchLabels"] = {"app": "clef-serve"}
    assert values_problems(reselected, pool)
    # The install command in the docs puts tier-b-epp-config.yaml under the key the values select.
    key = values["router"]["epp"]["pluginsConfigFile"]
    escaped = key.replace(".", "\\.")  # a dot inside a --set key is escaped
    set_file = f"router.epp.pluginsCustomConfig.{escaped}=deploy/k8s/routing/tier-b-epp-config.yaml"
    operations = (ROOT / "docs" / "operations.md").read_text()
    assert set_file in operations
    tag = values["router"]["epp"]["image"]["tag"]
    assert f"oci://ghcr.io/llm-d/charts/llm-d-router-gateway --version {tag}" in operations


def proxy_server_addresses(text: str) -> list[str]:
    return re.findall(r"^\s*server(?:-template \S+ \d+)? (\S+:\d+)", text, flags=re.M)


def test_plain_proxies_hash_the_prefix_header_across_the_pods():
    pods = routing_objects("Service")["clef-serve-pods"]
    (port,) = pods["spec"]["ports"]
    container = manifests()["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert port["port"] == {p["name"]: p["containerPort"] for p in container["ports"]}[port["targetPort"]]
    address = f"{pods['metadata']['name']}.{pods['metadata']['namespace']}.svc.cluster.local:{port['port']}"
    haproxy = (ROUTING / "tier-a-haproxy.cfg").read_text()
    assert f"balance hdr({PREFIX_HEADER})" in haproxy and re.search(r"^\s*hash-type consistent\b", haproxy, re.M)
    assert 100 < int(re.search(r"^\s*hash-balance-factor (\d+)", haproxy, re.M).group(1)) <= 200
    assert proxy_server_addresses(haproxy) == [address]
    nginx = (ROUTING / "tier-a-nginx.conf").read_text()
    assert re.search(r"map \$http_x_clef_prefix_key \$clef_route_key \{[^}]*default\s+\$http_x_clef_prefix_key;", nginx)
    assert re.search(r"^\s*hash \$clef_route_key consistent;", nginx, re.M)
    assert proxy_server_addresses(nginx) == [address]


HAPROXY = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")


@pytest.mark.skipif(HAPROXY is None, reason="no haproxy binary")
def test_haproxy_accepts_the_config_and_rejects_a_broken_copy(tmp_path):
    config = ROUTING / "tier-a-haproxy.cfg"
    checked = subprocess.run([HAPROXY, "-c", "-f", str(config)], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    broken = tmp_path / "broken.cfg"
    broken.write_text(config.read_text().replace("hash-balance-factor", "hash-balance-factr"))
    assert subprocess.run([HAPROXY, "-c", "-f", str(broken)], capture_output=True, timeout=30).returncode != 0


def test_operations_documents_the_scale_out_tiers_and_their_versions():
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("## Scale-out: replicas behind inference routing", 1)[1].split("\n## ", 1)[0]
    for pinned in ("v1.6.0", "v0.10.0", "v1.9.0", "1.30.3"):  # GIE, llm-d Router, Envoy Gateway, Istio
        assert pinned in section
    for name in (PREFIX_HEADER, "X-Clef-Prefix-Cache: hit", "passthrough", "payload-agnostic", "ingress-nginx"):
        assert name in section
    for path in sorted(ROUTING.iterdir()):
        assert path.name in section, path.name
