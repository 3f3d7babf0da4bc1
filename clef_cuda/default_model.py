"""The embedded default model: what clef-serve serves when no --w is given.

For now a tiny release in the real layout (config.json, sharded-style safetensors names, joint head,
tokenizer.json) built deterministically from a fixed seed, with MEANINGLESS RANDOM WEIGHTS: it exercises
the whole serving path, its answers mean nothing. It needs only torch, safetensors and tokenizers (no
transformers), and is written once into a cache directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from clef_cuda.config import FULL_ATTENTION, HeadConfig, TrunkConfig
from clef_cuda.weights import head_shapes, trunk_shapes

VERSION = "random-v1"  # bump when the recipe changes: the cache directory is keyed by it
WARNING = (
    "clef-serve is serving the EMBEDDED DEFAULT MODEL: a tiny clef-flash-shaped model with meaningless random "
    "weights. Its answers are well-formed and WRONG. Pass --w /path/to/clef-flash to serve a real model."
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
TRUNK = TrunkConfig(
    hidden_size=64,
    intermediate_size=128,
    layer_types=("linear_attention",) * 3 + (FULL_ATTENTION,),
    vocab_size=512,
    rms_norm_eps=1e-6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rotary_dim=4,
    rope_theta=1e7,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=False,
)
HEAD = HeadConfig(hidden_size=64, width=32, routing_layers=1, layers=1, heads=2, feedforward=64)


def cache_dir() -> Path:
    base = os.environ.get("CLEF_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "clef-cuda"
    )
    return Path(base) / f"default-model-{VERSION}"


def _tokenizer_json() -> str:
    """A byte-level BPE with no merges (every byte is a token) plus the Qwen special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok.to_str()


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


def _config_json(tokens: dict[str, int]) -> dict:
    return {**release_config(TRUNK, tokens), "clef_cuda_default_model": VERSION}


def _random_tensors(
    shapes: dict[str, tuple[int, ...]], generator: torch.Generator, head: bool
) -> dict[str, torch.Tensor]:
    """Initialised as a fresh model would be: projections small and random, norms neutral, decays spread."""
    out = {}
    for name, shape in sorted(shapes.items()):
        if name.endswith("A_log"):
            t = torch.rand(shape, generator=generator).mul(15.0).add(1.0).log()  # decay rates in [1, 16]
        elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
            t = torch.ones(shape)  # the gated norm stores its gain as is
        elif not head and "norm" in name:
            t = torch.zeros(shape)  # zero-centred RMSNorm gains: an effective gain of 1
        elif head and "norm" in name and name.endswith(".weight"):
            t = torch.ones(shape)  # LayerNorm gains
        elif name.endswith(".bias"):
            t = torch.zeros(shape)
        elif name == "residual_gate":
            t = torch.tensor(0.5)
        elif name in ("joint_logit_scale", "prior_logit_scale"):
            t = torch.tensor(1.0 if name == "joint_logit_scale" else 0.0)
        else:
            t = torch.randn(shape, generator=generator) * 0.05
        out[name] = t.to(torch.bfloat16).contiguous()
    return out


def build(target: Path) -> Path:
    """Write the default release into `target` (atomically: a half-written directory is never used)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(target.name + f".tmp-{os.getpid()}")
    staging.mkdir(parents=True, exist_ok=True)
    tokenizer_json = _tokenizer_json()
    (staging / "tokenizer.json").write_text(tokenizer_json)
    vocab = Tokenizer.from_str(tokenizer_json).get_vocab(with_added_tokens=True)
    (staging / "config.json").write_text(json.dumps(_config_json(vocab), indent=2))
    (staging / "joint_head_config.json").write_text(json.dumps(HEAD.__dict__, indent=2))
    generator = torch.Generator().manual_seed(20261130)
    trunk = _random_tensors(trunk_shapes(TRUNK), generator, head=False)
    prefixed = {(k if k == "lm_head.weight" else "model.language_model." + k): v for k, v in trunk.items()}
    save_file(prefixed, str(staging / "model.safetensors"))
    save_file(_random_tensors(head_shapes(HEAD), generator, head=True), str(staging / "joint_head.safetensors"))
    (staging / "DEFAULT_MODEL_RANDOM_WEIGHTS.txt").write_text(WARNING + "\n")
    try:
        staging.rename(target)
    except OSError:  # another process won the race: use its copy
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return target


def default_release() -> Path:
    """The default release directory, built on first use."""
    target = cache_dir()
    if not (target / "joint_head.safetensors").is_file():
        build(target)
    return target
