"""The Qwen3.5 vision tower (`model.visual.*`), in torch: prepared images -> one feature row per merged
2x2 patch block, in the trunk's hidden size (shared/specs/vision.md, "The vision tower").

patch embedding (the Conv3d with kernel = stride is a GEMM over each 1536-float patch row), the learned
position grid bilinearly resampled to each image's grid, 2D rotary in fp32, `depth` pre-norm blocks with
bidirectional attention inside each image (SDPA per image over the packed rows: varlen), then the merger
(LayerNorm per patch, 4 patches as one row, Linear, exact GELU, Linear). All images of a step go through
every GEMM together; only attention is per image. Matrix multiplies run in the serving dtype; the
residual stream, norms and rotary angles in fp32.
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

    def _position_embedding(self, gh: int, gw: int) -> Tensor:
        row, col = self._rows_cols(gh, gw)
        h_taps, h_weights = self._axis_taps(row, gh)
        w_taps, w_weights = self._axis_taps(col, gw)
        indices = (h_taps[:, :, None] * self.side + w_taps[:, None, :]).reshape(-1, 4)
        weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
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
        """Feature rows [num_tokens, out_hidden] per image (serving dtype), in <|image_pad|> order."""
        if not images:
            return []
        c = self.config
        lengths = [img.grid[0] * img.grid[1] for img in images]
        pixels = torch.cat([img.pixel_values for img in images]).to(self.device, self.dtype)
        x = F.linear(pixels, self.patch_weight, self.patch_bias).float()
        x += torch.cat([self._position_embedding(*img.grid) for img in images]).float()
        rotary = [self._rotary(*img.grid) for img in images]
        cos, sin = torch.cat([r[0] for r in rotary]), torch.cat([r[1] for r in rotary])
        for block in self.blocks:
            x = x + self._attention(block, x, lengths, cos, sin)
            h = _layer_norm(x, block.norm2).to(self.dtype)
            x = x + F.linear(F.gelu(F.linear(h, *block.fc1), approximate="tanh"), *block.fc2).float()
        merged = _layer_norm(x, self.merger_norm).to(self.dtype).reshape(-1, c.hidden_size * c.spatial_merge_size**2)
        out = F.linear(F.gelu(F.linear(merged, *self.merger_fc1)), *self.merger_fc2)
        return list(out.split([n // c.spatial_merge_size**2 for n in lengths]))

    def _attention(self, block: _Block, x: Tensor, lengths: list[int], cos: Tensor, sin: Tensor) -> Tensor:
        c = self.config
        n, heads = x.shape[0], c.num_heads
        qkv = F.linear(_layer_norm(x, block.norm1).to(self.dtype), *block.qkv).reshape(n, 3, heads, -1)
        q, k, v = qkv.unbind(1)
        q, k = _rotate(q, cos, sin).to(self.dtype), _rotate(k, cos, sin).to(self.dtype)
        outputs, start = [], 0
        for length in lengths:  # bidirectional within each image only
            rows = slice(start, start + length)
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
            )
            outputs.append(o[0].transpose(0, 1).reshape(length, -1))
            start += length
        return F.linear(torch.cat(outputs), *block.proj).float()


def _layer_norm(x: Tensor, weight_bias: tuple[Tensor, Tensor]) -> Tensor:
    weight, bias = weight_bias
    return F.layer_norm(x.float(), x.shape[-1:], weight.float(), bias.float(), LN_EPS)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """NeoX rotate-half over the whole head, in fp32 (the angles broadcast over heads)."""
    x = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
