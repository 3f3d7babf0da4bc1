"""Fine-tuned variants over one trunk (clef_cuda.model.adapters): two clef-finetune checkpoints (every module; a
subset) served together unmerged, against Cloudflare's reference on clef-finetune's fp32 merge of each;
batching, cache isolation, every loading rule, faults the oracle must catch, and the HTTP surface."""

from __future__ import annotations

import json
import random
import shutil
import sys
import threading
from pathlib import Path

import pytest
import torch
from adapter_fixtures import checkpoint, merged
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from live import wait_until
from parity import INT8_BOUNDS, PARITY_BOUND, assert_answers_match, assert_response_matches, reference_response
from prometheus_client.parser import text_string_to_metric_families
from random_requests import random_request
from releases import clef_ratio_release, reference_model, tiny_release

from app.server import ServerSettings, create_app
from clef_cuda import Decider
from clef_cuda.model import adapters
from clef_cuda.model.adapters import AdapterError, AdapterRegistry, load_adapter_tensors
from clef_cuda.request import answers
from clef_cuda.serving.engine import Engine, EngineConfig

VARIANTS = ("all", "subset")
KEY = "adapter-admin-key"


@pytest.fixture(scope="module")
def decider():
    return Decider.from_release(tiny_release(), device="cpu", progress=False)


def registry_with(decider, *names: str, **options) -> AdapterRegistry:
    registry = AdapterRegistry(decider.config, decider.trunk.lm_head, decider.trunk.dtype, **options)
    for name in names:
        registry.load(name, checkpoint(name))
    return registry


def make_engine(decider, registry=None, **config) -> Engine:
    defaults = dict(
        max_model_len=8192, allow_long_context=True, kv_fraction=0.02, prefill_chunk_size=256, min_snapshot_tokens=32
    )
    return Engine(decider, EngineConfig(**(defaults | config)), registry)


@pytest.fixture(scope="module")
def served(decider):
    """An engine with both variants, started."""
    engine = make_engine(decider, registry_with(decider, *VARIANTS))
    engine.start()
    yield engine
    engine.stop(10)


@pytest.fixture
def capture(monkeypatch):
    """The unrounded per-option probabilities of every answered question, in order."""
    seen: list[list[float]] = []
    real = answers.answer

    def record(question, probabilities, confidence="clef"):
        seen.append(list(probabilities.values()))
        return real(question, probabilities, confidence)

    monkeypatch.setattr(answers, "answer", record)
    return seen


def reference_probabilities(release: Path, request: dict) -> list[list[float]]:
    jsm, model, processor = reference_model(release)
    record = jsm.encode_record(processor.tokenizer, request)
    batch = jsm.collate_records([record], processor.tokenizer.pad_token_id, torch.device("cpu"))
    with torch.inference_mode():
        return [q.float().softmax(-1).tolist() for q in model(batch)[0]]


def worst(a, b) -> float:
    return max(abs(x - y) for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True))


def long_request(seed: int) -> dict:
    """Over 1k tokens: several 256-token prefill chunks."""
    return random_request(random.Random(seed), state_words=(100, 150), null_score_levels=False)


def decide(engine, request, model, capture) -> tuple[dict, list[list[float]]]:
    capture.clear()
    body = engine.decide(request | {"model": model}, timeout=300)
    return body, list(capture)


# ---- against the reference ------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_unmerged_variants_match_clef_finetunes_fp32_merge(served, capture, variant):
    for seed in range(3):
        request = long_request(seed)
        body, ours = decide(served, request, variant, capture)
        assert body["usage"]["input_tokens"] > 1000 and body["model"] == variant
        assert worst(ours, reference_probabilities(merged(variant), request)) < PARITY_BOUND


def test_a_variant_decides_a_video_as_its_merge(served, capture, tmp_path):
    """A video record on an unmerged variant, against the reference (its video oracle) on clef-finetune's merge."""
    import clips
    import video_oracle

    clip = clips.clip("h264", 96, 64, 30, 10, seed=9)
    request = random_request(random.Random(40), state_words=(5, 30), null_score_levels=False)
    (answer,) = video_oracle.run(merged("all"), [request | {"model": "clef-flash", "videos": [clip]}], tmp_path)
    body, _ = decide(served, request | {"videos": [video_oracle.data_url(clip)]}, "all", capture)
    assert body["model"] == "all" and body["usage"] == answer["response"]["usage"]
    assert_answers_match(body["answers"], answer["response"]["answers"], answer["unrounded"])
    base, _ = decide(served, request | {"videos": [video_oracle.data_url(clip)]}, "clef-flash", capture)
    assert base["answers"] != body["answers"]  # the variant, not the base, answered


def test_a_variant_of_a_clef_27b_ratio_base_matches_its_merge(capture):
    """clef 27B's ratios (GQA 6, 3 value heads a key head, its MLP ratio): a variant on every module, unmerged,
    against the reference on clef-finetune's fp32 merge."""
    base = Decider.from_release(clef_ratio_release(), device="cpu", progress=False)
    registry = AdapterRegistry(base.config, base.trunk.lm_head, base.trunk.dtype)
    registry.load("all", checkpoint("all", "clef-ratio"))
    engine = make_engine(base, registry)
    engine.start()
    try:
        for seed in range(2):
            request = long_request(seed)
            _, ours = decide(engine, request, "all", capture)
            assert worst(ours, reference_probabilities(merged("all", "clef-ratio"), request)) < PARITY_BOUND
    finally:
        engine.stop(30)


def test_variants_work_unchanged_over_an_int8_base(capture):
    """The same checkpoints over the base loaded with --quantize int8 (their deltas stay fp32): within each
    variant's own int8 bound of clef-finetune's fp32 merge (the subset variant moves 170x less than the one on
    every module), and each still moves the answers."""
    int8 = Decider.from_release(tiny_release(), device="cpu", progress=False, quantize="int8")
    engine = make_engine(int8, registry_with(int8, *VARIANTS))
    engine.start()
    try:
        request = long_request(50)
        _, base = decide(engine, request, "clef-flash", capture)
        for variant in VARIANTS:
            _, ours = decide(engine, request, variant, capture)
            bound = INT8_BOUNDS[(f"upstream-tiny+lora:{variant}", "f32")]
            assert worst(ours, reference_probabilities(merged(variant), request)) <= bound, variant
            assert worst(base, ours) > 1e-2, variant
    finally:
        engine.stop(10)


def test_each_variant_moves_the_answers(served, capture):
    request = long_request(7)
    _, base = decide(served, request, "clef-flash", capture)
    for variant in VARIANTS:
        _, tuned = decide(served, request, variant, capture)
        assert worst(base, tuned) > 1e-2, variant  # so the parity test above can fail


def test_rounded_http_answers_match_the_references(decider):
    engine = make_engine(decider, registry_with(decider, *VARIANTS))
    with TestClient(create_app(ServerSettings(), engine=engine)) as client:
        for variant in VARIANTS:
            request = long_request(11) | {"model": variant}
            response = client.post("/v1/systemone", json=request)
            assert response.status_code == 200, response.text
            assert_response_matches(response.json(), *reference_response(reference_model(merged(variant)), request))
            # Workers AI's route names the variant in its path (the body's model is the path's there).
            hosted = client.post(f"/client/v4/accounts/any/ai/run/@cf/cloudflare/{variant}", json=long_request(11))
            assert hosted.status_code == 200, hosted.text
            result = hosted.json()["result"]
            assert result["model"] == variant
            for qid, answer in response.json()["answers"].items():
                assert result["answers"][qid].get("probabilities") == answer.get("probabilities"), qid


@pytest.mark.parametrize(
    "fault",
    ["slice offset shifted", "module dropped", "scale off by 10%"],
)
def test_the_oracle_catches_a_fault(decider, capture, monkeypatch, fault):
    if fault == "slice offset shifted":  # z's columns one to the right (its last lands on b's first)
        real = adapters.module_slots

        def shifted(config, kind):
            slots = real(config, kind)
            if "in_proj_z" in slots:
                z = slots["in_proj_z"]
                slots["in_proj_z"] = adapters.FusedSlot(z.fused, z.offset + 1, z.width, z.in_features)
            return slots

        monkeypatch.setattr(adapters, "module_slots", shifted)
    elif fault == "module dropped":
        real_build = adapters.build_deltas

        def dropped(pairs, *args):
            return real_build({k: v for k, v in pairs.items() if k != (0, "in_proj_qkv")}, *args)

        monkeypatch.setattr(adapters, "build_deltas", dropped)
    else:
        real_build = adapters.build_deltas
        monkeypatch.setattr(
            adapters, "build_deltas", lambda pairs, trunk, scale, *a: real_build(pairs, trunk, 1.1 * scale, *a)
        )
    engine = make_engine(decider, registry_with(decider, "all"))
    engine.start()
    try:
        request = long_request(3)
        _, ours = decide(engine, request, "all", capture)
    finally:
        engine.stop(10)
    assert worst(ours, reference_probabilities(merged("all"), request)) > 100 * PARITY_BOUND


# ---- batching and caches ------------------------------------------------------------------------
def test_base_and_variants_together_equal_their_solo_answers(decider, capture):
    plain = make_engine(decider, max_num_seqs=6, prefix_cache=False)  # no adapters at all, same steps
    plain.start()
    try:
        requests = [long_request(20 + i) for i in range(3)]
        solo_base = [decide(plain, r, "clef-flash", capture)[1] for r in requests]
    finally:
        plain.stop(10)
    engine = make_engine(decider, registry_with(decider, *VARIANTS), max_num_seqs=6, prefix_cache=False)
    engine.start()
    models = ("clef-flash", *VARIANTS)
    try:
        solo = {(i, m): decide(engine, r, m, capture) for i, r in enumerate(requests) for m in models}
        tickets = {(i, m): engine.submit(r | {"model": m}) for i, r in enumerate(requests) for m in models}
        together = {key: t.future.result(300) for key, t in tickets.items()}
    finally:
        engine.stop(10)
    for i in range(len(requests)):
        assert solo[(i, "clef-flash")][1] == solo_base[i]  # bit for bit: base rows run today's code
    for key, body in together.items():  # nine records of three models in shared steps
        assert body["answers"] == solo[key][0]["answers"] and body["model"] == key[1]


def test_a_variant_never_reads_another_variants_cache(decider, capture):
    engine = make_engine(decider, registry_with(decider, *VARIANTS))
    cold = make_engine(decider, registry_with(decider, "subset"), prefix_cache=False)
    engine.start()
    cold.start()
    try:
        request = long_request(30)
        decide(engine, request, "all", capture)  # warms the state for "all"
        body, warm = decide(engine, request, "subset", capture)
        assert body["x_cached_tokens"] == 0
        _, expected = decide(cold, request, "subset", capture)
        assert warm == expected
        again, _ = decide(engine, request, "all", capture)
        assert again["x_cached_tokens"] > 0  # the same variant does reuse it
    finally:
        engine.stop(10)
        cold.stop(10)


def test_a_reload_under_the_same_name_is_never_served_stale(decider, capture):
    registry = registry_with(decider)
    registry.load("team", checkpoint("all"))
    engine = make_engine(decider, registry)
    engine.start()
    try:
        request = long_request(31)
        decide(engine, request, "team", capture)
        held = len(engine.prefix_cache)
        unloaded = registry.unload("team")
        engine.forget_variant(unloaded.digest)  # what the unload endpoint does: its entries go
        registry.load("team", checkpoint("subset"))  # other bytes, same name
        body, ours = decide(engine, request, "team", capture)
        assert held > 0 and body["x_cached_tokens"] == 0
        assert worst(ours, reference_probabilities(merged("subset"), request)) < PARITY_BOUND
    finally:
        engine.stop(10)


# ---- loading rules --------------------------------------------------------------------------------
def copy_checkpoint(tmp_path: Path, name: str = "all") -> Path:
    target = tmp_path / "checkpoint-4"
    shutil.copytree(checkpoint(name), target)
    return target


def edit_config(directory: Path, change) -> None:
    path = directory / "adapter" / "adapter_config.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def edit_tensors(directory: Path, change, file: str = "adapter/adapter_model.safetensors") -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(directory / file))
    change(tensors)
    save_file(tensors, str(directory / file))


QKV = "base_model.model.model.language_model.layers.0.linear_attn.in_proj_qkv"
RULES = {
    "dora": (lambda d: edit_config(d, lambda c: c.update(use_dora=True)), "adapter_config.json: field 'use_dora'"),
    "modules_to_save": (lambda d: edit_config(d, lambda c: c.update(modules_to_save=["lm_head"])), "modules_to_save"),
    "bias": (lambda d: edit_config(d, lambda c: c.update(bias="all")), "field 'bias'"),
    "rank_pattern": (lambda d: edit_config(d, lambda c: c.update(rank_pattern={"q_proj": 4})), "rank_pattern"),
    "alpha_pattern": (lambda d: edit_config(d, lambda c: c.update(alpha_pattern={"q_proj": 4})), "alpha_pattern"),
    "rank over the limit": (lambda d: edit_config(d, lambda c: c.update(r=128)), "over --max-adapter-rank"),
    "vision key": (
        lambda d: edit_tensors(
            d, lambda t: t.update({"base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight": torch.zeros(8, 32)})
        ),
        "visual.blocks.0.attn.qkv.lora_A.weight is outside",
    ),
    "lm_head key": (
        lambda d: edit_tensors(d, lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)})),
        "lm_head.lora_A.weight is outside",
    ),
    "embeddings key": (
        lambda d: edit_tensors(
            d,
            lambda t: t.update(
                {"base_model.model.model.language_model.embed_tokens.lora_A.weight": torch.zeros(8, 64)}
            ),
        ),
        "embed_tokens",
    ),
    "magnitude vector": (
        lambda d: edit_tensors(d, lambda t: t.update({QKV + ".lora_magnitude_vector.weight": torch.ones(128)})),
        "lora_magnitude_vector",
    ),
    "missing B": (lambda d: edit_tensors(d, lambda t: t.pop(QKV + ".lora_B.weight")), "in_proj_qkv has no lora_B"),
    "wrong shape": (
        lambda d: edit_tensors(d, lambda t: t.update({QKV + ".lora_A.weight": torch.zeros(8, 63)})),
        "expected [8, 64]",
    ),
    "layer out of range": (
        lambda d: edit_tensors(
            d, lambda t: t.update({QKV.replace("layers.0", "layers.9") + ".lora_A.weight": torch.zeros(8, 64)})
        ),
        "layer 9 does not exist",
    ),
    "mixer of the other kind": (
        lambda d: edit_tensors(
            d,
            lambda t: t.update(
                {QKV.replace("linear_attn.in_proj_qkv", "self_attn.q_proj") + ".lora_A.weight": torch.zeros(8, 64)}
            ),
        ),
        "layer 0 of the base is linear_attention",
    ),
    "non-finite": (
        lambda d: edit_tensors(d, lambda t: t[QKV + ".lora_B.weight"].__setitem__((0, 0), float("nan"))),
        "not finite",
    ),
    "head missing": (lambda d: (d / "joint_head.safetensors").unlink(), "joint_head.safetensors: missing"),
    "head wrong shape": (
        lambda d: edit_tensors(d, lambda t: t.update({"field_norm.bias": torch.zeros(3)}), "joint_head.safetensors"),
        "field_norm.bias has shape [3]",
    ),
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_every_loading_rule_refuses_naming_the_file(decider, tmp_path, rule):
    directory = copy_checkpoint(tmp_path)
    change, words = RULES[rule]
    change(directory)
    registry = registry_with(decider, max_rank=64)
    with pytest.raises(AdapterError) as info:
        registry.load("bad", directory)
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert registry.names() == [] and registry.loads["error"] == 1


def test_a_merged_release_or_a_run_directory_is_refused_with_the_fix(decider, tmp_path):
    registry = registry_with(decider)
    with pytest.raises(AdapterError, match="a merged release.*--w"):
        registry.load("m", merged("all"))
    with pytest.raises(AdapterError, match="a training run directory; point at one of its checkpoints"):
        registry.load("r", checkpoint("all").parent)


def test_warnings_for_a_no_op_adapter_and_another_revision(decider, tmp_path, caplog):
    directory = copy_checkpoint(tmp_path)
    edit_tensors(directory, lambda t: [v.zero_() for k, v in t.items() if k.endswith("lora_B.weight")])
    from dataclasses import replace

    train_config = json.loads((directory / "train_config.json").read_text())
    train_config["model"]["revision"] = "aaaa"
    (directory / "train_config.json").write_text(json.dumps(train_config))
    base = replace(decider.config, revision="bbbb")
    with caplog.at_level("WARNING", logger="clef_cuda.model.adapters"):
        load_adapter_tensors(directory, base, 64)
    assert "every lora_B is zero" in caplog.text and "revision aaaa" in caplog.text


def test_training_state_pt_is_never_opened(decider):
    opened: list[str] = []
    active = [True]

    def hook(event, args):
        if active[0] and event == "open" and isinstance(args[0], str | Path):
            opened.append(str(args[0]))

    sys.addaudithook(hook)
    try:
        registry_with(decider).load("x", checkpoint("all"))
    finally:
        active[0] = False
    assert (checkpoint("all") / "training_state.pt").is_file()
    assert not [p for p in opened if p.endswith((".pt", ".bin", ".py", ".pkl"))], opened
    assert any(p.endswith("adapter_model.safetensors") for p in opened)  # the probe does see the reads


def test_heads_with_equal_bytes_are_stored_once(decider):
    registry = registry_with(decider)
    one = registry.load("one", checkpoint("all"))
    two = registry.load("two", checkpoint("all"))
    assert one.head is two.head and registry.bytes() < 2 * (one.bytes + sum(t.numel() * 4 for t in one.head.w.values()))


# ---- the HTTP surface -----------------------------------------------------------------------------
@pytest.fixture
def admin(decider, tmp_path):
    root = tmp_path / "adapters"
    root.mkdir()
    shutil.copytree(checkpoint("all"), root / "team-a")
    shutil.copytree(checkpoint("subset"), root / "team-b")
    engine = make_engine(decider, registry_with(decider), prefill_chunk_size=16)
    settings = ServerSettings(api_key=KEY, adapter_root=str(root))
    with TestClient(create_app(settings, engine=engine)) as client:
        yield client, root, engine


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_runtime_loading_listing_and_unloading(admin):
    client, root, engine = admin
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "team-a"}).status_code == 401
    loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "team-a"}, headers=AUTH)
    assert loaded.status_code == 200, loaded.text
    models = client.get("/v1/models", headers=AUTH).json()
    (entry,) = [m for m in models["data"] if m["id"] == "a"]
    assert entry["parent"] == "clef-flash" and str(root) not in json.dumps(models)
    request = long_request(40) | {"model": "a"}
    assert client.post("/v1/systemone", json=request, headers=AUTH).json()["model"] == "a"
    twice = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "team-b"}, headers=AUTH)
    assert twice.status_code == 400 and "loaded already" in twice.json()["detail"]["message"]

    # Unload while a request of "a" is in flight: it finishes; new ones get 404 at once.
    results: dict = {}
    thread = threading.Thread(
        target=lambda: results.update(
            r=client.post("/v1/systemone", json=long_request(41) | {"model": "a"}, headers=AUTH)
        )
    )
    thread.start()
    wait_until(lambda: engine.running, "the request of 'a' to start")
    unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}, headers=AUTH)
    assert unloaded.status_code == 200
    assert client.post("/v1/systemone", json=request, headers=AUTH).status_code == 404
    thread.join(120)
    assert results["r"].status_code == 200 and results["r"].json()["model"] == "a"
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}, headers=AUTH).status_code == 404
    assert "a" not in [m["id"] for m in client.get("/v1/models", headers=AUTH).json()["data"]]


def test_runtime_loading_reads_only_under_the_root(admin, tmp_path):
    client, root, _ = admin
    outside = tmp_path / "outside"
    shutil.copytree(checkpoint("all"), outside)
    (root / "link").symlink_to(outside)
    for path in ("../outside", str(outside), "link", "team-a/../../outside"):
        response = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path}, headers=AUTH)
        assert response.status_code == 400 and "outside --adapter-root" in response.json()["detail"]["message"], path
    bad = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "missing"}, headers=AUTH)
    assert bad.status_code == 400 and "not a directory" in bad.json()["detail"]["message"]
    assert (
        client.post(
            "/v1/load_lora_adapter", json={"lora_name": "clef-flash", "lora_path": "team-a"}, headers=AUTH
        ).status_code
        == 400
    )
    assert client.post("/v1/load_lora_adapter", content=b"[1]", headers=AUTH).status_code == 400
    assert client.post("/v1/systemone", json=long_request(1) | {"model": "clef-flash"}, headers=AUTH).status_code == 200


def test_every_v1_route_needs_the_key_and_the_probes_stay_open(admin):
    client, _, _ = admin
    app = client.app
    # A route added later is guarded too: the rule is the path prefix, not a check a route could forget.
    app.add_api_route("/v1/added_later", lambda: {"ok": True}, methods=["GET"])
    declared = [
        (m, r.path) for r in app.routes if isinstance(r, APIRoute) and r.path.startswith("/v1") for m in r.methods
    ]
    expected = {("POST", "/v1/systemone"), ("GET", "/v1/models"), ("POST", "/v1/load_lora_adapter")}
    assert expected | {("POST", "/v1/unload_lora_adapter"), ("GET", "/v1/added_later")} <= set(declared)
    for method, path in [*declared, ("GET", "/v1/no-such-route"), ("GET", "/v1")]:
        for headers in (
            {},
            {"Authorization": "Bearer wrong-key"},
            {"Authorization": KEY},
            {"Authorization": f"Basic {KEY}"},
        ):
            refused = client.request(method, path, headers=headers, json={})
            assert refused.status_code == 401, (method, path, headers, refused.text)
            assert refused.json() == {
                "detail": {"error_type": "authentication_error", "message": refused.json()["detail"]["message"]}
            }
            assert refused.headers["www-authenticate"] == "Bearer"
        assert client.request(method, path, headers=AUTH, json={}).status_code != 401, (method, path)
    for path in ("/health", "/ready", "/metrics"):  # probes and scrapers carry no key
        assert client.get(path).status_code == 200, path


def test_adapter_paths_and_names_a_client_can_send(admin):
    client, root, _ = admin

    def load(name: str, path: str):
        return client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, headers=AUTH)

    for path in (f"{root}/team-a\u0000/x", "team-a\u0000", "\u0000"):  # the OS refuses a NUL byte in a path
        response = load("x", path)
        assert response.status_code == 400, (path, response.text)
        assert response.json()["detail"]["message"].startswith("lora_path "), response.text
    # A name is a routing key and a log field, never a path or a second log line.
    for name in ("../../x", "a" * 129, "a\nb", "/x", "a//b", "a/", "a b", "team\u00e9", "-x", "a/../b"):
        response = load(name, "team-a")
        assert response.status_code == 400 and response.json()["detail"]["message"].startswith("lora_name"), name
    for name in ("org/model:v1.2", "A-b_c.3", "a" * 128):
        assert load(name, "team-a").status_code == 200, name
    assert {"org/model:v1.2", "A-b_c.3", "a" * 128} <= set(
        m["id"] for m in client.get("/v1/models", headers=AUTH).json()["data"]
    )
    # A loader's error names the file, relative to the adapter root: no response says where that is.
    bad = root / "bad"
    shutil.copytree(checkpoint("all"), bad)
    edit_config(bad, lambda c: c.update(use_dora=True))
    refused = load("bad", "bad")
    message = refused.json()["detail"]["message"]
    assert refused.status_code == 400 and "use_dora" in message and "<adapter-root>/bad/adapter" in message
    assert str(root) not in refused.text and str(root.resolve()) not in refused.text


def test_no_response_names_the_release_directory(tmp_path):
    from clef_cuda.errors import ReleaseError

    release = tmp_path / "mnt" / "models" / "clef-flash"

    def failing_load():
        raise ReleaseError(f"{release}/model.safetensors: tensor model.embed_tokens.weight is missing")

    settings = ServerSettings(api_key=KEY, release_dir=str(release))
    with TestClient(create_app(settings, load_engine=failing_load)) as client:
        wait_until(lambda: client.get("/ready").json()["status"] == "failed", "the load to fail")
        ready = client.get("/ready")
        assert ready.status_code == 503 and "the release/model.safetensors" in ready.json()["detail"]["message"]
        assert str(release) not in ready.text
        models = client.get("/v1/models", headers=AUTH)
        assert models.status_code == 200 and str(tmp_path) not in models.text


def test_runtime_loading_is_off_by_default(decider):
    engine = make_engine(decider, registry_with(decider, "all"))
    with TestClient(create_app(ServerSettings(), engine=engine)) as client:
        assert client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"}).status_code == 404
        assert client.post("/v1/systemone", json=long_request(2) | {"model": "all"}).status_code == 200
        assert client.post("/v1/systemone", json=long_request(2) | {"model": "nope"}).status_code == 404
        values = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(client.get("/metrics").text)
            for s in f.samples
        }
        assert values[("clef_adapters_loaded", ())] == 1 and values[("clef_adapter_slots", ())] == 8
        assert values[("clef_adapter_loads_total", (("result", "ok"),))] == 1
        assert values[("clef_model_requests_total", (("model", "all"),))] == 1
        assert values[("clef_adapter_bytes", ())] > 0


def _cli(*args: str):
    import subprocess

    return subprocess.run([sys.executable, "-m", "app", *args], capture_output=True, text=True, timeout=120)


def test_cli_refuses_bad_adapters_in_one_line(tmp_path):
    bad = copy_checkpoint(tmp_path)
    edit_config(bad, lambda c: c.update(use_dora=True))
    for args, words in (
        (["--adapter", f"x={bad}"], "use_dora"),
        (["--adapter", "noequals"], "expected NAME=DIR"),
        (["--adapter", f"../../x={checkpoint('all')}"], "not a model name"),
        (["--adapter", f"a\nb={checkpoint('all')}"], "not a model name"),
        (["--adapter", f"{'n' * 300}={checkpoint('all')}"], "300 characters long"),
        (["--adapter", f"clef-tiny={checkpoint('all')}"], "the served model's"),
        (["--adapter", f"a={checkpoint('all')}", "--adapter", f"a={checkpoint('subset')}"], "given twice"),
        (["--enable-adapter-loading", "--adapter-root", str(tmp_path)], "needs --api-key"),
        (["--enable-adapter-loading", "--api-key", "k"], "needs --adapter-root"),
    ):
        done = _cli("--d", "cpu", *args)
        lines = [line for line in done.stderr.splitlines() if line.strip() and "clef-serve: error" in line]
        assert done.returncode == 2 and len(lines) == 1 and words in lines[0], (args, done.stderr[-800:])
