"""The batch-invariant ops of `--true-on-policy-mode`, shared by the engine and both trainers.

A token's numbers must not depend on which other tokens share its computation (the batch, a prefill chunk, a
prefix-cache hit, a packed micro-batch). Every op whose rounding is not exact (a matmul, a reduction, exp / cos) is
therefore called on a *position-aligned tile*: exactly `TILE_ROWS` rows, the token at absolute position p sitting in
row p % TILE_ROWS of tile p // TILE_ROWS, the rows it does not own zero or ignored. The same call with the same
shapes and the same row runs the same instructions on that row whatever the other rows hold (no kernel reduces
across rows), so the engine decoding one token and the trainer scoring the whole sequence get the same bits.
Attention of tile j reads the keys of positions [0, (j + 1) * TILE_ROWS) (a fixed shape for j), masked causally.
Exactly rounded elementwise ops (add, multiply, divide, select) may run at any shape.

Pure torch; differentiable (the trainer backpropagates through them). Not a kernel library: no fusion, no speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TILE_ROWS = 16


def num_tiles(num_positions: int) -> int:
    return -(-num_positions // TILE_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [TILE_ROWS, in] @ weight[out, in].T (+ bias)."""
    assert x.shape[0] == TILE_ROWS, x.shape
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float32, scaled by `weight` in the input's dtype (Qwen / Llama)."""
    assert x.shape[0] == TILE_ROWS, x.shape
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[TILE_ROWS, 2I] (gate; up) -> silu(gate) * up [TILE_ROWS, I]."""
    assert gate_up.shape[0] == TILE_ROWS, gate_up.shape
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_tables(tile_index: int, rotary_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [TILE_ROWS, rotary_dim // 2] float32 of the positions of tile `tile_index` (NeoX-style RoPE)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float()
                                / rotary_dim))
    start = tile_index * TILE_ROWS
    positions = torch.arange(start, start + TILE_ROWS, dtype=torch.float32, device=device)
    freqs = positions[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [TILE_ROWS, heads, head_dim] rotated (rotate-half over the whole head) in float32, back in x's dtype."""
    half = x.shape[-1] // 2
    x32 = x.float()
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile_index: int,
                     scale: float) -> torch.Tensor:
    """Softmax attention of tile `tile_index`'s queries q [TILE_ROWS, heads, D] over the keys and values of
    positions [0, (tile_index + 1) * TILE_ROWS), k / v [that many, kv_heads, D]; row r sees positions <= the tile's
    start + r. Returns [TILE_ROWS, heads * D]. Masked keys get probability exactly 0 (their values must be
    finite)."""
    num_keys = (tile_index + 1) * TILE_ROWS
    assert q.shape[0] == TILE_ROWS and k.shape[0] == num_keys == v.shape[0], (q.shape, k.shape, tile_index)
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    qh = q.transpose(0, 1).contiguous()
    kh = k.transpose(0, 1).repeat_interleave(group, dim=0)
    vh = v.transpose(0, 1).repeat_interleave(group, dim=0)
    scores = torch.matmul(qh, kh.transpose(1, 2)).float() * scale
    rows = torch.arange(tile_index * TILE_ROWS, num_keys, device=q.device)
    masked = torch.arange(num_keys, device=q.device)[None, :] > rows[:, None]
    probs = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1).to(v.dtype)
    return torch.matmul(probs, vh).transpose(0, 1).reshape(TILE_ROWS, num_heads * q.shape[-1])


def log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) [TILE_ROWS, vocab] in float32; temperature 0 (greedy) counts as 1, as the
    sampler's log-probs do."""
    assert logits.shape[0] == TILE_ROWS, logits.shape
    divisor = float(temperature) if temperature > 0 else 1.0
    return torch.log_softmax(logits.float() / divisor, dim=-1)


def entropy(log_probs: torch.Tensor) -> torch.Tensor:
    """Entropy [TILE_ROWS] of each row of a log_softmax tile."""
    return -(log_probs.exp() * log_probs).sum(-1)
