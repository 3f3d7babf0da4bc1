"""training/: the trainable clef-tiny is the serving math (references + autograd against the Decider's
kernels and caches, healthy and with the seed's bug injected), training is deterministic, resumes from a
checkpoint to the same weights, and writes a release the server loads; its tokenizer spells a name the same
wherever it stands; the HTTP evaluation harness scores a release through the real server path. The task
generator has its own tests (tests/test_vocabulary.py)."""

from __future__ import annotations

import functools
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from faults import KeyBandZeroedOps

from clef_cuda import Decider
from clef_cuda.model.head import RecordLayout
from training import evaluate, train, vocabulary
from training.model import TrainableClef

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def trained() -> Path:
    """A release from a 3-step training run (the pipeline end to end, not a useful model)."""
    return _trained_once()


@functools.cache
def _trained_once() -> Path:
    """Once a process, not once a module: under `--dist worksteal` a worker may run this module's tests apart, and a
    module fixture is set up again each time (three 10 s runs in one suite)."""
    return _train_three_steps(Path(tempfile.mkdtemp(prefix="clef-tiny-trained-")))


def _train_three_steps(out: Path, *extra: str) -> Path:
    """Three steps of each phase (or what `extra` says instead)."""
    _train(out, *extra)
    return out


def _train(out: Path, *extra: str) -> str:
    """training.train as _train_three_steps runs it; its standard output."""
    command = [sys.executable, "-m", "training.train", "--out", str(out), "--lm-steps", "3", "--steps", "3"]
    command += ["--eval-every", "2", "--eval-count", "8", *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout


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
        example = vocabulary.make_example(rng, split)
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
    _train_three_steps(tmp_path / "again")
    for name in ("model.safetensors", "joint_head.safetensors", "tokenizer.json", "config.json"):
        assert (trained / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name


def test_a_resumed_run_writes_the_same_weights(tmp_path):
    """A run checkpointed in its language-model phase, resumed across the switch to the decision phase."""
    schedule = ("--lm-steps", "3", "--steps", "1", "--checkpoint-every", "2")
    checkpoint = tmp_path / "run.ckpt"
    whole = _train_three_steps(tmp_path / "whole", *schedule, "--checkpoint", str(checkpoint))
    assert torch.load(checkpoint, weights_only=False)["phase"] == "lm"  # its last checkpoint: LM step 2
    resumed = tmp_path / "resumed"
    assert f"resumed from {checkpoint}: lm step 2" in _train(resumed, *schedule, "--checkpoint", str(checkpoint))
    for name in ("model.safetensors", "joint_head.safetensors"):
        assert (whole / name).read_bytes() == (resumed / name).read_bytes(), name
    summary = json.loads((resumed / "TRAINING.json").read_text())
    assert [h["step"] for h in summary["history"] if h["phase"] == "lm"] == [2, 3]


def test_a_checkpoint_of_another_schedule_is_refused(tmp_path):
    checkpoint = tmp_path / "run.ckpt"
    _train_three_steps(tmp_path / "first", "--checkpoint-every", "2", "--checkpoint", str(checkpoint))
    command = [sys.executable, "-m", "training.train", "--out", str(tmp_path / "x"), "--checkpoint", str(checkpoint)]
    done = subprocess.run(command + ["--lm-steps", "4"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 2 and "another schedule" in done.stderr


@pytest.mark.parametrize("name", ["kelvara", "Cobalt Notes", "vault-7", "Team Zelka"])
def test_a_name_is_the_same_ids_in_the_state_and_in_its_option(trained, name):
    """Merges never cross a letter boundary, so the trunk can match an option to its occurrences."""
    from clef_cuda.request.encoding import Tokenizer

    tokenizer = Tokenizer.from_release(trained)
    alone = tokenizer.encode(name)
    for before in (" ", "(", "[", "=", '"', "\n", ": ", "?"):
        assert tokenizer.encode(before + name)[-len(alone) :] == alone, repr(before + name)


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
    asked = {qid for example in examples for qid in example.answers}
    assert {evaluate.group(qid) for qid in asked} == {"structural", "semantic"}
    rng = random.Random(14)
    generated = {vocabulary.make_example(rng, split).request["state"] for split in ("train", "heldout") * 500}
    assert not generated & {e.request["state"] for e in examples}
