"""The public in-process API: a release directory in, System One answers out.

    from clef_cuda import Decider
    decider = Decider.from_release("/mnt/models/clef-flash", device="cuda", dtype=torch.float16)
    response = decider.decide({"model": "clef-flash", "state": "...", "questions": {...}})
    # images as the reference takes them: data URLs (or {content_type, base64} objects, or plain base64)
    response = decider.decide({..., "images": ["data:image/png;base64,iVBORw0KGgo..."]})

One record at a time, prefilled in chunks through the trunk's paged/slot caches; the server's engine
(clef_cuda.serving.engine) batches many records over the same pieces.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from clef_cuda.model.config import ReleaseConfig, context_length, load_release_config, past_training
from clef_cuda.model.footprint import resident_weights
from clef_cuda.model.head import JointSchemaHead, RecordLayout
from clef_cuda.model.trunk import ChunkBatch, SequenceChunk, Trunk
from clef_cuda.model.vision import VisionTower
from clef_cuda.model.weights import load_release_weights
from clef_cuda.request import answers
from clef_cuda.request.encoding import EncodedRecord, Tokenizer, encode_request, validate_request
from clef_cuda.request.images import (
    ImageError,
    ImageLimits,
    ImageProcessorConfig,
    PreparedImage,
    load_images,
    load_processor_config,
    request_images,
)
from clef_cuda.request.videos import (
    PreparedVideo,
    VideoError,
    VideoLimits,
    VideoProcessorConfig,
    load_video_processor_config,
    load_videos,
    request_videos,
)

DEFAULT_BLOCK_SIZE = 16
log = logging.getLogger("clef_cuda.decider")


@dataclass(frozen=True)
class DecisionOptions:
    # Token budget per record; None: the reference's 16384, or the release's max_position_embeddings when fewer.
    # Past the release's, only with allow_long_context (clef_cuda.model.config.context_length).
    max_length: int | None = None
    allow_long_context: bool = False
    state_overflow: str = "reject"  # or "truncate": keep the head of the state (the reference's behaviour)
    confidence: str = "clef"  # or "typesafe"
    chunk_size: int = 2048  # prefill chunk (tokens per trunk step): bounds activation memory
    client_special_tokens: str = "control"  # or "text": special tokens in client text are plain text
    image_limits: ImageLimits = ImageLimits()
    image_max_pixels: int | None = None  # a tighter resize budget than the release's processor (None: its own)
    video_limits: VideoLimits = VideoLimits()


def serving_dtype(device: torch.device, requested: torch.dtype | None = None) -> tuple[torch.dtype, str | None]:
    """The activation dtype on `device`, and a line to log when it needs saying: `requested`, else f16 on a GPU
    and f32 on the CPU, but f32 on sm_61/62 (P40, GTX 10x0: f16 arithmetic at 1/64 of the f32 rate; sm_60, the
    P100, runs f16 at twice its f32 rate and keeps it). ValueError for bf16 on a GPU before sm_80, which has no
    bf16 arithmetic (V100, T4: serve f16). On the CPU, f32 stays the default (the answers nearest the
    reference), bf16 is served where asked, and the line says what the CPU's GEMMs can do with it
    (clef_cuda.kernels.cpu_features): with bf16 dot products (AVX512-BF16, AMX) bf16 GEMMs run at about 2.5x the f32
    rate; without them oneDNN converts in software and bf16 is the slower one."""
    if device.type != "cuda":
        from clef_cuda.kernels import ops
        from clef_cuda.kernels.cpu_features import cpu_gemm_features

        isa = ops.cpu_isa()
        features = cpu_gemm_features(isa)
        if requested == torch.bfloat16 and features.bf16 is None:
            return requested, (
                f"serving bf16 on a CPU whose GEMMs have {features.describe()} (our kernels: {isa}): "
                "its bf16 GEMMs convert in software and run slower than f32 (--dtype f32 is faster here)"
            )
        if requested is None and features.bf16 is not None:
            return torch.float32, (
                f"serving f32 on the CPU; its GEMMs have {features.describe()}: --dtype bf16 runs them at about "
                "2.5x the f32 rate (what bf16 costs in answers: docs/operations.md, On the CPU)"
            )
        return requested or torch.float32, None
    major, minor = torch.cuda.get_device_capability(device)
    if requested == torch.bfloat16 and major < 8:
        raise ValueError(
            f"--dtype bf16 needs sm_80 or newer (bf16 arithmetic); {torch.cuda.get_device_name(device)} is "
            f"sm_{major}{minor}: serve --dtype f16"
        )
    if requested is not None:
        return requested, None
    if (major, minor) in ((6, 1), (6, 2)):
        return torch.float32, (
            f"serving f32 activations on sm_{major}{minor} ({torch.cuda.get_device_name(device)}): its f16 arithmetic "
            "runs at 1/64 of its f32 rate (--dtype f16 to override)"
        )
    return torch.float16, None


class Decider:
    def __init__(
        self,
        config: ReleaseConfig,
        trunk: Trunk,
        head: JointSchemaHead,
        tokenizer: Tokenizer,
        options: DecisionOptions = DecisionOptions(),
        vision: VisionTower | None = None,
        image_processor: ImageProcessorConfig | None = None,
        video_processor: VideoProcessorConfig | None = None,
    ) -> None:
        if options.confidence not in answers.CONFIDENCE_MODES:
            raise ValueError(f"confidence must be one of {answers.CONFIDENCE_MODES}, got {options.confidence!r}")
        if options.chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        max_length = context_length(config.trunk, options.max_length, options.allow_long_context)
        options = replace(options, max_length=max_length)
        if warning := past_training(config.trunk, max_length):
            log.warning(warning)
        if tokenizer.client_special_tokens != options.client_special_tokens:
            raise ValueError(
                f"the tokenizer treats special tokens in client text as {tokenizer.client_special_tokens!r}, "
                f"the options say {options.client_special_tokens!r}"
            )
        self.config, self.trunk, self.head, self.tokenizer, self.options = config, trunk, head, tokenizer, options
        # Images need both the tower's weights and the processor's settings; a release missing either
        # (clef-tiny has neither) refuses images.
        self.vision = vision if image_processor is not None else None
        self.image_processor = image_processor.with_max_pixels(options.image_max_pixels) if image_processor else None
        self.video_processor = video_processor if self.vision is not None else None  # videos need it too

    @classmethod
    def from_release(
        cls,
        path: str | Path,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        *,
        head_dtype: torch.dtype = torch.float32,
        progress: bool = True,
        ops=None,
        quantize: str = "none",
        vocab_tables: str = "device",
        tensor_parallel=None,
        **options: Any,
    ) -> Decider:
        """Load a release. Defaults: the GPU if there is one, in f16 (f32 on sm_61, whose f16 runs at 1/64:
        serving_dtype); else the CPU in fp32. The head runs in fp32 unless head_dtype says otherwise.
        quantize="int8" stores the trunk's linear layers and embedding tables as int8 with per-row scales
        (W8A16: clef_cuda.model.quantize), quantized as they load. vocab_tables="host" keeps the embedding and
        LM-head tables in pinned host memory, gathered by rows (clef_cuda.model.vocab_tables). `options` are
        DecisionOptions fields. tensor_parallel: a group of N > 1 ranks (clef_cuda.parallel.tensor_parallel
        .TensorParallel: this process is rank 0, on `device`, and it starts the others) to shard the trunk over."""
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype, _ = serving_dtype(device, dtype)
        config = load_release_config(path)
        decision_options = DecisionOptions(**options)
        tokenizer = Tokenizer.from_release(path, decision_options.client_special_tokens)
        shard, has_vision = None, False
        if tensor_parallel is not None and tensor_parallel.size > 1:  # this process is rank 0
            from clef_cuda.model.footprint import release_has_vision, vocab_split
            from clef_cuda.model.shard import Shard, check_shardable
            from clef_cuda.model.weights import release_headers

            check_shardable(config.trunk, tensor_parallel.size)
            has_vision = release_has_vision(config, release_headers(Path(path)))
            split = vocab_split(config, dtype, quantize, head_dtype, has_vision, tensor_parallel.size)
            shard = Shard(0, tensor_parallel.size, split[0])
            # The other ranks load theirs meanwhile.
            tensor_parallel.launch(path, device, dtype, quantize, vocab_tables, split)
        try:
            weights = load_release_weights(
                path,
                config,
                device,
                dtype,
                head_dtype,
                progress=progress,
                quantize=quantize,
                vocab_tables=vocab_tables,
                shard=shard,
            )
            if shard is None:
                trunk = Trunk(config.trunk, weights.trunk, dtype, ops=ops)
            else:
                from clef_cuda.model.shard import local_config

                trunk = Trunk(local_config(config.trunk, shard.size), weights.trunk, dtype, ops=ops)
                tensor_parallel.join(device)  # every rank has loaded its shard, then the group forms
                tensor_parallel.attach(trunk)
        except BaseException:
            if shard is not None:
                tensor_parallel.stop()  # no worker outlives a failed load
            raise
        head = JointSchemaHead(config.head, weights.head, weights.trunk["lm_head.weight"])
        vision = VisionTower(config.vision, weights.vision, dtype) if weights.vision is not None else None
        if shard is not None and has_vision and not shard.holds_tower:  # another rank holds it and runs it
            vision = tensor_parallel.vision_tower(trunk)
        processor = load_processor_config(path) if vision is not None else None
        video_processor = load_video_processor_config(path) if vision is not None else None
        return cls(config, trunk, head, tokenizer, decision_options, vision, processor, video_processor)

    @property
    def device(self) -> torch.device:
        return self.trunk.device

    def weight_bytes(self) -> dict[str, int]:
        """Device bytes of the loaded weights by part: trunk, embeddings, vision, head."""
        return resident_weights(self.trunk, self.head, self.vision)

    def prepare_images(self, blobs: list[bytes]) -> list[PreparedImage]:
        """A request's image bytes, collected within the limits (clef_cuda.request.images.request_images, or the
        HTTP forms: clef_cuda.request.media) -> the tower's inputs (their headers checked, decoded, preprocessed as
        the release's processor)."""
        if not blobs:
            return []
        if self.vision is None:
            raise ImageError("this model does not accept images (the release has no vision tower)")
        return load_images(blobs, self.image_processor, self.options.image_limits)

    def prepare_videos(self, blobs: list[tuple[bytes, str | None]]) -> list[PreparedVideo]:
        """A request's videos, (bytes, declared format) collected within the limits (request_videos, or the HTTP
        forms) -> their frame groups, scanned, decoded and preprocessed as the release's video processor."""
        if not blobs:
            return []
        if self.vision is None or self.video_processor is None:
            raise VideoError("this model does not accept videos (the release has no vision tower or video processor)")
        return load_videos(blobs, self.video_processor, self.options.video_limits)

    def encode(
        self, request: dict[str, Any], images: list[PreparedImage] = (), videos: list[PreparedVideo] = ()
    ) -> EncodedRecord:
        validate_request(request)
        return encode_request(
            self.tokenizer,
            request,
            max_length=self.options.max_length,
            state_overflow=self.options.state_overflow,
            images=images,
            media_tokens=self.config.media_tokens,
            videos=videos,
        )

    @property
    def tower_patches(self) -> int:
        """The most patches one input of the tower can have: the largest image the processor allows, or the frames
        of a clip at the video processor's budget (what the memory plan sizes the tower's step for: smaller inputs
        may share one call up to it)."""
        patches = 0
        if self.image_processor is not None:
            patches = self.image_processor.max_pixels // self.image_processor.patch_size**2
        if self.video_processor is not None:
            patches = max(patches, self.video_processor.max_input_patches)
        return patches

    def image_features(self, images: list[PreparedImage]) -> list[torch.Tensor]:
        """The tower's output rows per image (serving dtype; on the device, or in host memory when another
        tensor-parallel rank runs the tower)."""
        return self.vision(images) if images else []

    @torch.inference_mode()
    def probabilities(
        self,
        record: EncodedRecord,
        chunk_sizes: list[int] | None = None,
        features: list[torch.Tensor] | None = None,
    ) -> list[list[float]]:
        """Per question, the probability of each option in encoded order. `chunk_sizes` splits the prefill
        (default: chunks of options.chunk_size); `features` are the record's images' tower outputs."""
        n = record.num_tokens
        if chunk_sizes is None:
            step = self.options.chunk_size
            chunk_sizes = [min(step, n - s) for s in range(0, n, step)]
        if sum(chunk_sizes) != n or min(chunk_sizes) <= 0:
            raise ValueError(f"chunk sizes {chunk_sizes} must be positive and add up to {n}")
        blocks = -(-n // DEFAULT_BLOCK_SIZE)
        cache = self.trunk.allocate_cache(1, blocks, DEFAULT_BLOCK_SIZE, name="decider")
        layout = RecordLayout.from_record(record, self.device)
        inputs = self.head.start(layout, n)
        positions = record.rope_positions()
        start = 0
        for size in chunk_sizes:
            chunk = record_chunk(record, start, size, 0, list(range(blocks)), positions, features or [])
            hidden = self.trunk.forward(ChunkBatch.build([chunk], DEFAULT_BLOCK_SIZE, self.device), cache)
            self.head.consume(inputs, layout, hidden)
            start += size
        probs = self.head.probabilities(self.head.logits(inputs, layout), layout).tolist()
        out, cursor = [], 0
        for question in record.questions:
            out.append(probs[cursor : cursor + len(question.option_ids)])
            cursor += len(question.option_ids)
        return out

    def decide(self, request: dict[str, Any]) -> dict[str, Any]:
        """A System One request body -> its response body (reference-exact; x_truncated_state_tokens is
        added when the truncate policy cut the state). `images` and `videos` as the reference takes them."""
        images = self.prepare_images(request_images(request, self.options.image_limits))
        videos = self.prepare_videos(request_videos(request, self.options.video_limits))
        record = self.encode(request, images, videos)
        media = images + [group for video in videos for group in video.groups]  # the record's spans, in order
        per_question = self.probabilities(record, features=self.image_features(media))
        result = {
            q.question_id: answers.answer(
                request["questions"][q.question_id], dict(zip(q.option_ids, p, strict=True)), self.options.confidence
            )
            for q, p in zip(record.questions, per_question, strict=True)
        }
        body = answers.response(request["model"], result, record.num_tokens)
        body.update(record.truncation_fields())
        return body


def record_chunk(
    record: EncodedRecord,
    start: int,
    size: int,
    slot: int,
    blocks: list[int],
    positions: torch.Tensor | None,
    features: list[torch.Tensor],
) -> SequenceChunk:
    """Tokens [start, start + size) of a record as a trunk chunk: their RoPE positions and, where the
    chunk covers part of an image's tokens, that part of the image's feature rows (a chunk may cut an
    image anywhere)."""
    end = start + size
    overrides = []
    for span, rows in zip(record.media, features, strict=True):
        lo, hi = max(start, span.start), min(end, span.end)
        if lo < hi:
            overrides.append((lo - start, rows[lo - span.start : hi - span.start]))
    return SequenceChunk(
        list(record.input_ids[start:end]),
        start,
        slot,
        blocks,
        rope_positions=None if positions is None else positions[:, start:end],
        embedding_overrides=tuple(overrides),
    )
