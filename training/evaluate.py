#!/usr/bin/env python3
"""How well clef-tiny decides, measured through the real server path: HTTP to a live clef-serve app, the
engine's batching and prefix cache, the clef_cuda kernels. Prints a table: held-out accuracy, Brier score
and calibration, healthy and with the seed's bug (the conv's key band zeroed by test-only fault injection),
with structural questions (read from the state's structure: logs, orders, urgency, products, customers) and
semantic ones (department: known only through the generator's words) scored apart.

    python -m training.evaluate --release /tmp/clef-tiny --count 300
    python -m training.evaluate --write-golden tests/golden/clef_tiny.json   # the shipped model's answers

Each held-out example is asked twice: once with all its questions (concurrent requests: the engine batches
them), then its state again with only its last question (the engine finds the state in the prefix cache).
tests/test_training.py checks the harness itself.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from training import vocabulary

# Two sets of the held-out family (never trained on: its names, messages, formats and wordings are
# training's disjoint counterparts, training/vocabulary.py). train.py reports on the first while training,
# so it guided the task's design (a development set); the numbers we publish and test come from the
# second, which nothing was tuned on.
HELDOUT_SEED = 10_000  # train.py: args.seed + 10_000
TEST_SEED = 20_261_201


@dataclass
class Scores:
    questions: int = 0
    correct: int = 0
    brier: float = 0.0  # summed over questions: sum_k (p_k - [k is right])^2
    confidence_bins: list[list[float]] = field(default_factory=lambda: [[0.0, 0.0, 0.0] for _ in range(10)])
    by_question: dict[str, list[int]] = field(default_factory=dict)  # question id -> [correct, asked]
    by_type: dict[str, list[int]] = field(default_factory=dict)  # noul | choice | score -> [correct, asked]
    by_group: dict[str, list[int]] = field(default_factory=dict)  # structural | semantic -> [correct, asked]
    cached_tokens: int = 0
    input_tokens: int = 0
    requests: int = 0
    failures: int = 0  # non-200 answers

    @property
    def accuracy(self) -> float:
        return self.correct / max(self.questions, 1)

    @property
    def brier_score(self) -> float:
        return self.brier / max(self.questions, 1)

    @property
    def expected_calibration_error(self) -> float:
        """|mean confidence - accuracy| in ten bins of the top probability, weighted by bin size."""
        total = sum(b[0] for b in self.confidence_bins)
        return sum(abs(b[1] - b[2]) for b in self.confidence_bins if b[0]) / max(total, 1)

    def add(self, question_id: str, question_type: str, distribution: dict[str, float], answer: str) -> None:
        predicted = max(distribution, key=distribution.get)
        right = predicted == answer
        self.questions += 1
        self.correct += right
        self.brier += sum((p - (option == answer)) ** 2 for option, p in distribution.items())
        top = distribution[predicted]
        bin_ = self.confidence_bins[min(int(top * 10), 9)]
        bin_[0], bin_[1], bin_[2] = bin_[0] + 1, bin_[1] + top, bin_[2] + right
        for tally in (
            self.by_question.setdefault(question_id, [0, 0]),
            self.by_type.setdefault(question_type, [0, 0]),
            self.by_group.setdefault(group(question_id), [0, 0]),
        ):
            tally[0], tally[1] = tally[0] + right, tally[1] + 1

    def group_accuracy(self, name: str) -> float:
        correct, asked = self.by_group.get(name, [0, 0])
        return correct / max(asked, 1)


def group(question_id: str) -> str:
    """structural (read from the state, whatever its names and format), semantic (needs the meaning of
    words, which a model knows only as far as its generator used them) or other."""
    if question_id in vocabulary.STRUCTURAL:
        return "structural"
    return "semantic" if question_id in vocabulary.SEMANTIC else "other"


def distribution(answer: dict) -> dict[str, float]:
    """The probability of every option of one answer of the System One response."""
    if answer["type"] == "noul":
        return {"true": answer["noul"], "false": 1.0 - answer["noul"]}
    return dict(answer["probabilities"])


def heldout(count: int, seed: int = TEST_SEED) -> list[vocabulary.Example]:
    """The generator's held-out family: names, messages, formats and wordings training never shows."""
    return vocabulary.dataset(seed, count, "heldout")


# Requests written by hand, without the generator, with their right answers (the README's example first):
# other people's log formats, tickets and orders. Neither training nor its development set sees them.
HANDWRITTEN = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "clef_tiny_handwritten.json"


def handwritten() -> list[vocabulary.Example]:
    cases = json.loads(HANDWRITTEN.read_text())
    return [vocabulary.Example(request=c["request"], answers=c["answers"], kind=c["kind"]) for c in cases]


def ask_all(url: str, examples: list[vocabulary.Example], model: str, concurrency: int = 8) -> Scores:
    """Both passes over the examples against a live server; every answer scored."""
    import httpx

    scores = Scores()

    def post(client: httpx.Client, request: dict) -> dict | None:
        response = client.post(f"{url}/v1/systemone", json=request, timeout=120)
        return response.json() if response.status_code == 200 else None

    def last_question_only(example: vocabulary.Example) -> tuple[dict, dict[str, str]]:
        qid = list(example.request["questions"])[-1]
        request = dict(example.request, questions={qid: example.request["questions"][qid]})
        return request, {qid: example.answers[qid]}

    # The passes go a group of `concurrency` examples at a time: the second pass then finds its states in
    # the prefix cache (over the whole set, the cache's least-recently-used entries would be gone).
    groups = [examples[i : i + concurrency] for i in range(0, len(examples), concurrency)]
    with httpx.Client() as client, concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for pass_ in (
            passes
            for group in groups
            for passes in (
                [(dict(e.request, model=model), e.answers) for e in group],
                [(dict(r, model=model), a) for r, a in map(last_question_only, group)],
            )
        ):
            for (request, answers), body in zip(pass_, pool.map(lambda p: post(client, p[0]), pass_), strict=True):
                scores.requests += 1
                if body is None:
                    scores.failures += 1
                    continue
                for qid, answer in body["answers"].items():
                    scores.add(qid, request["questions"][qid]["type"], distribution(answer), answers[qid])
                scores.cached_tokens += body.get("x_cached_tokens", 0)
                scores.input_tokens += body["usage"]["input_tokens"]
    return scores


def _tests_on_path() -> None:
    """The harness borrows two test helpers (tests/live.py's server, tests/faults.py's fault)."""
    tests = str(Path(__file__).resolve().parents[1] / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)


@contextlib.contextmanager
def serving(release: Path, ops=None, prefix_cache: bool = True, quantize: str = "none"):
    """A live clef-serve app on 127.0.0.1 over `release` (with `ops` swapped in for fault injection). A
    fault makes the on-device self-check fail, which would keep the server unready; to measure what the
    fault would have answered, that server runs with --selfcheck warn and shadow verification off (as the
    seed had no check at all)."""
    _tests_on_path()
    from live import live_server

    from app.server import ServerSettings
    from clef_cuda import Decider
    from clef_cuda.serving.engine import Engine, EngineConfig
    from clef_cuda.verification.shadow import ShadowConfig

    decider = Decider.from_release(release, device="cpu", progress=False, ops=ops, quantize=quantize)
    # Snapshots from 32 saved tokens on: held-out states are short, and the second pass should find them.
    # With a fault, shadow verification is off too: it would (rightly) stop the server at its first sample.
    shadow = ShadowConfig(mode="off") if ops is not None else ShadowConfig()
    config = EngineConfig(kv_fraction=0.05, prefix_cache=prefix_cache, min_snapshot_tokens=32, shadow=shadow)
    engine = Engine(decider, config)
    settings = ServerSettings(served_model_name="clef-tiny", selfcheck="enforce" if ops is None else "warn")
    with live_server(engine, settings) as (url, _):
        yield url, decider


def evaluate(
    release: Path,
    count: int = 300,
    key_band_zeroed: bool = False,
    examples: list[vocabulary.Example] | None = None,
    quantize: str = "none",
) -> Scores:
    """`examples` (default: `count` of the generator's held-out family) asked through a live server
    (serving the release's weights as they are, or as int8 with quantize="int8")."""
    ops = None
    if key_band_zeroed:
        _tests_on_path()
        from faults import KeyBandZeroedOps

        from clef_cuda.model.config import load_release_config

        ops = KeyBandZeroedOps(load_release_config(release).trunk.key_dim)
    with serving(release, ops, quantize=quantize) as (url, _):
        return ask_all(url, heldout(count) if examples is None else examples, "clef-tiny")


# Hand-written requests in the task's domain (not from the generator) with their right answers: the README's
# example is the first. `--write-golden` records what the model answers to them; tests/test_clef_tiny.py
# pins those answers.
GOLDEN_REQUESTS = [
    (
        "readme-log",
        {
            "model": "clef-tiny",
            "state": "09:12:01 INFO api: request served\n09:12:04 ERROR db: connection refused\n"
            "09:12:09 WARN cache: high latency\n09:12:15 ERROR queue: write failed",
            "questions": {
                "last_error": {"type": "noul", "instructions": "Is the last log line an ERROR?"},
                "last_failure": {
                    "type": "choice",
                    "instructions": "Which component logged the latest ERROR?",
                    "criteria": {"db": None, "api": None, "cache": None, "queue": None, "auth": None},
                },
                "last_level": {"type": "score", "criteria": ["info", "warning", "error"]},
            },
        },
        {"last_error": "true", "last_failure": "queue", "last_level": "2"},
    ),
    (
        "ticket",
        {
            "model": "clef-tiny",
            "state": "Hi, this is Sam. The tracking number does not work. I need this fixed right now, it is urgent.",
            "questions": {
                "department": {
                    "type": "choice",
                    "instructions": "Which team should handle this ticket?",
                    "criteria": {"billing": None, "technical": None, "shipping": None, "sales": None},
                },
                "urgency": {"type": "score", "criteria": ["low", "medium", "high"]},
            },
        },
        {"department": "shipping", "urgency": "2"},
    ),
    (
        "order",
        {
            "model": "clef-tiny",
            "state": "Order 4411 (desk)\n2026-11-02 placed\n2026-11-03 paid\n2026-11-05 shipped\n"
            "2026-11-08 delivered\n2026-11-09 refund requested",
            "questions": {
                "status": {
                    "type": "choice",
                    "instructions": "What is the current order status?",
                    "criteria": {s: None for s in vocabulary.STATUSES},
                },
                "late_refund": {"type": "noul", "instructions": "Was a refund requested after delivery?"},
            },
        },
        {"status": "delivered", "late_refund": "true"},
    ),
    (
        "quiet-log",
        {
            "model": "clef-tiny",
            "state": "10:01:00 INFO auth: worker started\n10:01:03 ERROR api: timeout after 30s\n"
            "10:01:07 INFO api: health check ok",
            "questions": {
                "last_error": {"type": "noul", "instructions": "Does the log end with an ERROR line?"},
                "last_level": {"type": "score", "criteria": ["info", "warning", "error"]},
            },
        },
        {"last_error": "false", "last_level": "0"},
    ),
]


def write_golden(release: Path, path: Path) -> None:
    """Ask the golden requests through a live server; refuse (exit 1) if any answer is wrong."""
    import math

    import httpx

    cases, wrong = [], []
    with serving(release) as (url, decider):
        for name, request, right in GOLDEN_REQUESTS:
            response = httpx.post(f"{url}/v1/systemone", json=request, timeout=60)
            response.raise_for_status()
            answers = response.json()["answers"]
            # Unrounded log-probabilities too: near 0 and 1 the rounded answers cannot show a small shift.
            log_probabilities = [
                [round(math.log(max(p, 1e-30)), 4) for p in question]
                for question in decider.probabilities(decider.encode(request))
            ]
            for qid, option in right.items():
                probabilities = distribution(answers[qid])
                if max(probabilities, key=probabilities.get) != option:
                    wrong.append(f"{name}/{qid}: expected {option}, got {answers[qid]}")
            cases.append({"name": name, "request": request, "answers": answers, "log_probabilities": log_probabilities})
    if wrong:
        raise SystemExit("golden requests answered wrongly, not written:\n  " + "\n  ".join(wrong))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cases, indent=1) + "\n")
    print(f"wrote {len(cases)} golden cases to {path}")


def table(healthy: Scores, broken: Scores, examples: str) -> str:
    """Healthy against key-band-zeroed: overall, per question kind and per question id; `examples` names
    the set."""
    rows = [
        f"| clef-tiny over HTTP, {examples} | questions | accuracy | Brier | ECE | prefix-cached tokens | non-200 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in (("healthy kernels", healthy), ("conv key band zeroed (the seed's bug)", broken)):
        rows.append(
            f"| {name} | {s.questions} | {s.accuracy:.3f} | {s.brier_score:.3f} | "
            f"{s.expected_calibration_error:.3f} | {s.cached_tokens / max(s.input_tokens, 1):.0%} | {s.failures} |"
        )
    rows += ["", "| question | healthy | key band zeroed |", "|---|---|---|"]
    for label, tallies in (("", "by_group"), ("kind", "by_type"), ("", "by_question")):
        h_tally, b_tally = getattr(healthy, tallies), getattr(broken, tallies)
        for key in sorted(h_tally):
            h, b = h_tally[key], b_tally.get(key, [0, 1])
            name = f"{label} {key}" if label else key
            rows.append(f"| {name} | {h[0] / h[1]:.3f} ({h[1]}) | {b[0] / b[1]:.3f} |")
    rows.append("")
    rows.append(
        f"{examples}, each asked twice (all questions, then the last one alone). Accuracy drop with the key "
        f"band zeroed: {100 * (healthy.accuracy - broken.accuracy):.1f} points."
    )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--release", type=Path, help="a release written by training.train (default: the shipped clef-tiny)"
    )
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--write-golden", type=Path, help="write the golden answers there instead of evaluating")
    parser.add_argument("--quantize", choices=["none", "int8"], default="none", help="serve the weights as int8")
    args = parser.parse_args(argv)
    from clef_cuda.errors import ReleaseError
    from clef_cuda.model import default_model
    from clef_cuda.model.config import load_release_config

    release = args.release or default_model.default_release()
    try:
        load_release_config(release)
    except ReleaseError as error:
        parser.exit(2, f"training.evaluate: error: --release: {error}\n")
    if args.write_golden:
        write_golden(release, args.write_golden)
        return 0
    sets = {
        f"{args.count} held-out examples": heldout(args.count),
        f"{len(handwritten())} hand-written examples": handwritten(),
    }
    for name, examples in sets.items():
        healthy = evaluate(release, examples=examples, quantize=args.quantize)
        broken = evaluate(release, key_band_zeroed=True, examples=examples, quantize=args.quantize)
        print(table(healthy, broken, name) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
