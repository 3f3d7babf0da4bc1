"""Decisions against the upstream reference (clef_finetune's vendored joint_schema_model.py, fp32, CPU):
identical token ids and spans, probabilities within the parity bound (tests/parity.py), on the upstream
tiny release and on a second release with other shapes and a BPE tokenizer; and the key-band bug caught
at model level."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import cuda_available
from faults import KeyBandZeroedOps
from parity import PARITY_BOUND, assert_response_matches, reference_response
from random_requests import features, random_request
from releases import TINY_PAST_TRAINING, mid_release, reference_model, tiny_release

from clef_cuda import Decider
from clef_cuda.errors import RequestError, RequestTooLongError

COVERAGE = {
    "type:noul",
    "type:choice",
    "type:score",
    "unicode id",
    "unicode option",
    "state:str",
    "state:dict",
    "state:list",
    "instructions:str",
    "instructions:dict",
    "instructions:NoneType",
    "instructions:missing",
    "null description",
    "noul one-sided",
    "choice 255",
    "score 2",
    "score 10",
}


def requests(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    out = [random_request(rng) for _ in range(count - 2)]
    out.append(random_request(rng, state_words=(600, 900)))  # a long state: several prefill chunks
    wide = random_request(rng)
    wide["questions"]["wide"] = {
        "type": "choice",
        "instructions": "pick one",
        "criteria": {f"o{i}": (None if i % 3 else "d") for i in range(255)},
    }
    out.append(wide)
    return out


def reference_probabilities(jsm, model, processor, request) -> tuple[object, list[list[float]]]:
    record = jsm.encode_record(processor.tokenizer, request)
    batch = jsm.collate_records([record], processor.tokenizer.pad_token_id, torch.device("cpu"))
    with torch.inference_mode():
        logits = model(batch)[0]
    return record, [question_logits.float().softmax(-1).tolist() for question_logits in logits]


def check_against_reference(decider: Decider, reference, request) -> float:
    """Asserts ids/spans identical and probabilities within tolerance; returns the largest difference."""
    jsm, model, processor = reference
    ours = decider.encode(request)
    theirs, reference_probs = reference_probabilities(jsm, model, processor, request)
    assert ours.input_ids == theirs.input_ids
    for q, r in zip(ours.questions, theirs.questions, strict=True):
        assert (q.question_id, q.span, q.option_spans, q.option_ids, q.type_id) == (
            r.question_id,
            r.question_span,
            r.option_spans,
            r.option_ids,
            r.question_type,
        )
    our_probs = decider.probabilities(ours)
    worst = max(abs(a - b) for x, y in zip(our_probs, reference_probs, strict=True) for a, b in zip(x, y, strict=True))
    assert worst < PARITY_BOUND, f"probabilities differ by {worst:.2e}"
    return worst


def assert_same_response(ours: dict, reference, request: dict, **options) -> None:
    """Our decide() body against the reference's systemone on `request`: the same keys, then the rules of
    tests/parity.py (token counts exact, rounded numbers within half a unit plus the bound)."""
    expected, unrounded = reference_response(reference, request, **options)
    assert list(ours) == list(expected), (ours, expected)
    assert_response_matches(ours, expected, unrounded)


@pytest.fixture(scope="module")
def tiny():
    path = tiny_release()
    decider = Decider.from_release(path, device="cpu", progress=False, chunk_size=96, **TINY_PAST_TRAINING)
    return decider, reference_model(path)


@pytest.fixture(scope="module")
def mid():
    path = mid_release()
    return Decider.from_release(path, device="cpu", progress=False, chunk_size=128), reference_model(path)


def test_random_requests_cover_the_contract():
    covered = set().union(*(features(r) for r in requests(0, 52) + requests(1, 22)))
    assert COVERAGE <= covered, COVERAGE - covered


def test_tiny_release_matches_reference(tiny):
    decider, reference = tiny
    worst = max(check_against_reference(decider, reference, r) for r in requests(0, 52))
    assert worst < PARITY_BOUND


def test_second_release_matches_reference(mid):
    decider, reference = mid
    worst = max(check_against_reference(decider, reference, r) for r in requests(1, 22))
    assert worst < PARITY_BOUND


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_decide_equals_reference_systemone(tiny, seed):
    decider, reference = tiny
    request = random_request(random.Random(seed))
    assert_same_response(decider.decide(request), reference, request)


def test_published_example_request_shape(tiny):
    """The irr/clef-flash test request (the three question types) through the whole path."""
    decider, reference = tiny
    state = (
        "Checkout has been failing for every customer for the last hour. Orders are blocked and support is "
        "getting refund demands."
    )
    request = {
        "model": "clef-flash",
        "state": state,
        "questions": {
            "outage": {"type": "noul", "instructions": "Is a service down?"},
            "department": {
                "type": "choice",
                "instructions": "Which team should handle the message?",
                "criteria": {
                    "billing": "Payments, invoices, or refunds",
                    "technical": "Bugs, outages, or blocked orders",
                    "sales": "New purchases or upgrades",
                },
            },
            "urgency": {
                "type": "score",
                "instructions": "How soon does this need a response?",
                "criteria": ["Can wait", "This week", "Today"],
            },
        },
    }
    ours = decider.decide(request)
    assert_same_response(ours, reference, request)
    assert list(ours["answers"]["department"]["probabilities"]) == ["billing", "technical", "sales"]


def test_chunking_does_not_change_answers(tiny):
    decider, _ = tiny
    record = decider.encode(requests(7, 3)[-2])  # the long-state request
    n = record.num_tokens
    one_pass = decider.probabilities(record, [n])
    odd = decider.probabilities(record, [1, 63, 64, 65, n - 193])
    worst = max(abs(a - b) for x, y in zip(one_pass, odd, strict=True) for a, b in zip(x, y, strict=True))
    assert worst < 1e-6


# ---- the seed's bug at model level ----------------------------------------------------------------
def test_zeroed_key_band_is_caught_by_the_parity_check(mid):
    healthy, reference = mid
    path = mid_release()
    broken = Decider.from_release(
        path, device="cpu", progress=False, chunk_size=128, ops=KeyBandZeroedOps(healthy.config.trunk.key_dim)
    )
    caught, moved = 0, []
    for request in requests(11, 6):
        record = healthy.encode(request)
        good, bad = healthy.probabilities(record), broken.probabilities(record)
        moved.append(max(abs(a - b) for x, y in zip(good, bad, strict=True) for a, b in zip(x, y, strict=True)))
        with pytest.raises(AssertionError, match="probabilities differ"):
            check_against_reference(broken, reference, request)
        caught += 1
    assert caught == 6
    assert min(moved) > 10 * PARITY_BOUND, moved  # the answers really move, on every request


# ---- request errors -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, where",
    [
        ({"state": "s", "questions": {"q": {"type": "noul"}}}, ("model",)),
        ({"model": "m", "questions": {"q": {"type": "noul"}}}, ("state",)),
        ({"model": "m", "state": "s", "questions": {}}, ("questions",)),
        ({"model": "m", "state": "s", "questions": {"q": {"type": "yesno"}}}, ("questions", "q", "type")),
        ({"model": "m", "state": "s", "questions": {"q": {"type": "choice"}}}, ("questions", "q", "criteria")),
        (
            {"model": "m", "state": "s", "questions": {"q": {"type": "score", "criteria": {"0": "a"}}}},
            ("questions", "q", "criteria"),
        ),
        (
            {"model": "m", "state": "s", "questions": {"q": {"type": "choice", "criteria": ["a", "b"]}}},
            ("questions", "q", "criteria"),
        ),
    ],
)
def test_invalid_requests_raise_request_errors(tiny, body, where):
    decider, _ = tiny
    with pytest.raises(RequestError) as info:
        decider.decide(body)
    assert info.value.loc == where


def test_over_budget_is_rejected_with_counts_or_truncated_on_request(tiny):
    decider, reference = tiny
    request = {"model": "clef-flash", "state": "x " * 3000, "questions": {"q": {"type": "noul"}}}
    strict = Decider(
        decider.config, decider.trunk, decider.head, decider.tokenizer, type(decider.options)(max_length=2000)
    )
    with pytest.raises(RequestTooLongError) as info:
        strict.decide(request)
    assert info.value.max_tokens == 2000 and info.value.input_tokens > 2000
    assert str(info.value.input_tokens) in str(info.value)
    lenient = Decider(
        decider.config,
        decider.trunk,
        decider.head,
        decider.tokenizer,
        type(decider.options)(max_length=2000, state_overflow="truncate"),
    )
    body = lenient.decide(request)
    assert body["usage"]["input_tokens"] == 2000
    assert body["x_truncated_state_tokens"] == info.value.input_tokens - 2000
    del body["x_truncated_state_tokens"]
    assert_same_response(body, reference, request, max_length=2000)


# ---- the head's sums: the same bits on every run ------------------------------------------------------------
@pytest.mark.parametrize("values_shape", [(), (5,)], ids=["vector", "rows"])
def test_the_heads_sums_as_a_product_are_index_adds_sums(values_shape):
    """The GPU's way of summing the head's spans and options (a 0/1 matrix product: index_add_ adds with atomics
    there, so the last bits changed from run to run), run on the CPU: index_add_'s sums to fp32 rounding,
    repeated and absent indices included; the CPU itself keeps index_add_'s bits."""
    from clef_cuda.model.head import add_by_index

    generator = torch.Generator().manual_seed(3)
    index = torch.tensor([4, 0, 4, 4, 2, 0, 6])
    values = torch.randn(7, *values_shape, generator=generator)
    out = torch.randn(8, *values_shape, generator=generator)
    expected = out.clone().index_add_(0, index, values)
    torch.testing.assert_close(add_by_index(out.clone(), index, values, by_product=True), expected)
    assert torch.equal(add_by_index(out.clone(), index, values), expected)


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_available(), reason="needs a GPU and the CUDA build")
def test_a_record_gets_the_same_bits_on_every_run_on_the_gpu():
    """On an H200 two runs of one Decider differed by 1.8e-7 (2026-12-04) while the head summed with index_add_."""
    decider = Decider.from_release(mid_release(), device="cuda", progress=False)
    records = [decider.encode(random_request(random.Random(seed), state_words=(20, 300))) for seed in range(4)]
    first = [decider.probabilities(record) for record in records]
    for _ in range(3):
        assert [decider.probabilities(record) for record in records] == first
