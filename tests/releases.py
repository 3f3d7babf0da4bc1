"""Tiny random releases in the real clef-flash layout, for tests (no real weights can be downloaded here).

`clef_finetune.tiny.build_tiny_release` writes the upstream one; `build_release` here writes others with
different shapes (Hv = 2 Hk, several full-attention layers, other head dims), a BPE tokenizer trained on
a fixed corpus (multi-byte merges, unlike the tiny release's byte-level vocabulary), optionally sharded.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import torch

from clef_cuda.model.default_model import SPECIAL_TOKENS

CORPUS = [
    "Checkout has been failing for every customer for the last hour. Orders are blocked.",
    "Support is getting refund demands. The proposition is true or the answer is yes.",
    "Which team should handle the message? Payments, invoices, or refunds. Bugs, outages.",
    '{"description":"New purchases or upgrades","option_id":"sales"} SCHEMA FIELDS: FIELD ID TYPE',
    "INSTRUCTION: ALLOWED OPTIONS: OPTION END FIELD JOINT SCHEMA DECISIONS: Read the complete state",
    "café naïve 部門 緊急 urgência ticket log line order shipped delayed ERROR WARN 2026-11-30",
] * 4


# The positions a test release declares it was trained to, unless its shape says (FLASH_TEXT: clef-flash's 262,144):
# the ceiling of --max-model-len (clef_cuda.model.config.context_length).
TRAINED_POSITIONS = {"max_position_embeddings": 65536}


def _bpe_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return fast_tokenizer(tok)


MID_TEXT = dict(
    hidden_size=96,
    intermediate_size=160,
    num_hidden_layers=6,
    layer_types=[
        "linear_attention",
        "full_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
        "linear_attention",
    ],
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
    initializer_range=0.08,
)
MID_HEAD = {"hidden_size": 96, "width": 48, "routing_layers": 2, "layers": 2, "heads": 4, "feedforward": 80}


def build_release(
    out_dir: str | Path,
    text: dict = MID_TEXT,
    head: dict = MID_HEAD,
    vocab_size: int = 700,
    seed: int = 0,
    max_shard_size: str | None = "300KB",
    vision: dict | None = None,
) -> Path:
    from clef_finetune.jsm import load_jsm
    from safetensors.torch import save_file
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tokenizer = _bpe_tokenizer(vocab_size)
    ids = tokenizer.convert_tokens_to_ids
    text_config = dict(
        TRAINED_POSITIONS | text,
        vocab_size=vocab_size,
        tie_word_embeddings=False,
        eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>"),
    )
    vision = dict(
        dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=64,
        ),
        **(vision or {}),
        out_hidden_size=text["hidden_size"],
    )
    config = Qwen3_5Config(
        text_config=text_config,
        vision_config=vision,
        tie_word_embeddings=False,
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    model = Qwen3_5ForConditionalGeneration(config).to(torch.bfloat16)
    with torch.no_grad():  # decays spread over a realistic range, norms away from their init
        for layer in model.model.language_model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(-1.0, 1.5)
                layer.linear_attn.dt_bias.normal_(0.0, 0.5)
            layer.input_layernorm.weight.normal_(0.0, 0.2)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    save_processor(out, tokenizer)
    joint = load_jsm().JointSchemaHead(**head)
    with torch.no_grad():  # trained-looking gates, so the joint path matters
        joint.residual_gate.fill_(0.7)
        joint.joint_logit_scale.fill_(1.5)
        joint.prior_logit_scale.fill_(0.5)
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in joint.state_dict().items()},
        str(out / "joint_head.safetensors"),
    )
    (out / "joint_head_config.json").write_text(json.dumps(head, indent=2))
    return out


# clef-flash's shapes (shared/specs/memory.md): the Qwen3.5-9B trunk, its vision tower, the released head.
FLASH_TEXT = dict(
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=32,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    max_position_embeddings=262_144,  # the trained context (Qwen3.5's)
)
FLASH_VISION = dict(
    depth=27,
    hidden_size=1152,
    intermediate_size=4304,
    num_heads=16,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=2304,
)
FLASH_HEAD = {"hidden_size": 4096, "width": 1024, "routing_layers": 2, "layers": 4, "heads": 16, "feedforward": 4096}
FLASH_VOCAB = 248_320


def config_only_release(out_dir: str | Path, text: dict, head: dict, vocab_size: int, vision: dict) -> Path:
    """config.json and joint_head_config.json alone (no weights): what --plan reads, at any size."""
    from transformers import Qwen3_5Config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = Qwen3_5Config(
        text_config=dict(TRAINED_POSITIONS | text, vocab_size=vocab_size, tie_word_embeddings=False),
        vision_config=dict(vision, out_hidden_size=text["hidden_size"]),
        tie_word_embeddings=False,
        image_token_id=248056,
        video_token_id=248057,
        vision_start_token_id=248053,
        vision_end_token_id=248054,
    )
    config.save_pretrained(out)
    (out / "joint_head_config.json").write_text(json.dumps(head, indent=2))
    return out


def flash_config_release(out_dir: str | Path) -> Path:
    return config_only_release(out_dir, FLASH_TEXT, FLASH_HEAD, FLASH_VOCAB, FLASH_VISION)


# clef (27B): Cloudflare's config.json and joint_head_config.json as its release card gives the sizes (issue 40's
# table: 64 layers, a full-attention layer every 4th, hidden 5,120, MLP 17,408, attention 24 q / 4 kv x 256, delta
# net 16 key / 48 value heads x 128, the same vocabulary and tower, the head at hidden 5,120), kept in the tree.
CLEF_27B_CONFIG = Path(__file__).resolve().parent / "fixtures" / "clef-27b"


def clef_config_release(out_dir: str | Path) -> Path:
    """clef 27B's config.json and joint_head_config.json alone (no weights): what --plan reads."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "joint_head_config.json"):
        (out / name).write_text((CLEF_27B_CONFIG / name).read_text())
    return out


# The upstream tiny release declares 4,096 trained positions (clef_finetune.tiny), which its random weights know
# nothing of: tests whose records run longer (the parity suites' go to 9k tokens) serve it past them, as an
# operator would with --allow-long-context (clef_cuda.model.config.context_length).
TINY_PAST_TRAINING = {"max_length": 16384, "allow_long_context": True}


@functools.cache
def tiny_release() -> Path:
    """The upstream tiny release (clef_finetune.tiny), built once per test session."""
    from clef_finetune.tiny import build_tiny_release

    return build_tiny_release(Path(tempfile.mkdtemp(prefix="clef-tiny-")) / "release")


@functools.cache
def mid_release() -> Path:
    """Our second release: other shapes, a BPE tokenizer, sharded safetensors."""
    return build_release(Path(tempfile.mkdtemp(prefix="clef-mid-")) / "release")


# clef-flash's per-head shapes with few heads: the delta net's 2 value heads a key head x 128, attention's GQA 4 x 256
# and its rotary quarter, at a hidden size the CUDA simulator runs a whole self-check on in seconds (the kernels
# take the variants, tiles and tensor-core paths they take at clef-flash's shapes; benchmarks/selfcheck_power.py).
FLASH_HEADS_TEXT = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    initializer_range=0.05,
)
FLASH_HEADS_HEAD = {"hidden_size": 256, "width": 64, "routing_layers": 1, "layers": 1, "heads": 4, "feedforward": 96}


@functools.cache
def flash_heads_release() -> Path:
    return build_release(
        Path(tempfile.mkdtemp(prefix="clef-flash-heads-")) / "release", text=FLASH_HEADS_TEXT, head=FLASH_HEADS_HEAD
    )


# head_dim 64 with Qwen3.5's default M-RoPE sections: 8 rotary frequencies, so every one of the T, H and W
# axes turns some of them (the upstream tiny release's 2 never see W).
VISION_TEXT = dict(
    MID_TEXT,
    head_dim=64,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25},
)


@functools.cache
def vision_release() -> Path:
    """A release whose positions reach the W axis: image rows and columns both matter."""
    return build_release(Path(tempfile.mkdtemp(prefix="clef-vision-")) / "release", text=VISION_TEXT, seed=1)


# Every head count a multiple of 4, so the trunk shards over 4 tensor-parallel ranks (the upstream tiny release's
# 2 KV heads stop at 2): one KV head, one key head and two value heads a rank, with the image tower.
TP4_TEXT = dict(
    MID_TEXT,
    num_attention_heads=8,
    num_key_value_heads=4,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    head_dim=16,
)


@functools.cache
def tp4_release() -> Path:
    """A release that shards over 4 tensor-parallel ranks."""
    return build_release(Path(tempfile.mkdtemp(prefix="clef-tp4-")) / "release", text=TP4_TEXT, seed=2)


# clef 27B's ratios at a test's size (issue 40's table): a full-attention layer every 4th, 6 query heads per KV
# head, 3 delta-net value heads per key head, an MLP 3.4 times the hidden size; every head count a multiple of 4,
# so it shards over 4 ranks.
CLEF_RATIO_TEXT = dict(
    MID_TEXT,
    hidden_size=80,
    intermediate_size=272,
    num_hidden_layers=8,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=16,
    linear_num_key_heads=4,
    linear_num_value_heads=12,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
)
CLEF_RATIO_HEAD = dict(MID_HEAD, hidden_size=80)


@functools.cache
def clef_ratio_release() -> Path:
    """A release with clef 27B's ratios (and an image tower), small enough for the CPU."""
    return build_release(
        Path(tempfile.mkdtemp(prefix="clef-27b-ratio-")) / "release",
        text=CLEF_RATIO_TEXT,
        head=CLEF_RATIO_HEAD,
        vocab_size=701,
        seed=4,
    )


@functools.cache
def save_processor(out: Path, tokenizer) -> None:
    """The processor files the reference loader needs (it builds the Qwen3-VL processor even for text):
    processor, tokenizer config, chat template, and tokenizer.json from `tokenizer` (a fast tokenizer)."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2),
        video_processor=Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2),
        tokenizer=tokenizer,
        chat_template="{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
    ).save_pretrained(out)


def fast_tokenizer(tokenizer_object):
    """A transformers fast tokenizer over a `tokenizers` one, with the Qwen3.5 special-token roles."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_object,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={
            "image_token": "<|image_pad|>",
            "video_token": "<|video_pad|>",
            "vision_bos_token": "<|vision_start|>",
            "vision_eos_token": "<|vision_end|>",
        },
    )


def reference_model(path: Path):
    """The upstream reference (model, processor) in fp32 on the CPU."""
    from clef_finetune.jsm import load_jsm

    jsm = load_jsm()
    model, processor = jsm.load_release_model(path, device="cpu", dtype=torch.float32)
    return jsm, model, processor
