#!/usr/bin/env python3
"""Train clef-tiny: a small model in the clef-flash architecture on the vocabulary-disjoint decision task
(training/vocabulary.py), on the CPU, deterministically (fixed seeds, a fixed thread count, a fixed
number of steps), then write it in the real release layout (config.json, model.safetensors, joint_head*,
tokenizer.json, TRAINING.json).

Two phases. Language-model pre-training of the trunk on the generator's records, each question's
instruction followed by its answer (so the trunk learns to find a name in the state and say it: a copy
circuit, which the decision head alone does not find), then the decision fine-tune of trunk and head.

    python -m training.train --out /tmp/clef-tiny              # the full schedule (training/README.md)
    python -m training.train --out /tmp/t --lm-steps 4 --steps 4   # a smoke run
    python -m training.evaluate --release /tmp/clef-tiny        # accuracy through the real server path

It checkpoints every --checkpoint-every steps (to --checkpoint, default OUT.ckpt; the pre-trained trunk
also to OUT.lm.ckpt) and resumes from there when run again with the same arguments (a checkpoint of the
pre-training phase, with the same pre-training arguments): a resumed run writes the same weights as an
uninterrupted one. Delete the checkpoint to start over.
Trains through the pure-torch references (training/model.py), never the upstream code. Prints per-question
accuracy on fresh training-family examples and on the held-out development set as it goes. The shipped
default model (clef_cuda/assets/clef-tiny) is this command's output with the defaults.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from clef_cuda.model.config import FULL_ATTENTION, LINEAR_ATTENTION, HeadConfig, TrunkConfig
from clef_cuda.model.default_model import SPECIAL_TOKENS, release_config
from clef_cuda.model.head import RecordLayout
from clef_cuda.request.encoding import (
    FIELD_END,
    NOUL_DEFAULTS,
    OPTIONS_HEADER,
    QWEN35_PRETOKENIZE_REGEX,
    SCHEMA_HEADER,
    SYSTEM_PROMPT,
    Tokenizer,
    encode_request,
)
from training import vocabulary
from training.model import TrainableClef

VOCAB = 1024
TRUNK = TrunkConfig(
    hidden_size=128,
    intermediate_size=256,
    # A delta net first (its short conv hands each token its predecessors: the previous-token step of a
    # copy circuit), then attention that can match on it; two of each kind after that.
    layer_types=(LINEAR_ATTENTION, FULL_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION, LINEAR_ATTENTION),
    vocab_size=VOCAB,
    rms_norm_eps=1e-6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rotary_dim=8,
    rope_theta=1e6,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=False,
)
HEAD = HeadConfig(hidden_size=128, width=64, routing_layers=1, layers=1, heads=4, feedforward=128)
LM_STEPS = 4000
STEPS = 1500


# The record scaffolding every request repeats (shared/specs/clef-decision.md section 3), each as one added
# token: spelled by the BPE it is ~70% of a record's tokens ("FIELD" alone is five), which costs every
# training step and fills the delta nets' memories with text that carries no information.
SCAFFOLDING = [
    SYSTEM_PROMPT,
    "STATE:\n",
    SCHEMA_HEADER,
    "\nFIELD ",
    "\nID: ",
    "\nTYPE: ",
    "\nINSTRUCTION: ",
    OPTIONS_HEADER,
    "OPTION ",
    *(f"OPTION {n}: " for n in range(1, 10)),
    FIELD_END,
    "JOINT SCHEMA DECISIONS:",
    '{"option_id":"',
    '{"description":"',
    '","option_id":"',
    '"}',
    *NOUL_DEFAULTS.values(),
]


def build_tokenizer(seed: int) -> str:
    """A byte-level BPE trained on the *training* family only, with merges that never cross a letter
    boundary: a name is then the same ids wherever it stands (" kelvara" in a log line is a space and
    then exactly the ids of "kelvara" in its option), which is what lets the trunk match a name in an
    option to its occurrence in the state. Serving tokenises with Qwen3.5's own pre-tokenizer (which the
    file keeps); with no merge across a letter boundary it gives the same ids. The Qwen special tokens
    and the record scaffolding are added tokens (matched before the pre-tokenizer, as the reference's
    tokenizer does)."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizers import Tokenizer as Backend

    backend = Backend(models.BPE())
    backend.normalizer = normalizers.NFC()
    qwen = pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZE_REGEX), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    letters_apart = pre_tokenizers.Split(Regex(r"[\p{L}\p{M}]+"), behavior="isolated", invert=False)
    backend.pre_tokenizer = pre_tokenizers.Sequence([qwen, letters_apart, byte_level])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - len(SCAFFOLDING),
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(vocabulary.corpus(seed), trainer)
    backend.pre_tokenizer = pre_tokenizers.Sequence([qwen, byte_level])  # what serving applies
    backend.add_tokens([AddedToken(text, normalized=False, special=False) for text in SCAFFOLDING])
    if backend.get_vocab_size(with_added_tokens=True) > VOCAB:
        raise RuntimeError(f"tokenizer has {backend.get_vocab_size(with_added_tokens=True)} ids > {VOCAB}")
    return backend.to_str()


def scaffolding_tokens(tokenizer_json: str) -> list[int]:
    """Tokens of the JSON around every option ({"description":"…","option_id":"…"}), found by encoding
    options made of a marker word and keeping the tokens that spell no part of the marker."""
    from tokenizers import Tokenizer as Backend

    from clef_cuda.request.encoding import render

    backend, marker, ids = Backend.from_str(tokenizer_json), "zqx", set()
    for semantics in ({"option_id": marker}, {"option_id": marker, "description": marker}):
        for token in backend.encode(render(semantics), add_special_tokens=False).ids:
            if not any(ch in backend.id_to_token(token) for ch in marker):
                ids.add(token)
    return sorted(ids)


def unseen_tokens(tokenizer_json: str, seed: int) -> list[int]:
    """Tokens the training text never produces (BPE's intermediate merges, pieces of words only other
    text has): no step ever trains their embeddings, so they start, and stay, at zero (an unknown token is
    then a blank, not a random vector the trunk has never seen)."""
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_str(tokenizer_json)
    produced = {token for text in vocabulary.corpus(seed) for token in backend.encode(text).ids}
    return [token for token in range(backend.get_vocab_size(with_added_tokens=True)) if token not in produced]


# ---- the language-model phase ----------------------------------------------------------------------
def answered_request(example: vocabulary.Example) -> dict:
    """The example's request with each instruction followed directly by its answer (the option id):
    "Which component logged the latest ERROR?tumisko". Predicting it makes the instruction's last token
    (part of the span the head pools for the question) find the answer in the state and name it; no
    space between, or the answer would be predicted from a space token the real record does not have."""
    questions = {}
    for qid, question in example.request["questions"].items():
        asked = question.get("instructions") or qid
        joiner = "?" if asked[-1].isalnum() else ""
        questions[qid] = dict(question, instructions=f"{asked}{joiner}{example.answers[qid]}")
    return dict(example.request, questions=questions)


def padded(sequences: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    lengths = [len(s) for s in sequences]
    ids = torch.zeros(len(sequences), max(lengths), dtype=torch.long)  # right-padded; padding is never seen
    for b, sequence in enumerate(sequences):
        ids[b, : len(sequence)] = torch.tensor(sequence)
    return ids, lengths


def hidden_by_length(
    model: TrainableClef, sequences: list[list[int]], zero_key_band: bool = False, group: int = 4
) -> list[torch.Tensor]:
    """Final hidden states [L_i, hidden] of each token sequence, computed `group` at a time in order of
    length: a right-padded batch costs its longest record times its size, and record lengths vary ~10x."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    hidden: list[torch.Tensor | None] = [None] * len(sequences)
    for start in range(0, len(order), group):
        members = order[start : start + group]
        ids, lengths = padded([sequences[i] for i in members])
        states = model.hidden_states(ids, lengths, zero_key_band)
        for row, i in enumerate(members):
            hidden[i] = states[row, : lengths[row]]
    return hidden


@dataclass(frozen=True)
class DelimiterNoise:
    """Training input noise: in half the records, a fifth of the state's delimiter tokens (punctuation and
    spaces: no letter, digit, newline or hyphen) become other delimiter tokens. Facts are words, so the
    answers stay right; the model learns that no delimiter is the one a fact comes with, and every
    delimiter token of the vocabulary gets trained (a held-out format's brackets would otherwise be
    random vectors the model has never seen). Only inputs change: next-token targets stay the text."""

    tokens: tuple[int, ...]
    record_share: float = 0.5
    token_share: float = 0.2

    @classmethod
    def of(cls, tokenizer_json: str) -> DelimiterNoise:
        from tokenizers import Tokenizer as Backend

        backend = Backend.from_str(tokenizer_json)
        added = set(backend.get_added_tokens_decoder())
        tokens = []
        for token in range(backend.get_vocab_size(with_added_tokens=False)):
            text = backend.decode([token])
            if token not in added and text and not any(c.isalnum() or c in "\n-" for c in text):
                tokens.append(token)
        return cls(tuple(tokens))

    def apply(self, record, rng: random.Random) -> list[int]:
        ids = list(record.input_ids)
        if rng.random() >= self.record_share:
            return ids
        delimiters = set(self.tokens)
        for position in range(record.prefix_tokens, record.prefix_tokens + record.state_tokens):
            if ids[position] in delimiters and rng.random() < self.token_share:
                ids[position] = rng.choice(self.tokens)
        return ids


def inputs(records: list, noise: DelimiterNoise | None, rng: random.Random | None) -> list[list[int]]:
    if noise is None:
        return [list(r.input_ids) for r in records]
    return [noise.apply(r, rng) for r in records]


def lm_batch_loss(
    model: TrainableClef,
    tokenizer: Tokenizer,
    examples: list,
    answer_weight: float = 1.0,
    tally: dict[str, list[int]] | None = None,
    noise: DelimiterNoise | None = None,
    rng: random.Random | None = None,
) -> torch.Tensor:
    """Mean next-token cross-entropy over the answered records plus `answer_weight` times the mean over
    the answers' tokens alone (a few tokens in hundreds: unweighted, the text drowns them); `tally`
    collects, per question id, [answers named right (every token of the answer the argmax), answers,
    answers whose first token is the argmax]."""
    records = [encode_request(tokenizer, answered_request(e), max_length=4096) for e in examples]
    hidden_states = hidden_by_length(model, inputs(records, noise, rng))
    text_loss, answer_loss, text_tokens, answer_tokens = 0.0, 0.0, 0, 0
    for record, example, hidden in zip(records, examples, hidden_states, strict=True):
        ids = torch.tensor(record.input_ids)
        losses = F.cross_entropy(model.lm_logits(hidden[:-1]), ids[1:], reduction="none")  # [L - 1]
        text_loss, text_tokens = text_loss + losses.sum(), text_tokens + len(losses)
        for question in record.questions:
            answer = tokenizer.encode(example.answers[question.question_id])
            end = question.span[1]
            if list(record.input_ids[end - len(answer) : end]) != answer:
                continue  # the answer merged with the instruction's end (never, with this tokenizer)
            answer_loss = answer_loss + losses[end - len(answer) - 1 : end - 1].sum()
            answer_tokens += len(answer)
            if tally is not None:
                predicted = model.lm_logits(hidden[end - len(answer) - 1 : end - 1]).argmax(-1).tolist()
                counts = tally.setdefault(question.question_id, [0, 0, 0])
                counts[0], counts[1] = counts[0] + (predicted == answer), counts[1] + 1
                counts[2] += predicted[0] == answer[0]
    return text_loss / text_tokens + answer_weight * answer_loss / max(answer_tokens, 1)


# ---- the decision phase -----------------------------------------------------------------------------
def batch_loss(
    model: TrainableClef,
    tokenizer: Tokenizer,
    examples: list,
    zero_key_band: bool = False,
    tally: dict[str, list[int]] | None = None,
    lm_weight: float = 0.0,
    noise: DelimiterNoise | None = None,
    rng: random.Random | None = None,
) -> tuple[torch.Tensor, int, int]:
    """Summed cross-entropy of every question's correct option (plus `lm_weight` times the records'
    mean next-token loss, per question); (loss, correct, questions). `tally`, if given, collects
    [correct, asked] per question id."""
    records = [encode_request(tokenizer, e.request, max_length=4096) for e in examples]
    hidden = hidden_by_length(model, inputs(records, noise, rng), zero_key_band)
    loss, correct, total, lm_loss, lm_tokens = torch.zeros(()), 0, 0, torch.zeros(()), 0
    for b, (record, example) in enumerate(zip(records, examples, strict=True)):
        layout = RecordLayout.from_record(record, "cpu")
        logits = model.logits(hidden[b], layout)
        start = 0
        for question in record.questions:
            n = len(question.option_ids)
            target = question.option_ids.index(example.answers[question.question_id])
            scores = logits[start : start + n]
            loss = loss + F.cross_entropy(scores[None], torch.tensor([target]))
            right = int(scores.argmax()) == target
            correct, total = correct + right, total + 1
            if tally is not None:
                counts = tally.setdefault(question.question_id, [0, 0])
                counts[0], counts[1] = counts[0] + right, counts[1] + 1
            start += n
        if lm_weight:
            ids = torch.tensor(record.input_ids)
            lm_loss = lm_loss + F.cross_entropy(model.lm_logits(hidden[b][:-1]), ids[1:], reduction="sum")
            lm_tokens += len(ids) - 1
    if lm_weight:
        loss = loss + lm_weight * total * lm_loss / lm_tokens
    return loss, correct, total


@torch.no_grad()
def accuracy(
    model: TrainableClef, tokenizer: Tokenizer, examples: list, batch: int = 16, tally: dict | None = None
) -> float:
    correct = total = 0
    for i in range(0, len(examples), batch):
        _, c, t = batch_loss(model, tokenizer, examples[i : i + batch], tally=tally)
        correct, total = correct + c, total + t
    return correct / total


@torch.no_grad()
def lm_accuracy(model: TrainableClef, tokenizer: Tokenizer, examples: list, batch: int = 16) -> dict:
    tally: dict[str, list[int]] = {}
    for i in range(0, len(examples), batch):
        lm_batch_loss(model, tokenizer, examples[i : i + batch], tally=tally)
    return tally


def _rates(tally: dict[str, list[int]], column: int = 0) -> dict[str, float]:
    return {q: round(counts[column] / counts[1], 3) for q, counts in sorted(tally.items())}


def _line(tally: dict[str, list[int]], column: int = 0) -> str:
    return " ".join(f"{q}={r:.2f}" for q, r in _rates(tally, column).items())


def write_release(model: TrainableClef, tokenizer_json: str, out: Path, summary: dict) -> None:
    from safetensors.torch import save_file
    from tokenizers import Tokenizer as Backend

    out.mkdir(parents=True, exist_ok=True)
    trunk, head = model.named_release_tensors()
    prefixed = {
        (k if k == "lm_head.weight" else "model.language_model." + k): v.to(torch.bfloat16).contiguous()
        for k, v in trunk.items()
    }
    save_file(prefixed, str(out / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in head.items()}, str(out / "joint_head.safetensors"))
    (out / "joint_head_config.json").write_text(json.dumps(HEAD.__dict__, indent=2) + "\n")
    (out / "tokenizer.json").write_text(tokenizer_json)
    vocab = Backend.from_str(tokenizer_json).get_vocab(with_added_tokens=True)
    (out / "config.json").write_text(json.dumps(release_config(TRUNK, vocab), indent=2) + "\n")
    (out / "TRAINING.json").write_text(json.dumps(summary, indent=2) + "\n")


def learning_rate(peak: float, step: int, steps: int, warmup: int = 100) -> float:
    """Linear warm-up, then a cosine down to a tenth of the peak."""
    progress = step / max(steps, 1)
    return peak * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# The arguments a checkpoint must agree with to be resumed (the rest only say how the run is watched): a
# checkpoint of the language-model phase depends only on that phase's, so one pre-training serves any
# fine-tune schedule.
LM_SCHEDULE_ARGS = ("seed", "lm_steps", "lm_batch", "lm_lr", "answer_weight", "threads")
SCHEDULE_ARGS = (*LM_SCHEDULE_ARGS, "steps", "batch", "lr", "lm_weight")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lm-steps", type=int, default=LM_STEPS, help="language-model pre-training steps")
    parser.add_argument("--steps", type=int, default=STEPS, help="decision fine-tune steps")
    parser.add_argument("--lm-batch", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lm-lr", type=float, default=3e-3)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--answer-weight", type=float, default=1.0, help="the answers' own loss in pre-training")
    parser.add_argument("--lm-weight", type=float, default=0.2, help="next-token loss kept in the fine-tune")
    parser.add_argument("--threads", type=int, default=1, help="one: the dev machine's 2 cores are shared")
    parser.add_argument("--eval-every", type=int, default=500, help="steps between development-set checks")
    parser.add_argument("--eval-count", type=int, default=64, help="examples per development-set check")
    parser.add_argument("--checkpoint", type=Path, help="checkpoint file (default: OUT.ckpt)")
    parser.add_argument("--checkpoint-every", type=int, default=250)
    args = parser.parse_args(argv)
    checkpoint_path = args.checkpoint or args.out.with_suffix(".ckpt")

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)  # fixed: reductions then run the same way on every run
    # Accumulating index ops (the embedding's backward, the head's index_add_) otherwise sum in whatever
    # order the threads finish: last-bit differences that flip bf16 roundings between identical runs.
    torch.use_deterministic_algorithms(True)
    started = time.monotonic()
    tokenizer_json = build_tokenizer(args.seed)
    tokenizer = Tokenizer(__import__("tokenizers").Tokenizer.from_str(tokenizer_json))
    model = TrainableClef(TRUNK, HEAD, seed=args.seed)
    model.silence_tokens(unseen_tokens(tokenizer_json, args.seed))
    noise = DelimiterNoise.of(tokenizer_json)
    dev = vocabulary.dataset(args.seed + 10_000, args.eval_count, "heldout")  # development set (evaluate.py)
    probe = vocabulary.dataset(args.seed + 30_000, args.eval_count, "train")  # fresh names: reading, not recall
    schedule = {name: getattr(args, name) for name in SCHEDULE_ARGS}

    phase, step, history, elapsed = "lm", 0, [], 0.0
    rng = random.Random(args.seed)
    lm_optimizer = torch.optim.AdamW(model.trunk.parameters(), lr=args.lm_lr, weight_decay=0.01, betas=(0.9, 0.98))
    optimizer = None
    saved = None
    if checkpoint_path.is_file():
        saved = torch.load(checkpoint_path, weights_only=False)
        names = LM_SCHEDULE_ARGS if saved["phase"] == "lm" else SCHEDULE_ARGS
        if any(saved["schedule"][name] != schedule[name] for name in names):
            parser.exit(2, f"training.train: error: {checkpoint_path} is another schedule's: {saved['schedule']}\n")
        model.load_state_dict(saved["model"])
        phase, step, history, elapsed = saved["phase"], saved["step"], saved["history"], saved["elapsed"]
        rng.setstate(saved["rng"])
        if phase == "lm":
            lm_optimizer.load_state_dict(saved["optimizer"])
        print(f"resumed from {checkpoint_path}: {phase} step {step}", flush=True)

    def decision_optimizer() -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))

    if phase == "decision":  # only ever true when resuming a checkpoint of the decision phase
        optimizer = decision_optimizer()
        optimizer.load_state_dict(saved["optimizer"])

    def minutes() -> float:
        return round((elapsed + time.monotonic() - started) / 60, 2)

    def save(path: Path = checkpoint_path) -> None:
        state = {
            "schedule": schedule,
            "phase": phase,
            "step": step,
            "history": history,
            "elapsed": elapsed + time.monotonic() - started,
            "rng": rng.getstate(),
            "model": model.state_dict(),
            "optimizer": (lm_optimizer if phase == "lm" else optimizer).state_dict(),
        }
        partial = path.with_suffix(".partial")
        torch.save(state, partial)
        os.replace(partial, path)

    running: list[float] = []
    while phase == "lm" and step < args.lm_steps:
        for group in lm_optimizer.param_groups:
            group["lr"] = learning_rate(args.lm_lr, step, args.lm_steps)
        examples = [vocabulary.make_example(rng, "train") for _ in range(args.lm_batch)]
        loss = lm_batch_loss(model, tokenizer, examples, args.answer_weight, noise=noise, rng=rng)
        lm_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.trunk.parameters(), 1.0)
        lm_optimizer.step()
        step += 1
        running = (running + [loss.item()])[-args.eval_every :]
        if step % args.eval_every == 0 or step == args.lm_steps:
            train_answers, dev_answers = lm_accuracy(model, tokenizer, probe), lm_accuracy(model, tokenizer, dev)
            history.append(
                {
                    "phase": "lm",
                    "step": step,
                    "minutes": minutes(),
                    "loss": round(sum(running) / len(running), 4),
                    "answers_named_train": _rates(train_answers),
                    "answers_named_heldout": _rates(dev_answers),
                    "first_token_train": _rates(train_answers, 2),
                    "first_token_heldout": _rates(dev_answers, 2),
                }
            )
            print(
                f"lm step {step}: loss {history[-1]['loss']:.3f}, {history[-1]['minutes']} min; answers named "
                f"(first token)\n    train:    {_line(train_answers)}\n              {_line(train_answers, 2)}\n"
                f"    held-out: {_line(dev_answers)}\n              {_line(dev_answers, 2)}",
                flush=True,
            )
        if step % args.checkpoint_every == 0:
            save()
    if phase == "lm":
        save(checkpoint_path.with_suffix(".lm.ckpt"))  # the pre-trained trunk: any fine-tune resumes from it
        phase, step, running = "decision", 0, []
        # The head reads LM-head rows only as each option's lexical mean: the JSON around every option
        # would blur them together, so those rows start (and the LM phase never trained them to be) zero.
        model.silence_lexicon(scaffolding_tokens(tokenizer_json))
        optimizer = decision_optimizer()
        rng = random.Random(args.seed + 1)

    train_tally: dict[str, list[int]] = {}
    while step < args.steps:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args.lr, step, args.steps)
        examples = [vocabulary.make_example(rng, "train") for _ in range(args.batch)]
        loss, correct, total = batch_loss(
            model, tokenizer, examples, tally=train_tally, lm_weight=args.lm_weight, noise=noise, rng=rng
        )
        optimizer.zero_grad(set_to_none=True)
        (loss / total).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        running = (running + [loss.item() / total])[-args.eval_every :]
        if step % args.eval_every == 0 or step == args.steps:
            dev_tally: dict[str, list[int]] = {}
            probe_tally: dict[str, list[int]] = {}
            accuracy(model, tokenizer, probe, tally=probe_tally)
            held = accuracy(model, tokenizer, dev, tally=dev_tally)
            history.append(
                {
                    "phase": "decision",
                    "step": step,
                    "minutes": minutes(),
                    "loss": round(sum(running) / len(running), 4),
                    "train": _rates(probe_tally),
                    "heldout": _rates(dev_tally),
                    "heldout_accuracy": round(held, 4),
                }
            )
            print(
                f"decision step {step}: loss {history[-1]['loss']:.3f}, held-out acc {held:.3f}, "
                f"{history[-1]['minutes']} min\n    seen-so-far: {_line(train_tally)}\n"
                f"    train:    {_line(probe_tally)}\n    held-out: {_line(dev_tally)}",
                flush=True,
            )
            train_tally = {}
        if step % args.checkpoint_every == 0:
            save()
    summary = {
        "seed": args.seed,
        "schedule": schedule,
        "completed": True,
        "minutes": minutes(),
        "heldout_accuracy_training_path": history[-1]["heldout_accuracy"] if history else None,
        "trunk": TRUNK.__dict__,
        "head": HEAD.__dict__,
        "history": history,
        "command": "python -m training.train " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    write_release(model, tokenizer_json, args.out, summary)
    print(f"release written to {args.out} after {summary['minutes']} minutes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
