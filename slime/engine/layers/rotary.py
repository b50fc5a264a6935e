"""Rotary position embedding (rotate-half convention of HF Llama / Qwen), with the "llama3" frequency scaling, and
the partial variants of the GLM families: only the first `rotary_dim` dims of a head rotate (GLM-4 / GLM-4.5:
half the head), as rotate-half pairs (i, i + rotary_dim / 2) (GLM-4.5, NeoX style) or as adjacent pairs (2i, 2i + 1)
(`interleaved`, GLM-4 dense, GPT-J style); the remaining dims pass unchanged.

The cos/sin table is precomputed for max_position_embeddings positions, in the layout of the pairs (halves repeated
for rotate-half, each frequency twice in a row for interleaved), and indexed by each token's position, so any mix
of prefill chunks and decode tokens is handled by one gather. Other rope scaling types are rejected by
`slime.engine.models.model_config`, not here. The fused Triton kernels (`triton_fused.qkv_rope_store`) read the same
tables (their width is the rotary dims) and compute the same rotations.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    original_max_positions = scaling["original_max_position_embeddings"]
    low_freq_wavelen = original_max_positions / low_freq_factor
    high_freq_wavelen = original_max_positions / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None,
                 rotary_dim: int | None = None, interleaved: bool = False):
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary dims {rotary_dim}: must be even and in (0, head_dim={head_dim}] "
                             "(config.json partial_rotary_factor * head_dim)")
        self.head_dim, self.rotary_dim, self.interleaved = head_dim, rotary_dim, interleaved
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        if scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self._positions: torch.Tensor | None = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]."""
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, any number of heads, head_dim] rotated by each token's position."""
        # Every layer of one forward pass gets the same positions tensor (the table is shared): look it up once.
        if positions is not self._positions:
            self._positions = positions
            self._cos_sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        if self.rotary_dim == x.shape[-1]:
            return _apply(x, *self._cos_sin, self.interleaved)
        rotating, passing = x.split([self.rotary_dim, x.shape[-1] - self.rotary_dim], dim=-1)
        return torch.cat((_apply(rotating, *self._cos_sin, self.interleaved), passing), dim=-1)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    if interleaved:  # pairs (2i, 2i + 1): (-x[2i + 1], x[2i]) in place of each pair
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(dtype)
