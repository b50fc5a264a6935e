"""The mixture-of-experts feed-forward of `--true-on-policy-mode` (Qwen3-MoE's softmax top-k router and routed
experts, no shared expert), written once over a position-aligned tile (tile_ops.py) for the engine and the trainer.

Per tile: the router is one tile matmul and a row-wise float32 softmax; each token takes the top-k experts (or, under
routing replay R3, the experts given for its row: the trainer replays the engine's picks); its routing weights are
the router probabilities at those experts (renormalized, Qwen3-MoE), so the router still learns. Every expert that a
row of the tile picked runs its MLP on the whole tile ([TILE_ROWS, hidden], one shape for every expert, no
gather of a variable number of tokens), so a token's expert output is computed on its own tile row whatever the other
rows route to. The combine adds the top-k slots in slot order (select and multiply-add: exactly rounded). Not fast:
an expert picked by any row of the tile computes all TILE_ROWS rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slime.engine.true_on_policy import tile_ops

FREE_ROW = -1  # a routing row that the router fills itself (the same value as backends/routing_replay.py's)


@dataclass
class MoeWeights:
    router: torch.Tensor  # [num_experts, hidden]
    gate_up: torch.Tensor  # [num_experts, 2 * intermediate, hidden], gate rows first
    down: torch.Tensor  # [num_experts, hidden, intermediate]
    top_k: int
    norm_topk_prob: bool


def route(w: MoeWeights, normed: torch.Tensor, given: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [TILE_ROWS, top_k] in normed's dtype, expert ids [TILE_ROWS, top_k]) of a tile; `given`
    [TILE_ROWS, top_k] replays a row's experts unless its first entry is FREE_ROW."""
    probs = torch.softmax(tile_ops.linear(normed, w.router), dim=-1, dtype=torch.float32)
    expert_ids = torch.topk(probs, w.top_k, dim=-1).indices
    if given is not None:
        given = given.to(device=expert_ids.device, dtype=expert_ids.dtype)
        expert_ids = torch.where(given[:, :1] != FREE_ROW, given, expert_ids)
    weights = probs.gather(-1, expert_ids)
    if w.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(normed.dtype), expert_ids


def expert_mlp(w: MoeWeights, expert: int, normed: torch.Tensor) -> torch.Tensor:
    return tile_ops.linear(tile_ops.silu_mul(tile_ops.linear(normed, w.gate_up[expert])), w.down[expert])


def moe_tile(w: MoeWeights, normed: torch.Tensor, given: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [TILE_ROWS, hidden], expert ids [TILE_ROWS, top_k]) of the routed experts on one normed tile."""
    weights, expert_ids = route(w, normed, given)
    outputs = {expert: expert_mlp(w, expert, normed) for expert in sorted(set(expert_ids.flatten().tolist()))}
    out = torch.zeros_like(normed)
    for slot in range(w.top_k):
        picked = torch.zeros_like(normed)
        for expert, output in outputs.items():
            picked = torch.where((expert_ids[:, slot] == expert)[:, None], output, picked)
        out = out + weights[:, slot, None] * picked
    return out, expert_ids
