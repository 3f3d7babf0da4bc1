"""Scale-out (shared/specs/scale-out.md): the prefix key's pinned values, its headers on every 200, the
protocol metrics inference routers read (families, types, labels, ranges under load, vLLM aliases), and
two replicas behind a real HAProxy: the same key reaches the same replica and hits its cache."""

from __future__ import annotations

import hashlib
import threading

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from releases import tiny_release

from app.server import ServerSettings, create_app
from clef_cuda import Decider
from clef_cuda.request.routing import canonical_state, prefix_key
from clef_cuda.serving.engine import Engine, EngineConfig

STATE = " ".join(f"line {i}: checkout ERROR payment declined" for i in range(60))  # long: worth a snapshot


# ---- the key ------------------------------------------------------------------------------------------
PINNED = [  # (model, state, images, key): for clients in other languages to check theirs against
    ("clef-flash", "Checkout fails for everyone.", [], "c1-4a0fec91f1c8cf9ccf3a4f91242412c3"),
    ("clef-flash", {"b": [1, 2.5], "a": "é"}, [b"\x89PNG"], "c1-943dc284e083c4a4b247b484156fb09d"),
    ("jev-latest", ["x", None, True, 1e21, {"z": {}, "y": []}], [], "c1-170ad1769be86540d4a12c1c3eabd8c7"),
    ("m", {"n": float("nan")}, [b"a", b"b"], "c1-ae827808b53d7bb520a80d3c38cf5905"),
]


PINNED_WITH_VIDEOS = [  # (model, state, images, videos, key): the videos' digests follow the images' after 0x00
    ("clef-flash", "Camera 4, 14:02.", [], [b"\x00\x00\x00\x18ftypisom"], "c1-80b277808a7c013f2306ffc2bcb3ec21"),
    (
        "clef-flash",
        {"cam": 4},
        [b"\x89PNG"],
        [b"\x1a\x45\xdf\xa3", b"\x00\x00\x00\x18ftypisom"],
        "c1-db6e149347aa032b3f1add7621a1ae97",
    ),
]


@pytest.mark.parametrize("model, state, images, key", PINNED)
def test_pinned_prefix_keys(model, state, images, key):
    assert prefix_key(model, state, images) == key
    assert prefix_key(model, state, images, []) == key  # no videos: the key of before videos were taken


@pytest.mark.parametrize("model, state, images, videos, key", PINNED_WITH_VIDEOS)
def test_pinned_prefix_keys_with_videos(model, state, images, videos, key):
    assert prefix_key(model, state, images, videos) == key
    image_digests = b"".join(hashlib.sha256(image).digest() for image in images)
    video_digests = b"".join(hashlib.sha256(video).digest() for video in videos)
    by_hand = hashlib.sha256(
        model.encode() + b"\x00" + canonical_state(state) + b"\x00" + image_digests + b"\x00" + video_digests
    )
    assert key == "c1-" + by_hand.hexdigest()[:32]


def test_the_key_is_exactly_the_documented_recipe():
    """Recomputed by hand, bytes spelled out: sha256(model 0x00 JCS(state) 0x00 sha256(image)...)[:32]."""
    canonical = '{"a":"é","b":[1,2.5]}'.encode()
    assert canonical_state({"b": [1, 2.5], "a": "é"}) == canonical
    by_hand = hashlib.sha256(b"clef-flash\x00" + canonical + b"\x00" + hashlib.sha256(b"\x89PNG").digest())
    assert prefix_key("clef-flash", {"b": [1, 2.5], "a": "é"}, [b"\x89PNG"]) == "c1-" + by_hand.hexdigest()[:32]
    assert canonical_state('a"\n\x01\u2028é') == '"a\\"\\n\\u0001\u2028é"'.encode()  # JCS string escapes
    # Keys sort by UTF-16 code units (U+1F600 is D83D DE00, before FFFF), not by code points as Python's do.
    assert canonical_state({"\uffff": 2, "\U0001f600": 1}) == '{"\U0001f600":1,"\uffff":2}'.encode()


def test_the_key_follows_model_state_images_and_videos_only():
    base = prefix_key("clef-flash", {"a": 1, "b": 2})
    assert prefix_key("clef-flash", {"b": 2, "a": 1}) == base  # canonical: key order does not matter
    assert prefix_key("clef-flash", {"a": 1, "b": 3}) != base
    assert prefix_key("jev-latest", {"a": 1, "b": 2}) != base
    assert prefix_key("clef-flash", {"a": 1, "b": 2}, [b"img"]) != base
    with_video = prefix_key("clef-flash", {"a": 1, "b": 2}, [], [b"clip"])
    assert with_video not in (base, prefix_key("clef-flash", {"a": 1, "b": 2}, [b"clip"]))  # a video is no image
    assert prefix_key("clef-flash", {"a": 1, "b": 2}, [], [b"other clip"]) != with_video
    assert prefix_key("clef-flash", {"a": 1, "b": 2}, [], [b"a", b"b"]) != prefix_key(
        "clef-flash", {"a": 1, "b": 2}, [], [b"b", b"a"]
    )


# ---- the server -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def decider():
    return Decider.from_release(tiny_release(), device="cpu", progress=False)


def app(decider, **settings):
    engine = Engine(decider, EngineConfig(max_model_len=4096, kv_fraction=0.02, max_num_seqs=2))
    return create_app(ServerSettings(**settings), engine=engine)


def test_every_200_carries_the_key_and_whether_it_hit(decider):
    body = {"model": "clef-flash", "state": STATE, "questions": {"q": {"type": "noul"}}}
    keys = []
    for _ in range(2):  # two replicas compute the same key
        with TestClient(app(decider)) as client:
            first = client.post("/v1/systemone", json=body)
            second = client.post("/v1/systemone", json=body | {"questions": {"other": {"type": "noul"}}})
            assert first.headers["x-clef-prefix-cache"] == "miss" and second.headers["x-clef-prefix-cache"] == "hit"
            assert first.headers["x-clef-prefix-key"] == second.headers["x-clef-prefix-key"]
            keys.append(first.headers["x-clef-prefix-key"])
            refused = client.post("/v1/systemone", json=body | {"questions": {}})
            assert refused.status_code == 422 and "x-clef-prefix-key" not in refused.headers
    assert keys[0] == keys[1] == prefix_key("clef-flash", STATE)


def test_requests_differing_only_in_a_video_get_different_keys(decider):
    """Videos sit before the state in the prompt: two requests that differ only in a video share no prefix past
    the images, so their keys differ; each is the key prefix_key gives for its video's bytes."""
    import base64

    import clips

    body = {"model": "clef-flash", "state": "Camera 4, 14:02.", "questions": {"q": {"type": "noul"}}}
    first, second = clips.clip("h264", 64, 48, 8, 10, seed=1), clips.clip("h264", 64, 48, 8, 10, seed=2)
    keys = []
    with TestClient(app(decider)) as client:
        for clip in (first, second):
            url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
            response = client.post("/v1/systemone", json=body | {"videos": [url]})
            assert response.status_code == 200, response.text
            keys.append(response.headers["x-clef-prefix-key"])
    assert keys[0] != keys[1]
    assert keys == [prefix_key("clef-flash", body["state"], [], [clip]) for clip in (first, second)]


def scrape(client) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}


def test_protocol_metrics_under_load(decider):
    with TestClient(app(decider)) as client:
        usages, stop = [], threading.Event()

        def watch():
            while not stop.is_set():
                families = scrape(client)
                usages.append(families["clef_cache_usage_ratio"].samples[0].value)

        watcher = threading.Thread(target=watch)
        watcher.start()
        bodies = [
            {"model": "clef-flash", "state": STATE + f" {i % 3}", "questions": {"q": {"type": "noul"}}}
            for i in range(12)
        ]
        threads = [threading.Thread(target=lambda b=b: client.post("/v1/systemone", json=b)) for b in bodies]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        stop.set()
        watcher.join(30)
        families = scrape(client)
    assert usages and all(0 <= u <= 1 for u in usages) and max(usages) > 0  # live sequences were seen
    assert families["clef_cache_usage_ratio"].type == "gauge"
    assert families["clef_queue_depth"].type == families["clef_running_sequences"].type == "gauge"
    (info,) = families["clef_cache_config_info"].samples
    assert info.value == 1 and info.labels["block_size"] == "16" and int(info.labels["num_gpu_blocks"]) > 0
    for name in ("clef_prefix_cache_queries", "clef_prefix_cache_hits", "clef_prefix_cache_misses"):
        assert families[name].type == "counter", name
    queries = {s.name: s.value for s in families["clef_prefix_cache_queries"].samples}[
        "clef_prefix_cache_queries_total"
    ]
    hits = {s.name: s.value for s in families["clef_prefix_cache_hits"].samples}["clef_prefix_cache_hits_total"]
    assert queries >= hits >= 1
    aliases = {
        "vllm:num_requests_waiting": "gauge",
        "vllm:num_requests_running": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:cache_config_info": "gauge",
    }
    for name, kind in aliases.items():
        assert families[name].type == kind, name
    assert families["vllm:cache_config_info"].samples[0].labels == info.labels
    assert "clef_lora_requests_info" not in families or not families["clef_lora_requests_info"].samples
    assert not any(name.startswith("vllm:") and families[name].type == "histogram" for name in families)


def test_vllm_aliases_can_be_dropped(decider):
    with TestClient(app(decider, vllm_metric_aliases=False)) as client:
        assert not [name for name in scrape(client) if name.startswith("vllm:")]


def test_lora_requests_info_has_exactly_one_live_series(decider):
    from adapter_fixtures import checkpoint

    from clef_cuda.model.adapters import AdapterRegistry

    registry = AdapterRegistry(decider.config, decider.trunk.lm_head, decider.trunk.dtype, max_adapters=3)
    registry.load("team", checkpoint("all"))
    engine = Engine(decider, EngineConfig(max_model_len=4096, kv_fraction=0.02, prefill_chunk_size=16), registry)
    with TestClient(create_app(ServerSettings(), engine=engine)) as client:
        idle = scrape(client)["clef_lora_requests_info"].samples
        assert len(idle) == 1 and idle[0].labels == {
            "max_lora": "3",
            "running_lora_adapters": "",
            "waiting_lora_adapters": "",
        }
        seen, stop = set(), threading.Event()

        def watch():
            while not stop.is_set():
                samples = scrape(client)["clef_lora_requests_info"].samples
                assert len(samples) == 1
                seen.add(samples[0].labels["running_lora_adapters"])

        watcher = threading.Thread(target=watch)
        watcher.start()
        body = {"model": "team", "state": STATE, "questions": {"q": {"type": "noul"}}}
        assert client.post("/v1/systemone", json=body).status_code == 200
        stop.set()
        watcher.join(30)
        assert "team" in seen
        (alias,) = scrape(client)["vllm:lora_requests_info"].samples
        assert alias.value > 1.7e9  # a unix time


# ---- two replicas behind HAProxy --------------------------------------------------------------------
def test_the_same_key_reaches_the_same_replica_and_hits():
    from affinity import balancer, replicas, run, workload

    with replicas(2) as urls:
        with balancer(urls, "hash") as url:
            hashed = run(url, "hash", workload(6, 3, seed=1), concurrency=1)
        with balancer(urls, "round-robin") as url:
            spread = run(url, "round-robin", workload(6, 3, seed=2), concurrency=1)
    assert hashed.keys_match and spread.keys_match  # both replicas compute the key the client did
    assert all("," not in replicas_ for replicas_ in hashed.served_by.values())  # one replica per key
    assert hashed.hits == 6 * 2  # every repeat after the first hit its replica's cache
    assert spread.hit_rate < hashed.hit_rate
    assert sum("," in v for v in spread.served_by.values()) == 6  # round-robin spreads every state


def test_every_selector_of_the_shipped_engine_config_resolves_against_a_real_scrape(decider):
    """deploy/k8s/routing/tier-b-epp-config.yaml's clef-serve engineConfig, and the vLLM names an EPP uses
    for an unlabelled pod, against /metrics of a live app with a variant loaded."""
    from pathlib import Path

    import yaml
    from adapter_fixtures import checkpoint

    from clef_cuda.model.adapters import AdapterRegistry

    config = yaml.safe_load(
        (Path(__file__).resolve().parents[1] / "deploy/k8s/routing/tier-b-epp-config.yaml").read_text()
    )
    (extractor,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    (ours,) = [e for e in extractor["parameters"]["engineConfigs"] if e["name"] == "clef-serve"]
    specs = {key: value for key, value in ours.items() if key.endswith("Spec")}
    vllm = {
        "queuedRequestsSpec": "vllm:num_requests_waiting",
        "runningRequestsSpec": "vllm:num_requests_running",
        "kvUsageSpec": "vllm:kv_cache_usage_perc",
        "cacheInfoSpec": "vllm:cache_config_info",
        "loraSpec": "vllm:lora_requests_info",
    }
    assert set(specs) == set(vllm)  # every protocol metric is mapped
    registry = AdapterRegistry(decider.config, decider.trunk.lm_head, decider.trunk.dtype)
    registry.load("team", checkpoint("all"))
    engine = Engine(decider, EngineConfig(max_model_len=4096, kv_fraction=0.02), registry)
    with TestClient(create_app(ServerSettings(), engine=engine)) as client:
        families = scrape(client)
    for kind, names in (("ours", specs), ("vllm", vllm)):
        for spec, name in names.items():
            assert name in families, (kind, spec, name)
            assert families[name].type in ("gauge", "counter"), (name, families[name].type)  # EPPs read only these
            assert families[name].samples, (kind, spec, name)
