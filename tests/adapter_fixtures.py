"""Variants made at test time with clef-finetune's own train and merge (peft pinned in
requirements-dev.txt): two small LoRA checkpoints on the upstream tiny release (or another base: BASES), one on
every module and one on a subset (the delta net's qkv without z, attention's q/k/v, no MLP), and
clef-finetune's fp32 merge of each: the oracle."""

from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from releases import clef_ratio_release, tiny_release

VARIANTS = {
    "all": None,  # every linear layer of the text decoder
    "subset": ["in_proj_qkv", "in_proj_b", "in_proj_a", "q_proj", "k_proj", "v_proj"],
}
BASES = {"upstream-tiny": tiny_release, "clef-ratio": clef_ratio_release}  # clef-ratio: clef 27B's ratios


def _records(seed: int) -> list[dict]:
    rng = random.Random(seed)
    words = ["refund", "crash", "login", "invoice", "outage", "charge", "password", "timeout"]
    records = []
    for i in range(12):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(8, 30)))
        records.append(
            {
                "id": f"r{i}",
                "state": f"ticket {i}: {text}",
                "questions": {
                    "team": {"type": "choice", "criteria": {"billing": "Payments", "tech": None, "account": None}},
                    "urgent": {"type": "noul", "instructions": "Is it urgent?"},
                    "severity": {"type": "score", "criteria": ["low", "mid", "high"]},
                },
                "labels": {
                    "team": rng.choice(["billing", "tech", "account"]),
                    "urgent": rng.random() < 0.5,
                    "severity": rng.randrange(3),
                },
            }
        )
    return records


def _clef_finetune(*args: str, cwd: Path) -> None:
    env = dict(os.environ, CLEF_FINETUNE_JSM="vendored")
    done = subprocess.run(
        [sys.executable, "-m", "clef_finetune.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"clef-finetune {args[0]} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


@functools.cache
def checkpoint(variant: str, base: str = "upstream-tiny") -> Path:
    """clef-finetune train on the base release: a checkpoint-N directory (adapter/, joint_head, ...)."""
    import yaml

    work = Path(tempfile.mkdtemp(prefix=f"clef-adapter-{variant}-{base}-"))
    (work / "train.jsonl").write_text("\n".join(json.dumps(r) for r in _records(len(variant))))
    lora = {"r": 8, "alpha": 16}
    if VARIANTS[variant]:
        lora["include_suffixes"] = VARIANTS[variant]
    config = {
        "model": {"path": str(BASES[base]()), "dtype": "float32"},
        "data": {"train": "train.jsonl", "max_length": 4096},
        "lora": lora,
        "train": {
            "seed": len(variant),
            "max_steps": 4,
            "grad_accum": 2,
            "lr": 5e-2,  # large: a few steps must move the answers well past the parity tolerance
            "head_lr": 1e-2,
            "warmup_steps": 1,
            "gradient_checkpointing": False,
            "save_every": 4,
            "augment_train": False,
        },
        "output_dir": "run",
    }
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    _clef_finetune("train", "config.yaml", "--device", "cpu", cwd=work)
    return work / "run" / "checkpoint-4"


@functools.cache
def merged(variant: str, base: str = "upstream-tiny") -> Path:
    """clef-finetune's fp32 merge of the checkpoint: a full release, the reference's input."""
    out = Path(tempfile.mkdtemp(prefix=f"clef-merged-{variant}-{base}-")) / "release"
    _clef_finetune(
        "merge",
        "--model",
        str(BASES[base]()),
        "--checkpoint",
        str(checkpoint(variant, base)),
        "--output",
        str(out),
        "--dtype",
        "float32",
        "--head-dtype",
        "float32",
        cwd=out.parent,
    )
    return out
