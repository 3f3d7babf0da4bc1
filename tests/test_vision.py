"""Images in the state against Cloudflare's reference (clef_finetune's load_release_model + systemone with
request["images"], fp32, CPU): preprocessing bit for bit, the tower's features, M-RoPE positions, ids,
spans, usage and probabilities, on the upstream tiny release and on one whose positions reach the W axis;
faults that parity must catch; chunking through an image, mixed batches and the caches."""

from __future__ import annotations

import random

import pytest
import torch
from images import data_url, png, processor_cases
from parity import PARITY_BOUND, assert_answers_match, reference_response
from random_requests import random_request
from releases import clef_ratio_release, reference_model, tiny_release, vision_release

from clef_cuda import Decider
from clef_cuda.request import encoding
from clef_cuda.request.images import ImageLimits, load_images, load_processor_config, request_images
from clef_cuda.serving.engine import Engine, EngineConfig

RELEASES = {"tiny": tiny_release, "vision": vision_release}


@pytest.fixture(scope="module", params=sorted(RELEASES))
def pair(request):
    path = RELEASES[request.param]()
    return Decider.from_release(path, device="cpu", progress=False, chunk_size=96), reference_model(path)


@pytest.fixture(scope="module")
def tiny_pair():
    path = tiny_release()
    return Decider.from_release(path, device="cpu", progress=False, chunk_size=96), reference_model(path)


def reference_probabilities(reference, request) -> tuple[object, list[list[float]]]:
    jsm, model, processor = reference
    record = jsm.encode_record(processor.tokenizer, request, processor=processor)
    batch = jsm.collate_records([record], processor.tokenizer.pad_token_id, torch.device("cpu"))
    with torch.inference_mode():
        logits = model(batch)[0]
    return record, [q.float().softmax(-1).tolist() for q in logits]


def ours(decider: Decider, request, chunk_sizes=None, features_fault=None):
    images = decider.prepare_images(request_images(request, decider.options.image_limits))
    record = decider.encode(request, images)
    features = decider.image_features(images)
    if features_fault is not None:
        features = features_fault(features)
    return record, decider.probabilities(record, chunk_sizes, features)


def worst(a, b) -> float:
    return max(abs(x - y) for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True))


def request_with(images: list[str], seed: int = 0, state_words=(5, 40)) -> dict:
    request = random_request(random.Random(seed), state_words=state_words)
    request["images"] = images
    return request


# ---- preprocessing, features, positions -----------------------------------------------------------
@pytest.mark.parametrize("case", sorted(processor_cases()))
def test_preprocessing_is_bit_exact_with_the_reference_processor(tiny_pair, case):
    decider, (_, _, processor) = tiny_pair
    blob = processor_cases()[case]
    reference = processor.image_processor(images=[data_url(blob)], return_tensors="pt")
    (prepared,) = load_images([blob], load_processor_config(tiny_release()), ImageLimits())
    assert (1, *prepared.grid) == tuple(reference["image_grid_thw"][0].tolist())
    assert torch.equal(prepared.pixel_values, reference["pixel_values"])


def test_tower_features_match_get_image_features(pair):
    decider, (_, model, _) = pair
    blobs = [png(300, 200, 1), png(64, 100, 2), png(1, 150, 3)]
    prepared = decider.prepare_images(blobs)
    pixel_values = torch.cat([p.pixel_values for p in prepared])
    grid = torch.tensor([[1, *p.grid] for p in prepared])
    with torch.inference_mode():
        expected = model.language_model.model.get_image_features(pixel_values, grid).pooler_output
    for got, want in zip(decider.image_features(prepared), expected, strict=True):
        assert got.shape == want.shape and (got - want).abs().max() < 1e-6


@pytest.mark.parametrize("row_chunk", [12, 100])
def test_the_tower_in_row_chunks_matches_get_image_features(pair, monkeypatch, row_chunk):
    """The tower runs its row-wise steps ROW_CHUNK patches at a time (its peak memory bounded for a 16k-token
    image): chunks far smaller than an image (12 patches, 100; chunk edges inside images and across two) give
    the reference's features to the same 1e-6."""
    from clef_cuda.model import vision

    monkeypatch.setattr(vision, "ROW_CHUNK", row_chunk)
    decider, (_, model, _) = pair
    prepared = decider.prepare_images([png(300, 200, 1), png(64, 100, 2)])
    pixel_values = torch.cat([p.pixel_values for p in prepared])
    grid = torch.tensor([[1, *p.grid] for p in prepared])
    with torch.inference_mode():
        expected = model.language_model.model.get_image_features(pixel_values, grid).pooler_output
    for got, want in zip(decider.image_features(prepared), expected, strict=True):
        assert got.shape == want.shape and (got - want).abs().max() < 1e-6


def test_positions_equal_get_rope_index(pair):
    decider, reference = pair
    jsm, model, processor = reference
    request = request_with([data_url(png(300, 200, 1)), data_url(png(96, 130, 2))])
    record, _ = ours(decider, request)
    theirs = jsm.encode_record(processor.tokenizer, request, processor=processor)
    batch = jsm.collate_records([theirs], processor.tokenizer.pad_token_id, torch.device("cpu"))
    media = batch["media"]
    positions, _ = model.language_model.model.get_rope_index(
        batch["input_ids"], media["mm_token_type_ids"], image_grid_thw=media["image_grid_thw"]
    )
    assert torch.equal(record.rope_positions(), positions[:, 0])


@pytest.mark.parametrize("case", sorted(processor_cases()))
def test_ids_spans_and_usage_match_the_reference(tiny_pair, case):
    decider, reference = tiny_pair
    jsm, model, processor = reference
    request = request_with([data_url(processor_cases()[case])], seed=3)
    record, probabilities = ours(decider, request)
    theirs, expected = reference_probabilities(reference, request)
    assert record.input_ids == theirs.input_ids
    assert [(q.span, q.option_spans) for q in record.questions] == [
        (q.question_span, q.option_spans) for q in theirs.questions
    ]
    assert worst(probabilities, expected) < PARITY_BOUND
    assert decider.decide(request)["usage"] == jsm.systemone(model, processor, request)["usage"]


def test_two_images_of_different_sizes(pair):
    decider, reference = pair
    request = request_with([data_url(png(300, 200, 1)), data_url(png(40, 260, 2))], seed=4)
    record, probabilities = ours(decider, request)
    theirs, expected = reference_probabilities(reference, request)
    assert record.input_ids == theirs.input_ids and len(record.media) == 2
    assert worst(probabilities, expected) < PARITY_BOUND


def test_random_requests_with_0_to_4_images_match_the_reference(pair):
    decider, reference = pair
    rng = random.Random(11)
    for seed in range(10):
        images = [data_url(png(rng.randint(16, 420), rng.randint(16, 320), seed * 10 + i)) for i in range(seed % 5)]
        request = request_with(images, seed=seed)
        record, probabilities = ours(decider, request)
        theirs, expected = reference_probabilities(reference, request)
        assert record.input_ids == theirs.input_ids
        assert worst(probabilities, expected) < PARITY_BOUND, seed


def test_clef_27b_ratios_with_images_match_the_reference():
    """The tower's features into a trunk of clef 27B's ratios (GQA 6, 3 value heads a key head)."""
    path = clef_ratio_release()
    decider, reference = Decider.from_release(path, device="cpu", progress=False), reference_model(path)
    for seed in range(3):
        request = request_with([data_url(png(64 + 40 * seed, 96, seed)) for _ in range(seed + 1)], seed=seed)
        record, probabilities = ours(decider, request)
        theirs, expected = reference_probabilities(reference, request)
        assert record.input_ids == theirs.input_ids
        assert worst(probabilities, expected) < PARITY_BOUND, seed


# ---- the checks above can fail ---------------------------------------------------------------------
def test_images_change_the_answers(tiny_pair):
    """Text only, image A and image B of the same size: three different decisions (so a server that
    dropped images, or served A's cache to B, would be caught)."""
    decider, _ = tiny_pair
    request = request_with([], seed=5)
    runs = [
        ours(decider, request | {"images": images})[1]
        for images in ([], [data_url(png(200, 120, 1))], [data_url(png(200, 120, 2))])
    ]
    assert worst(runs[0], runs[1]) > 10 * PARITY_BOUND and worst(runs[1], runs[2]) > 10 * PARITY_BOUND


@pytest.mark.parametrize("fault", ["1-D positions", "image rows dropped"])
def test_parity_catches_a_fault(monkeypatch, fault):
    """On the release that sees the W axis: either fault moves the probabilities far past the tolerance."""
    path = vision_release()
    decider = Decider.from_release(path, device="cpu", progress=False, chunk_size=96)
    request = request_with([data_url(png(300, 200, 1)), data_url(png(64, 128, 2))], seed=6)
    _, expected = reference_probabilities(reference_model(path), request)
    features_fault = None
    if fault == "1-D positions":
        monkeypatch.setattr(encoding.EncodedRecord, "rope_positions", lambda self: None)
    else:  # the last feature row of each image lost (its token keeps its text embedding's place: zeros)

        def features_fault(features):
            return [torch.cat([f[:-1], torch.zeros_like(f[-1:])]) for f in features]

    _, probabilities = ours(decider, request, features_fault=features_fault)
    assert worst(probabilities, expected) > 100 * PARITY_BOUND


# ---- chunking, batching, caches ----------------------------------------------------------------------
def test_chunks_of_7_through_the_images_equal_one_pass(tiny_pair):
    decider, _ = tiny_pair
    request = request_with([data_url(png(300, 200, 1)), data_url(png(64, 90, 2))], seed=7)
    record, whole = ours(decider, request, chunk_sizes=None)
    n = record.num_tokens
    _, sevens = ours(decider, request, chunk_sizes=[7] * (n // 7) + ([n % 7] if n % 7 else []))
    assert worst(whole, sevens) < 1e-6


def _engine(decider: Decider, **config) -> Engine:
    engine = Engine(
        decider, EngineConfig(**({"max_model_len": 4096, "kv_fraction": 0.02, "prefill_chunk_size": 64} | config))
    )
    engine.start()
    return engine


def test_a_batch_mixing_image_and_text_records_equals_solo_runs(tiny_pair):
    decider, _ = tiny_pair
    requests = [
        request_with([data_url(png(200, 120, i))] * (i % 3), seed=20 + i) | {"model": "clef-flash"} for i in range(6)
    ]
    engine = _engine(decider, max_num_seqs=4, prefix_cache=False)
    try:
        tickets = [engine.submit(r) for r in requests]
        together = [t.future.result(120) for t in tickets]
    finally:
        engine.stop(10)
    for request, body in zip(requests, together, strict=True):
        assert body["answers"] == decider.decide(request)["answers"]
        assert body["usage"] == decider.decide(request)["usage"]


def test_same_size_images_never_share_a_prefix_and_a_repeated_image_hits_the_caches(tiny_pair, monkeypatch):
    decider, reference = tiny_pair
    state = " ".join(f"claim line {i}: rear bumper dented" for i in range(80))  # long: worth a snapshot
    question = {"q": {"type": "noul", "instructions": "Is the bumper dented?"}}
    a, b = data_url(png(200, 120, 1)), data_url(png(200, 120, 2))  # same size: identical token ids
    tower_calls = []
    real = decider.image_features
    monkeypatch.setattr(decider, "image_features", lambda images: tower_calls.append(len(images)) or real(images))
    engine = _engine(decider, min_snapshot_tokens=32)
    try:

        def decide(images, q=question):
            return engine.decide({"model": "clef-flash", "state": state, "questions": q, "images": images}, timeout=120)

        first_a = decide([a])
        first_b = decide([b])
        assert first_b["x_cached_tokens"] == 0  # A's snapshot has B's tokens, not B's pixels
        again_a = decide([a])
        assert again_a["x_cached_tokens"] > 0 and again_a["answers"] == first_a["answers"]
        for images, body in (([a], first_a), ([b], first_b)):
            request = {"model": "clef-flash", "state": state, "questions": question, "images": images}
            expected, unrounded = reference_response(reference, request)
            assert_answers_match(body["answers"], expected["answers"], unrounded)
        calls = len(tower_calls)
        assert calls == 2  # A and B; A again was restored from the prefix cache, past its image
        other = engine.decide({"model": "clef-flash", "state": "another claim", "questions": question, "images": [a]})
        assert other["x_cached_tokens"] == 0  # another state: no prefix, but image A's features were kept
        assert len(tower_calls) == calls and engine.vision_cache.hits >= 1
        assert (
            engine.images == 4 and engine.image_tokens == 4 * decider.prepare_images([png(200, 120, 1)])[0].num_tokens
        )
    finally:
        engine.stop(10)


def test_no_reuse_point_falls_inside_an_image(tiny_pair):
    decider, _ = tiny_pair
    engine = Engine(decider, EngineConfig(max_model_len=4096, kv_fraction=0.02, min_snapshot_tokens=16))
    request = {"model": "clef-flash", "state": "s", "questions": {"q": {"type": "noul"}}}
    for width in range(64, 1024, 32):  # an image whose end leaves the state's block boundary inside it
        images = decider.prepare_images([png(width, 64, 1)])
        record = decider.encode(request, images)
        (span,) = record.media
        state_end = (record.prefix_tokens + record.state_tokens) // 16 * 16
        if span.start < state_end < span.end:
            break
    assert span.start < state_end < span.end  # a one-character state: its block boundary is in the image
    points = engine._reuse_points(record)
    assert points and not any(record.inside_media(p) for p in points)
    assert state_end not in points
