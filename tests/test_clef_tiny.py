"""The shipped clef-tiny (the embedded default model, clef_cuda/assets/clef-tiny) decides, through the real
server path: structural questions (read from the state's structure, whatever its names and formats) on
the generator's vocabulary-disjoint held-out family and on requests written by hand, semantic ones
(department) scored apart, calibration over HTTP, the seed's bug (the conv's key band zeroed) costing at
least 20 points, golden answers pinned, and the README's curl example answering as printed.

A kernel or engine change that shifts the shipped model's decisions fails here. If the change is right
and the model is retrained (training/README.md), regenerate the golden answers with
`python -m training.evaluate --write-golden tests/golden/clef_tiny.json` and say why in the commit.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import httpx
import pytest
from live import clef_serve_process

from clef_cuda import Decider
from clef_cuda.model import default_model
from clef_cuda.model.config import FULL_ATTENTION, LINEAR_ATTENTION, load_release_config
from training import evaluate

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden" / "clef_tiny.json"
COUNT = 150  # held-out examples; each is asked twice (all its questions, then the last one alone)
# Floors, a few points (two or more flipped answers) under the shipped model's measurements in
# training/README.md: the held-out family (these 150 examples: 369 structural questions) and the 64
# hand-written requests (193). The targets (structural >= 90% hand-written, >= 95% held-out,
# >= 85% every structural question) are not met; training/README.md says where and why.
HELDOUT_STRUCTURAL = 0.82  # measured 0.851
HANDWRITTEN_STRUCTURAL = 0.85  # measured 0.886
STRUCTURAL_QUESTION_FLOORS = {  # the lower of the two sets' measurements, less two or more flips
    "customer": 0.75,  # 0.826 held-out, 1.000 hand-written
    "last_error": 0.78,  # 0.878, 0.852
    "last_failure": 0.30,  # 0.394 (13 of 33), 0.542 (13 of 24): the weakest, see training/README.md
    "last_level": 0.82,  # 0.929, 0.906
    "late_refund": 0.92,  # 1.000, 1.000
    "product": 0.68,  # 0.761, 0.789
    "status": 0.92,  # 1.000, 1.000
    "urgency": 0.80,  # 0.885, 1.000
}
HELDOUT_SEMANTIC = 0.65  # department, measured 0.741 (3 or 4 teams offered: chance ~0.3)
HANDWRITTEN_SEMANTIC = 0.80  # measured 0.950 (20 questions)
BRIER = 0.29  # measured 0.243 (uniform guessing ~0.6)
ECE = 0.10  # measured 0.065
PROBABILITY_TOLERANCE = 2e-3  # fp32 CPU kernels; a real shift in a decision moves far more
LOG_PROBABILITY_TOLERANCE = 2e-2  # nats; fp32 kernel differences between CPUs are ~1e-4


@pytest.fixture(scope="module")
def healthy() -> evaluate.Scores:
    return evaluate.evaluate(default_model.default_release(), COUNT)


@pytest.fixture(scope="module")
def key_band_zeroed() -> evaluate.Scores:
    return evaluate.evaluate(default_model.default_release(), COUNT, key_band_zeroed=True)


@pytest.fixture(scope="module")
def handwritten() -> evaluate.Scores:
    return evaluate.evaluate(default_model.default_release(), examples=evaluate.handwritten())


@pytest.fixture(scope="module")
def clef_serve():
    """clef-serve with no --w, as an operator starts it: the embedded default model."""
    with clef_serve_process("--d", "cpu", "--kv-fraction", "0.05") as (url, _, output):
        yield url, output


def test_the_shipped_release_is_small_and_in_the_clef_flash_architecture():
    release = default_model.default_release()
    size = sum(f.stat().st_size for f in release.iterdir())
    assert size <= 20 * 2**20, f"{size} bytes"
    trunk = load_release_config(release).trunk
    assert trunk.layer_types.count(LINEAR_ATTENTION) >= 3 and trunk.layer_types.count(FULL_ATTENTION) == 2
    summary = json.loads((release / "TRAINING.json").read_text())
    assert summary["completed"], "the shipped model must come from a full, reproducible schedule"
    assert summary["minutes"] <= 90


def _structural_floors(scores: evaluate.Scores, floor: float, name: str) -> None:
    assert scores.failures == 0
    assert scores.group_accuracy("structural") >= floor, evaluate.table(scores, scores, name)
    for question_id, (correct, asked) in scores.by_question.items():
        if evaluate.group(question_id) == "structural":
            assert correct / asked >= STRUCTURAL_QUESTION_FLOORS[question_id], (name, question_id, correct, asked)


def test_structural_questions_on_the_disjoint_heldout_family(healthy):
    """Names, messages, formats and wordings training never showed (training/vocabulary.py)."""
    _structural_floors(healthy, HELDOUT_STRUCTURAL, f"{COUNT} held-out examples")
    assert healthy.brier_score <= BRIER, healthy.brier_score
    assert healthy.expected_calibration_error <= ECE, healthy.expected_calibration_error
    assert healthy.group_accuracy("semantic") >= HELDOUT_SEMANTIC, healthy.by_group
    assert healthy.cached_tokens > 0  # the second pass went through the prefix cache


def test_structural_questions_on_the_handwritten_requests(handwritten):
    """tests/fixtures/clef_tiny_handwritten.json: other people's formats, names and wordings."""
    _structural_floors(handwritten, HANDWRITTEN_STRUCTURAL, "64 hand-written examples")
    assert handwritten.group_accuracy("semantic") >= HANDWRITTEN_SEMANTIC, handwritten.by_group


def test_the_seeds_key_band_bug_costs_at_least_20_points(healthy, key_band_zeroed):
    assert key_band_zeroed.failures == 0  # well-formed answers: exactly the failure a 200 hides
    drop = healthy.accuracy - key_band_zeroed.accuracy
    assert drop >= 0.20, evaluate.table(healthy, key_band_zeroed, f"{COUNT} held-out examples")
    # The structural floor above tells the two apart: the bug's answers fall far below it.
    assert key_band_zeroed.group_accuracy("structural") < HELDOUT_STRUCTURAL - 0.2


def _assert_same_answers(got: dict, expected: dict, where: str) -> None:
    assert list(got) == list(expected), where
    for qid, want in expected.items():
        have = got[qid]
        assert have["type"] == want["type"], (where, qid)
        if want["type"] == "choice":
            assert have["choice"] == want["choice"], (where, qid, have, want)
        for key in ("noul", "score", "confidence"):
            if key in want:
                assert have[key] == pytest.approx(want[key], abs=PROBABILITY_TOLERANCE * 3), (where, qid, key)
        for option, p in want.get("probabilities", {}).items():
            assert have["probabilities"][option] == pytest.approx(p, abs=PROBABILITY_TOLERANCE), (where, qid)


def test_golden_answers(clef_serve):
    url, _ = clef_serve
    cases = json.loads(GOLDEN.read_text())
    assert len(cases) >= 4
    for case in cases:
        response = httpx.post(f"{url}/v1/systemone", json=case["request"], timeout=60)
        assert response.status_code == 200, response.text
        _assert_same_answers(response.json()["answers"], case["answers"], case["name"])


def test_golden_log_probabilities_in_process():
    """The same requests through the Decider, unrounded: shifts the rounded answers hide (p near 0 or 1)."""
    decider = Decider.from_release(default_model.default_release(), device="cpu", progress=False)
    for case in json.loads(GOLDEN.read_text()):
        got = decider.probabilities(decider.encode(case["request"]))
        for question, want in zip(got, case["log_probabilities"], strict=True):
            have = [math.log(max(p, 1e-30)) for p in question]
            assert have == pytest.approx(want, abs=LOG_PROBABILITY_TOLERANCE), case["name"]


def test_the_upstream_reference_decides_like_us_on_the_shipped_model(tmp_path):
    """clef-tiny is a release the upstream code reads (given the processor files its loader needs): same ids
    and spans, probabilities within the parity bound (tests/parity.py), on the golden requests and held-out
    examples."""
    import shutil

    from releases import fast_tokenizer, reference_model, save_processor
    from test_decider import check_against_reference
    from tokenizers import Tokenizer

    shipped = default_model.default_release()
    release = tmp_path / "clef-tiny"
    shutil.copytree(shipped, release)
    save_processor(release, fast_tokenizer(Tokenizer.from_file(str(shipped / "tokenizer.json"))))
    shutil.copy(shipped / "tokenizer.json", release / "tokenizer.json")  # ours, byte for byte
    reference = reference_model(release)
    decider = Decider.from_release(shipped, device="cpu", progress=False)
    for request in [r for _, r, _ in evaluate.GOLDEN_REQUESTS] + [e.request for e in evaluate.heldout(12)]:
        check_against_reference(decider, reference, request)


def _readme_example(name: str = "readme-example", document: str = "README.md") -> tuple[dict, dict, str]:
    """The request, the response and the route of a curl example in `document` (`<!-- NAME -->` above it)."""
    text = (ROOT / document).read_text()
    block = re.search(rf"<!-- {name} -->\s*```\n(.*?)```", text, re.S)
    assert block, f"{document} lost its <!-- {name} --> block"
    request = re.search(r"-d '(.*?)'\n", block.group(1), re.S)
    route = re.search(r"curl -s localhost:8080(\S+)", block.group(1)).group(1)
    response = block.group(1).strip().splitlines()[-1]
    return json.loads(request.group(1)), json.loads(response), route


def test_readme_curl_example_answers_as_printed(clef_serve):
    url, output = clef_serve
    request, printed, route = _readme_example()
    assert route == "/v1/systemone"
    response = httpx.post(f"{url}{route}", json=request, timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == printed["model"] == default_model.NAME
    assert body["usage"] == printed["usage"]
    _assert_same_answers(body["answers"], printed["answers"], "README")
    assert any("EMBEDDED DEMO MODEL" in line for line in output)  # announced loudly at start-up


def test_the_sdk_example_prints_what_clients_md_says(clef_serve):
    """docs/clients.md's typesafe-sdk example (a noul, a choice and a score), run as written but for the base URL,
    prints the line printed below it: the choice exactly, each probability and the score within the parity
    bound of the printed value plus half its last digit."""
    import contextlib
    import io

    url, _ = clef_serve
    text = (ROOT / "docs" / "clients.md").read_text()
    block = re.search(r"<!-- sdk-example -->\s*```python\n(.*?)```\n\nprints .*?```\n(.*?)\n```", text, re.S)
    assert block, "docs/clients.md lost its <!-- sdk-example --> block"
    code, printed = block.group(1), block.group(2).split()
    assert code.count('base_url="http://localhost:8080"') == 1
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code.replace("http://localhost:8080", url), "clients.md sdk-example", "exec"), {})
    got = out.getvalue().split()
    assert len(got) == len(printed) == 3, (got, printed)
    assert got[1] == printed[1]
    for ours, theirs in ((got[0], printed[0]), (got[2], printed[2])):
        assert abs(float(ours) - float(theirs)) <= 0.5e-4 + 1e-5, (got, printed)


def test_readme_workers_ai_example_answers_as_printed(clef_serve):
    """docs/clients.md's "switch from Workers AI" example: the same route, envelope and hosted confidence."""
    url, _ = clef_serve
    request, printed, route = _readme_example("readme-example: workers-ai", "docs/clients.md")
    assert route.startswith("/client/v4/accounts/") and route.endswith(f"/@cf/cloudflare/{default_model.NAME}")
    response = httpx.post(f"{url}{route}", json=request, timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["success"] is True and body["errors"] == [] == printed["errors"]
    assert body["result"]["usage"] == printed["result"]["usage"]
    _assert_same_answers(body["result"]["answers"], printed["result"]["answers"], "README (Workers AI)")
