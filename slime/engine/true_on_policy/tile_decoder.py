"""The dense decoder of `--true-on-policy-mode` written once over position-aligned tiles (tile_ops.py): the engine
runs it on the tiles a step's new tokens fall in, the trainers on every tile of each sample, so the engine's
log-prob of a sampled token and the trainer's are the same bits.

Weights come as `LayerWeights` views of either side's parameters: the engine's fused `qkv_proj` / `gate_up_proj`,
the trainer's q/k/v and gate/up concatenated in that order (the matmul then has the same shape on both sides).
A layer's keys and values live in `LayerKV`, one entry per tile; a tile's rows outside the positions being computed
keep what they held. Covered: Qwen2 / Qwen2.5 / Qwen3 / Llama-shaped dense layers without RoPE scaling, and
Qwen3-MoE's routed-expert layers (tile_moe.py; contract.py refuses the rest by name). Not the engine's serving path (models/decoder.py) and not fast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slime.engine.true_on_policy import tile_ops
from slime.engine.true_on_policy.tile_lora import LayerLora, adapted_linear
from slime.engine.true_on_policy.tile_moe import MoeWeights, moe_tile
from slime.engine.true_on_policy.tile_ops import TILE_ROWS


@dataclass(frozen=True)
class DecoderSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    qk_norm: bool


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv_weight: torch.Tensor  # [q; k; v] rows
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_weight: torch.Tensor
    post_norm: torch.Tensor
    gate_up_weight: torch.Tensor | None  # [gate; up] rows (None in a MoE layer)
    down_weight: torch.Tensor | None
    moe: MoeWeights | None = None  # a MoE layer's router and routed experts
    lora: LayerLora | None = None  # a LoRA adapter's pairs on this layer's linears (tile_lora.py)


class LayerKV:
    """One layer's keys and values, [TILE_ROWS, kv_heads, head_dim] per tile index."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def store(self, tile_index: int, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor) -> None:
        """Write the rows where `rows` [TILE_ROWS] bool is set; the tile's other rows keep their values."""
        if tile_index == len(self.keys):
            self.keys.append(torch.zeros_like(keys))
            self.values.append(torch.zeros_like(values))
        assert tile_index < len(self.keys), "tiles are computed in order"
        select = rows[:, None, None]
        self.keys[tile_index] = torch.where(select, keys, self.keys[tile_index])
        self.values[tile_index] = torch.where(select, values, self.values[tile_index])

    def through(self, tile_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of tiles 0..tile_index, [(tile_index + 1) * TILE_ROWS, kv_heads, head_dim]."""
        return torch.cat(self.keys[: tile_index + 1]), torch.cat(self.values[: tile_index + 1])


def row_mask(tile_index: int, start: int, end: int, device) -> torch.Tensor:
    """[TILE_ROWS] bool: the tile's rows whose positions lie in [start, end)."""
    positions = torch.arange(tile_index * TILE_ROWS, (tile_index + 1) * TILE_ROWS, device=device)
    return (positions >= start) & (positions < end)


def attention(spec: DecoderSpec, w: LayerWeights, normed: torch.Tensor, tile_index: int, kv: LayerKV,
              rows: torch.Tensor) -> torch.Tensor:
    q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    qkv = adapted_linear(normed, w.qkv_weight, w.qkv_bias, w.lora, "qkv", [q_size, kv_size, kv_size])
    q = qkv[:, :q_size].reshape(TILE_ROWS, spec.num_heads, spec.head_dim)
    k = qkv[:, q_size : q_size + kv_size].reshape(TILE_ROWS, spec.num_kv_heads, spec.head_dim)
    v = qkv[:, q_size + kv_size :].reshape(TILE_ROWS, spec.num_kv_heads, spec.head_dim)
    if spec.qk_norm:
        q = tile_ops.rms_norm(q, w.q_norm, spec.rms_norm_eps)
        k = tile_ops.rms_norm(k, w.k_norm, spec.rms_norm_eps)
    cos, sin = tile_ops.rope_tables(tile_index, spec.head_dim, spec.rope_theta, normed.device)
    q, k = tile_ops.apply_rope(q, cos, sin), tile_ops.apply_rope(k, cos, sin)
    kv.store(tile_index, k, v, rows)
    keys, values = kv.through(tile_index)
    out = tile_ops.causal_attention(q, keys, values, tile_index, spec.head_dim ** -0.5)
    return adapted_linear(out, w.o_weight, None, w.lora, "o", [w.o_weight.shape[0]])


def layer_tile(spec: DecoderSpec, w: LayerWeights, hidden: torch.Tensor, tile_index: int, kv: LayerKV,
               rows: torch.Tensor, routing: torch.Tensor | None = None,
               chosen: list | None = None) -> torch.Tensor:
    """One tile [TILE_ROWS, hidden] of the residual stream through one pre-norm layer. A MoE layer replays
    `routing` [TILE_ROWS, top_k] (tile_moe.FREE_ROW rows route freely) and appends its expert ids to `chosen`."""
    hidden = hidden + attention(spec, w, tile_ops.rms_norm(hidden, w.input_norm, spec.rms_norm_eps), tile_index,
                                kv, rows)
    normed = tile_ops.rms_norm(hidden, w.post_norm, spec.rms_norm_eps)
    if w.moe is not None:
        out, expert_ids = moe_tile(w.moe, normed, routing)
        if chosen is not None:
            chosen.append(expert_ids)
        return hidden + out
    intermediate = w.gate_up_weight.shape[0] // 2
    gate_up = adapted_linear(normed, w.gate_up_weight, None, w.lora, "gate_up", [intermediate, intermediate])
    return hidden + adapted_linear(tile_ops.silu_mul(gate_up), w.down_weight, None, w.lora, "down",
                                   [w.down_weight.shape[0]])


def layer_tiles(spec: DecoderSpec, w: LayerWeights, hidden: torch.Tensor, first_tile: int, kv: LayerKV,
                start: int, end: int, routing: torch.Tensor | None = None,
                chosen: list | None = None) -> torch.Tensor:
    """Tiles first_tile.. of one sequence, hidden [num_tiles, TILE_ROWS, hidden], through one layer, in order;
    K/V are stored for positions [start, end) only. A MoE layer replays `routing` [num_tiles, TILE_ROWS, top_k]
    and appends each tile's expert ids to `chosen`."""
    return torch.stack([
        layer_tile(spec, w, tile, first_tile + i, kv, row_mask(first_tile + i, start, end, hidden.device),
                   None if routing is None else routing[i], chosen)
        for i, tile in enumerate(hidden)
    ])


def token_tiles(token_ids: torch.Tensor, first_position: int) -> tuple[torch.Tensor, int]:
    """Token ids [n] starting at absolute position `first_position` laid out as [num_tiles, TILE_ROWS] (the rows
    they do not fill hold token 0), and the first tile's index."""
    first_tile = first_position // TILE_ROWS
    last = first_position + token_ids.shape[0]
    tiles = token_ids.new_zeros(((last - 1) // TILE_ROWS + 1 - first_tile) * TILE_ROWS)
    offset = first_position - first_tile * TILE_ROWS
    tiles[offset : offset + token_ids.shape[0]] = token_ids
    return tiles.view(-1, TILE_ROWS), first_tile


def tile_log_probs(final_normed: torch.Tensor, lm_head: torch.Tensor, temperature: float) -> torch.Tensor:
    """[num_tiles, TILE_ROWS, vocab] log_softmax(logits / temperature) of tiles of final hidden states."""
    return torch.stack([tile_ops.log_softmax(tile_ops.linear(tile, lm_head), temperature) for tile in final_normed])


def final_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.stack([tile_ops.rms_norm(tile, weight, eps) for tile in hidden])
