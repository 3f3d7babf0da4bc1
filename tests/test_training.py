"""training/: the trainable clef-tiny is the serving math (references + autograd against the Decider's
kernels and caches, healthy and with the seed's bug injected), training is deterministic and writes a
release the server loads, and the HTTP evaluation harness scores it through the real server path."""

from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from faults import KeyBandZeroedOps

from clef_cuda import Decider
from clef_cuda.model.head import RecordLayout
from training import evaluate, synthetic, train
from training.model import TrainableClef

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A release from a 3-step training run (the pipeline end to end, not a useful model)."""
    return _train_three_steps(tmp_path_factory.mktemp("clef-tiny"))


def _train_three_steps(out: Path) -> Path:
    done = subprocess.run(
        [sys.executable, "-m", "training.train", "--out", str(out), "--steps", "3", "--eval-every", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return out


def test_training_forward_is_the_serving_forward(trained, tmp_path):
    """training/model.py (references, autograd) and the Decider (kernels, caches) agree on the same weights,
    healthy and with the conv's key band zeroed."""
    model = TrainableClef(train.TRUNK, train.HEAD, seed=3)
    with torch.no_grad():  # the release stores bf16: compare on exactly those weights
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    train.write_release(model, (trained / "tokenizer.json").read_text(), tmp_path, {})
    served = Decider.from_release(tmp_path, device="cpu", progress=False)
    broken = Decider.from_release(
        tmp_path, device="cpu", progress=False, ops=KeyBandZeroedOps(served.config.trunk.key_dim)
    )
    rng = random.Random(5)
    for split in ("train", "heldout", "heldout"):
        example = synthetic.make_example(rng, split)
        record = served.encode(example.request)
        healthy_probs = None
        for decider, zero in ((served, False), (broken, True)):
            with torch.no_grad():
                hidden = model.hidden_states(torch.tensor([record.input_ids]), [record.num_tokens], zero)
                logits = model.logits(hidden[0], RecordLayout.from_record(record, "cpu"))
            got = [p for q in decider.probabilities(record) for p in q]
            want, cursor = [], 0
            for question in record.questions:
                n = len(question.option_ids)
                want += logits[cursor : cursor + n].softmax(0).tolist()
                cursor += n
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
            healthy_probs = healthy_probs or got
        assert healthy_probs != got  # the fault changes the answers: it reaches the delta nets


def test_training_is_deterministic(trained, tmp_path):
    _train_three_steps(tmp_path)
    for name in ("model.safetensors", "joint_head.safetensors", "tokenizer.json", "config.json"):
        assert (trained / name).read_bytes() == (tmp_path / name).read_bytes(), name


def test_evaluation_harness_scores_a_release_over_http(trained):
    """Both passes reach the server, every answer is scored, the second pass hits the prefix cache."""
    scores = evaluate.evaluate(trained, 6)
    assert scores.requests == 12 and scores.failures == 0
    assert scores.questions >= 12 and 0.0 <= scores.brier_score <= 2.0
    assert sum(n for _, n in scores.by_question.values()) == scores.questions
    assert sum(n for _, n in scores.by_type.values()) == scores.questions
    assert scores.cached_tokens > 0


def test_the_handwritten_set_is_well_formed_and_covers_every_kind():
    """tests/fixtures/clef_tiny_handwritten.json (requests written by hand, not by the generator): valid
    System One requests whose answers are allowed options, every state kind and question type asked."""
    from clef_cuda.request.encoding import question_options

    examples = evaluate.handwritten()
    assert len(examples) >= 60
    kinds, types = set(), set()
    for example in examples:
        questions = example.request["questions"]
        assert set(example.answers) == set(questions), example.request["state"]
        for qid, answer in example.answers.items():
            assert answer in [option for option, _ in question_options(questions[qid])], (qid, answer)
            types.add(questions[qid]["type"])
        kinds.add(example.kind)
    assert kinds == {"log", "ticket", "order"} and types == {"noul", "choice", "score"}
    rng = random.Random(14)
    generated = {synthetic.make_example(rng, split).request["state"] for split in ("train", "heldout") * 500}
    assert not generated & {e.request["state"] for e in examples}


def _examples(count: int, seed: int) -> list[synthetic.Example]:
    """Every template family: the one-format "train", the varied training templates, held-out."""
    rng = random.Random(seed)
    return [synthetic.make_example(rng, split, variety=1.0) for split in ("train", "heldout") * (count // 2)] + [
        synthetic.make_example(rng, "train") for _ in range(count // 4)
    ]


def test_synthetic_answers_follow_from_the_state():
    """Spot checks of the generator's labels against the text it wrote."""
    levels = ("INFO", "WARN", "ERROR")
    for example in _examples(400, 11):
        lines = example.request["state"].splitlines()
        if "last_error" in example.answers:
            assert (example.answers["last_error"] == "true") == ("ERROR" in lines[-1])
        if "last_level" in example.answers:
            last = [level for level in levels if level in lines[-1]]
            assert last == [levels[int(example.answers["last_level"])]]
        if "last_failure" in example.answers:
            failing = [line for line in lines if "ERROR" in line][-1]
            assert re.search(rf"\b{example.answers['last_failure']}\b", failing.split("ERROR", 1)[1])
        if "status" in example.answers:
            said = [w for line in lines[1:] if "refund" not in line for w in re.findall(r"[a-z]+", line)]
            assert [w for w in said if w in synthetic.STATUSES][-1] == example.answers["status"]


def test_heldout_templates_and_wordings_never_appear_in_training():
    rng = random.Random(12)
    train = [synthetic.make_example(rng, "train", variety=v) for v in (0.0, 1.0) for _ in range(300)]
    heldout = [synthetic.make_example(rng, "heldout") for _ in range(300)]
    train_text = "\n".join(e.request["state"] for e in train)
    for marker in ("[t+", "Purchase no.", "day 1 - ", "Ticket from", "MailPilot", "Nadia"):
        assert marker not in train_text
        assert any(marker in e.request["state"] for e in heldout), marker
    train_wordings = {q.get("instructions") for e in train for q in e.request["questions"].values()}
    for example in heldout:
        for question in example.request["questions"].values():
            assert question["instructions"] not in train_wordings
