"""The Qwen3.5 vision tower (`model.visual.*`), in torch: prepared images -> one feature row per merged
2x2 patch block, in the trunk's hidden size (shared/specs/vision.md, "The vision tower").

patch embedding (the Conv3d with kernel = stride is a GEMM over each 1536-float patch row), the learned
position grid bilinearly resampled to each image's grid, 2D rotary in fp32, `depth` pre-norm blocks with
bidirectional attention inside each image (SDPA per image over the packed rows: varlen), then the merger
(LayerNorm per patch, 4 patches as one row, Linear, exact GELU, Linear). All images of a step go through
every GEMM together, ROW_CHUNK patches at a time; attention runs ROW_CHUNK query rows at a time over their
whole image's keys and values. Matrix multiplies run in the serving dtype; the residual stream, norms and
rotary angles in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from clef_cuda.model.config import VisionConfig
from clef_cuda.request.images import PreparedImage

Tensor = torch.Tensor
LN_EPS = 1e-6


@dataclass
class _Block:
    norm1: tuple[Tensor, Tensor]
    norm2: tuple[Tensor, Tensor]
    qkv: tuple[Tensor, Tensor]
    proj: tuple[Tensor, Tensor]
    fc1: tuple[Tensor, Tensor]
    fc2: tuple[Tensor, Tensor]


class VisionTower:
    def __init__(self, config: VisionConfig, weights: dict[str, Tensor], dtype: torch.dtype) -> None:
        self.config, self.dtype = config, dtype
        w = weights
        self.patch_weight = w["patch_embed.proj.weight"].reshape(config.hidden_size, -1)  # (c, t, y, x) order
        self.patch_bias = w["patch_embed.proj.bias"]
        self.pos_embed = w["pos_embed.weight"]
        self.side = int(config.num_position_embeddings**0.5)

        def pair(name: str) -> tuple[Tensor, Tensor]:
            return w[f"{name}.weight"], w[f"{name}.bias"]

        self.blocks = [
            _Block(
                norm1=pair(f"blocks.{b}.norm1"),
                norm2=pair(f"blocks.{b}.norm2"),
                qkv=pair(f"blocks.{b}.attn.qkv"),
                proj=pair(f"blocks.{b}.attn.proj"),
                fc1=pair(f"blocks.{b}.mlp.linear_fc1"),
                fc2=pair(f"blocks.{b}.mlp.linear_fc2"),
            )
            for b in range(config.depth)
        ]
        self.merger_norm, self.merger_fc1, self.merger_fc2 = (
            pair("merger.norm"),
            pair("merger.linear_fc1"),
            pair("merger.linear_fc2"),
        )
        head_dim = config.hidden_size // config.num_heads
        spatial = head_dim // 2  # half the rotary angles for rows, half for columns
        device = self.pos_embed.device
        self.inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32, device=device) / spatial)
        )

    @property
    def device(self) -> torch.device:
        return self.pos_embed.device

    # ---- per-image geometry (merge-block order: (gh/m, gw/m, m, m)) ---------------------------------------
    def _rows_cols(self, gh: int, gw: int) -> tuple[Tensor, Tensor]:
        m = self.config.spatial_merge_size
        within = torch.arange(gh * gw, device=self.device)
        blocks_w = gw // m
        row = (within // (m * m * blocks_w)) * m + (within // m) % m
        col = ((within // (m * m)) % blocks_w) * m + within % m
        return row, col

    def _axis_taps(self, index: Tensor, size: int) -> tuple[Tensor, Tensor]:
        """Bilinear, align_corners=True taps into the `side`-long learned grid, clamped at the border."""
        side = self.side
        src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
        floor = torch.floor(src)
        offsets = torch.arange(0, 2, device=self.device)
        raw = floor.long()[:, None] + offsets
        weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
        return raw.clamp(0, side - 1), weights

    def _position_taps(self, gh: int, gw: int) -> tuple[Tensor, Tensor]:
        """The 4 learned-grid rows each patch interpolates and their weights: [n, 4] each (the rows themselves
        are gathered a chunk of patches at a time: 4 hidden-wide rows a patch would be the tower's peak)."""
        row, col = self._rows_cols(gh, gw)
        h_taps, h_weights = self._axis_taps(row, gh)
        w_taps, w_weights = self._axis_taps(col, gw)
        indices = (h_taps[:, :, None] * self.side + w_taps[:, None, :]).reshape(-1, 4)
        weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
        return indices, weights

    def _position_embedding(self, indices: Tensor, weights: Tensor) -> Tensor:
        return (self.pos_embed[indices] * weights[:, :, None].to(self.pos_embed.dtype)).sum(1)

    def _rotary(self, gh: int, gw: int) -> tuple[Tensor, Tensor]:
        row, col = self._rows_cols(gh, gw)
        freqs = torch.stack([row, col], dim=1).float()[:, :, None] * self.inv_freq  # [n, 2, head_dim / 4]
        angles = freqs.flatten(1)  # rows' angles, then columns'
        angles = torch.cat([angles, angles], dim=-1)  # [n, head_dim]
        return angles.cos(), angles.sin()

    # ---- forward --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def __call__(self, images: list[PreparedImage]) -> list[Tensor]:
        """Feature rows [num_tokens, out_hidden] per image (serving dtype), in <|image_pad|> order.

        What holds every patch at once is the fp32 residual stream and each block's q, k and v in the serving
        dtype (attention is over the whole image); everything else (the patch embedding, norms, the rotary's
        fp32 temporaries, the projections, attention's queries and output, the MLP, the merger) runs ROW_CHUNK
        patches at a time, so the peak is bounded (clef_cuda.serving.plan.vision_peak_bytes counts it) and a
        16k-token image fits beside a small card's cache."""
        if not images:
            return []
        c = self.config
        lengths = [img.num_patches for img in images]
        n, heads = sum(lengths), c.num_heads
        # The pixels stay where they are (host memory), moved a chunk at a time; one image is not copied.
        pixels = images[0].pixel_values if len(images) == 1 else torch.cat([img.pixel_values for img in images])
        taps = [self._position_taps(*img.grid) for img in images]
        tap_rows, tap_weights = torch.cat([t[0] for t in taps]), torch.cat([t[1] for t in taps])
        rotary = [self._rotary(*img.grid) for img in images]
        cos, sin = torch.cat([r[0] for r in rotary]), torch.cat([r[1] for r in rotary])
        x = torch.empty(n, c.hidden_size, dtype=torch.float32, device=self.device)
        for rows in _chunks(n):
            x[rows] = F.linear(pixels[rows].to(self.device, self.dtype), self.patch_weight, self.patch_bias).float()
            x[rows] += self._position_embedding(tap_rows[rows], tap_weights[rows]).float()
        head_dim = c.hidden_size // heads
        qkv = torch.empty(3, heads, n, head_dim, dtype=self.dtype, device=self.device)  # per head: SDPA's layout
        for block in self.blocks:
            for rows in _chunks(n):
                part = F.linear(_layer_norm(x[rows], block.norm1).to(self.dtype), *block.qkv)
                q, k, v = part.reshape(-1, 3, heads, head_dim).unbind(1)
                qkv[0, :, rows] = _rotate(q, cos[rows], sin[rows]).to(self.dtype).transpose(0, 1)
                qkv[1, :, rows] = _rotate(k, cos[rows], sin[rows]).to(self.dtype).transpose(0, 1)
                qkv[2, :, rows] = v.transpose(0, 1)
            # The block's every q, k and v exist before any row's residual changes, so a chunk of query rows
            # finishes the block on its own (attention over each of its images' keys, then the projection and the
            # MLP on the whole chunk: many small images, a video's frame pairs, share one matmul): no attention
            # output is ever held for more than a chunk.
            for rows in _chunks(n):
                attended = torch.empty(rows.stop - rows.start, c.hidden_size, dtype=self.dtype, device=self.device)
                for image, part in _pieces(lengths, rows):  # bidirectional within each image only
                    out = F.scaled_dot_product_attention(qkv[0:1, :, part], qkv[1:2, :, image], qkv[2:3, :, image])
                    at = slice(part.start - rows.start, part.stop - rows.start)
                    attended[at] = out[0].transpose(0, 1).reshape(part.stop - part.start, -1)
                x[rows] += F.linear(attended, *block.proj).float()
                h = _layer_norm(x[rows], block.norm2).to(self.dtype)
                x[rows] += F.linear(F.gelu(F.linear(h, *block.fc1), approximate="tanh"), *block.fc2).float()
        del qkv
        merge = c.spatial_merge_size**2
        out = torch.empty(n // merge, c.out_hidden_size, dtype=self.dtype, device=self.device)
        for rows in _chunks(n, multiple=merge):
            merged = _layer_norm(x[rows], self.merger_norm).to(self.dtype).reshape(-1, c.hidden_size * merge)
            merged_rows = slice(rows.start // merge, rows.stop // merge)
            out[merged_rows] = F.linear(F.gelu(F.linear(merged, *self.merger_fc1)), *self.merger_fc2)
        return list(out.split([length // merge for length in lengths]))


# Patches a row-wise step of the tower takes at once (clef_cuda.serving.plan counts its temporaries).
ROW_CHUNK = 4096


def _chunks(n: int, multiple: int = 1) -> list[slice]:
    step = ROW_CHUNK - ROW_CHUNK % multiple
    return [slice(start, min(start + step, n)) for start in range(0, n, step)]


def _pieces(lengths: list[int], rows: slice) -> list[tuple[slice, slice]]:
    """(an image's rows, the part of them inside `rows`) for each of the packed images of `lengths` rows that `rows`
    reaches."""
    pieces, start = [], 0
    for length in lengths:
        low, high = max(start, rows.start), min(start + length, rows.stop)
        if low < high:
            pieces.append((slice(start, start + length), slice(low, high)))
        start += length
        if start >= rows.stop:
            break
    return pieces


def _layer_norm(x: Tensor, weight_bias: tuple[Tensor, Tensor]) -> Tensor:
    weight, bias = weight_bias
    return F.layer_norm(x.float(), x.shape[-1:], weight.float(), bias.float(), LN_EPS)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """NeoX rotate-half over the whole head, in fp32 (the angles broadcast over heads)."""
    x = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
