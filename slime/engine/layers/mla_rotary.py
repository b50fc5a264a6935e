"""The rotary embedding of multi-head latent attention: applied to the qk_rope_head_dim slice only (the query's rope
part per head and the one k_pe all heads share), with DeepSeek-YaRN frequencies and magnitude, and DeepSeek's
interleaved layout.

Interleaved (`rope_interleave`, DeepSeek's checkpoints): dims (x0, x1), (x2, x3), ... are the rotated pairs. As in
transformers, the rotation is computed on the de-interleaved vector [x0, x2, ...| x1, x3, ...] with the rotate-half
formula, so the output is in that de-interleaved order; q and k get the same permutation, so their dot products
(all that attention reads, the latent cache included) equal the interleaved rotation's. Not the Llama / Qwen rotary
of the full head (`rotary.py`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from slime.engine.models.mla_config import MLAConfig, YarnScaling, yarn_mscale


def yarn_inv_freq(dim: int, theta: float, yarn: YarnScaling) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim // 2], cos/sin magnitude) of DeepSeek-YaRN (transformers' yarn parameters)."""
    factor = yarn.factor
    attention_factor = yarn.attention_factor
    if attention_factor is None:
        if yarn.mscale and yarn.mscale_all_dim:
            attention_factor = yarn_mscale(factor, yarn.mscale) / yarn_mscale(factor, yarn.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = yarn.beta_fast or 32, yarn.beta_slow or 1

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_share = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_share) + (1.0 / pos_freqs) * extrapolation_share
    return inv_freq, float(attention_factor)


class MLARotaryEmbedding(nn.Module):
    def __init__(self, mla: MLAConfig, max_position: int, theta: float):
        super().__init__()
        dim = mla.qk_rope_head_dim
        if mla.yarn is None:
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            magnitude = 1.0
        else:
            inv_freq, magnitude = yarn_inv_freq(dim, theta, mla.yarn)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * magnitude, persistent=False)
        self.register_buffer("sin", emb.sin() * magnitude, persistent=False)
        self.interleave = mla.rope_interleave
        self._positions: torch.Tensor | None = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, any number of heads, qk_rope_head_dim] rotated by each token's position."""
        if positions is not self._positions:  # every layer of one forward gets the same positions tensor
            self._positions = positions
            self._cos_sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        cos, sin = self._cos_sin
        dtype = x.dtype
        x = x.float()
        if self.interleave:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos + rotated * sin).to(dtype)
