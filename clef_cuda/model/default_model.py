"""The embedded default model: what clef-serve serves when no --w is given.

clef-tiny: a small model in clef-flash's architecture (a Qwen3.5 hybrid trunk with three Gated DeltaNet
layers and one gated attention layer, and the joint schema head, in the real release layout with its own
tokenizer.json), trained by training/train.py on a synthetic decision task: support tickets (department,
urgency), service logs (does it end with an ERROR, how severe is the last line, which component failed
last) and order timelines (current status, refund requested after delivery). It ships inside the package
(clef_cuda/assets/clef-tiny, a few MB) and decides those questions (held-out accuracy and calibration in its
TRAINING.json, pinned by tests/test_clef_tiny.py); other questions it answers with confident nonsense. A
demo and an end-to-end test fixture, not clef-flash.
"""

from __future__ import annotations

from pathlib import Path

from clef_cuda.errors import ReleaseError
from clef_cuda.model.config import TrunkConfig

NAME = "clef-tiny"  # the model name clients send when clef-serve runs without --w
RELEASE = Path(__file__).resolve().parents[1] / "assets" / NAME  # clef_cuda/assets: package data
NOTICE = (
    "clef-serve is serving the EMBEDDED DEMO MODEL clef-tiny: a tiny model trained on synthetic support tickets, "
    "service logs and order timelines (training/README.md). It is not clef-flash; outside those questions its "
    "answers mean nothing. Pass --w /path/to/clef-flash to serve a real model."
)

SPECIAL_TOKENS = [  # the Qwen3.5 special tokens every release tokenizer carries (also tests/, training/)
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<think>",
    "</think>",
]


def release_config(c: TrunkConfig, tokens: dict[str, int]) -> dict:
    """config.json of a release with trunk `c` in clef-flash's layout (Qwen3.5, text config nested);
    `tokens` is the tokenizer's vocabulary (for the end and padding ids). Also used by training/."""
    text = {
        "model_type": "qwen3_5_text",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "layer_types": list(c.layer_types),
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "linear_num_key_heads": c.linear_num_key_heads,
        "linear_num_value_heads": c.linear_num_value_heads,
        "linear_key_head_dim": c.linear_key_head_dim,
        "linear_value_head_dim": c.linear_value_head_dim,
        "linear_conv_kernel_dim": c.linear_conv_kernel_dim,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": c.rope_theta,
            "partial_rotary_factor": c.rotary_dim / c.head_dim,
        },
        "eos_token_id": tokens["<|im_end|>"],
        "pad_token_id": tokens["<|endoftext|>"],
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": False,
    }


def default_release() -> Path:
    """The shipped clef-tiny release directory (read in place, never written)."""
    for name in ("config.json", "model.safetensors", "joint_head.safetensors", "tokenizer.json"):
        if not (RELEASE / name).is_file():
            raise ReleaseError(f"{RELEASE / name}: missing from the installed package (reinstall clef-cuda)")
    return RELEASE
