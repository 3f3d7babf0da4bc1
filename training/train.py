#!/usr/bin/env python3
"""Train clef-tiny: a small model in the clef-flash architecture on the synthetic decision task, on the
CPU, deterministically (fixed seeds, a fixed thread count, a fixed number of steps), then write it in the
real release layout (config.json, model.safetensors, joint_head*, tokenizer.json, TRAINING.json).

    python -m training.train --out /tmp/clef-tiny              # the full schedule (about 16 minutes, 2 cores)
    python -m training.train --out /tmp/t --steps 20            # a smoke run
    python -m training.evaluate --release /tmp/clef-tiny        # accuracy through the real server path

Trains through the pure-torch references (training/model.py), never the upstream code. Prints train and
held-out accuracy per question (template family "heldout", never trained on) as it goes. The shipped
default model (clef_cuda/assets/clef-tiny) is this command's output with the defaults; training/README.md
says how it was measured.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

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
from training import synthetic
from training.model import TrainableClef

VOCAB = 1024
TRUNK = TrunkConfig(
    hidden_size=128,
    intermediate_size=256,
    layer_types=(LINEAR_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION, LINEAR_ATTENTION),
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
STEPS = 2300
VARIETY = 0.8  # the share of varied-template examples from half-way through
HEAD = HeadConfig(hidden_size=128, width=64, routing_layers=1, layers=1, heads=4, feedforward=128)


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
    """A byte-level BPE trained on the *train* template family only (held-out words fall apart into
    pieces the model has seen), with Qwen3.5's pre-tokenizer, the Qwen special tokens and the record
    scaffolding as added tokens (matched before the pre-tokenizer, as the reference's tokenizer does)."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizers import Tokenizer as Backend

    backend = Backend(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - len(SCAFFOLDING),
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(synthetic.corpus(seed, splits=("train",)), trainer)
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


def batch_loss(
    model: TrainableClef,
    tokenizer: Tokenizer,
    examples: list,
    zero_key_band: bool = False,
    tally: dict[str, list[int]] | None = None,
) -> tuple[torch.Tensor, int, int]:
    """Summed cross-entropy of every question's correct option; (loss, correct, questions). `tally`, if
    given, collects [correct, asked] per question id."""
    records = [encode_request(tokenizer, e.request, max_length=4096) for e in examples]
    lengths = [r.num_tokens for r in records]
    ids = torch.zeros(len(records), max(lengths), dtype=torch.long)  # right-padded; padding is never seen
    for b, record in enumerate(records):
        ids[b, : record.num_tokens] = torch.tensor(record.input_ids)
    hidden = model.hidden_states(ids, lengths, zero_key_band)
    loss, correct, total = hidden.new_zeros(()), 0, 0
    for b, (record, example) in enumerate(zip(records, examples, strict=True)):
        layout = RecordLayout.from_record(record, "cpu")
        logits = model.logits(hidden[b, : record.num_tokens], layout)
        start = 0
        for question in record.questions:
            n = len(question.option_ids)
            target = question.option_ids.index(example.answers[question.question_id])
            scores = logits[start : start + n]
            loss = loss + torch.nn.functional.cross_entropy(scores[None], torch.tensor([target]))
            right = int(scores.argmax()) == target
            correct, total = correct + right, total + 1
            if tally is not None:
                counts = tally.setdefault(question.question_id, [0, 0])
                counts[0], counts[1] = counts[0] + right, counts[1] + 1
            start += n
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


def _per_question(tally: dict[str, list[int]]) -> str:
    return " ".join(f"{q}={c / n:.2f}" for q, (c, n) in sorted(tally.items()))


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=STEPS, help="optimizer steps (the schedule spans them)")
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=20.0,
        help="stop early past this (the result then depends on the machine's speed: not reproducible)",
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=200, help="steps between held-out checks")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)  # fixed: reductions then run the same way on every run
    # Accumulating index ops (the embedding's backward, the head's index_add_) otherwise sum in whatever
    # order the threads finish: last-bit differences that flip bf16 roundings between identical runs.
    torch.use_deterministic_algorithms(True)
    started = time.monotonic()
    tokenizer_json = build_tokenizer(args.seed)
    tokenizer = Tokenizer(__import__("tokenizers").Tokenizer.from_str(tokenizer_json))
    model = TrainableClef(TRUNK, HEAD, seed=args.seed)
    model.silence_lexicon(scaffolding_tokens(tokenizer_json))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    heldout = synthetic.dataset(args.seed + 10_000, 300, "heldout")  # the development set (evaluate.py)
    rng = random.Random(args.seed)
    budget = args.max_minutes * 60
    step, history, running, train_tally = 0, [], [], {}
    while step < args.steps and time.monotonic() - started < budget:
        progress = step / args.steps  # warm-up, then a cosine down to a tenth
        lr = args.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        # One template per kind first (learnt far faster), then more and more varied ones (see synthetic.py).
        variety = VARIETY * min(1.0, max(0.0, (progress - 0.25) / 0.25))
        examples = [synthetic.make_example(rng, "train", variety) for _ in range(args.batch)]
        loss, correct, total = batch_loss(model, tokenizer, examples, tally=train_tally)
        optimizer.zero_grad(set_to_none=True)
        (loss / total).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        running = (running + [loss.item() / total])[-args.eval_every :]
        if step % args.eval_every == 0:
            held_tally: dict[str, list[int]] = {}
            held = accuracy(model, tokenizer, heldout[:60], tally=held_tally)
            history.append(
                {
                    "step": step,
                    "minutes": round((time.monotonic() - started) / 60, 2),
                    "train_loss": round(sum(running) / len(running), 4),
                    "heldout_accuracy": held,
                }
            )
            print(
                f"step {step}: train loss {history[-1]['train_loss']:.3f}, "
                f"held-out acc {held:.3f}, lr {lr:.2e}, {history[-1]['minutes']} min\n"
                f"    train:    {_per_question(train_tally)}\n    held-out: {_per_question(held_tally)}",
                flush=True,
            )
            train_tally = {}
    if step < args.steps:
        print(f"warning: stopped after {step} of {args.steps} steps (--max-minutes): not reproducible", flush=True)
    final = accuracy(model, tokenizer, heldout)
    summary = {
        "seed": args.seed,
        "steps": step,
        "completed": step == args.steps,
        "threads": args.threads,
        "lr": args.lr,
        "batch": args.batch,
        "minutes": round((time.monotonic() - started) / 60, 2),
        "heldout_accuracy_training_path": final,
        "trunk": TRUNK.__dict__,
        "head": HEAD.__dict__,
        "history": history,
        "command": "python -m training.train " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    write_release(model, tokenizer_json, args.out, summary)
    print(f"held-out accuracy {final:.3f} after {step} steps; release written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
