"""Group-limited top-k routing as transformers (and SGLang, DeepSeek) compute it, for megatron-core's routers.

DeepSeek-V3's router (also GLM-4.5's, with one group) splits the experts into `n_group` groups, scores each group by
the sum of its **two** best choice scores (sigmoid + `e_score_correction_bias`), keeps the best `topk_group` groups
and takes the top-k experts of those. megatron-core 0.16.1 (`moe_utils.group_limited_topk`) scores a group by the
sum of its best `topk // group_topk` instead: the same only where that is 2 (DeepSeek-V3 / R1: 8 // 4). A router's
`router_replay` hook is the one place megatron-core lets a caller choose the top-k (it hands the hook the choice
scores and takes the ids back, then weighs the chosen experts by their unbiased sigmoid scores itself), so every
grouped router gets one: `GroupLimitedTopK` here, or moe_router.py's replay hook, which masks the same groups
before asking the routing replay.

Not the routing replay (moe_router.py) and not the weights (megatron-core's: the unbiased sigmoid scores at the
chosen ids, renormalised, times the routed scaling factor).
"""

from __future__ import annotations

import torch

NUM_EXPERTS_PER_GROUP_SCORE = 2  # transformers: scores.view(-1, n_group, E // n_group).topk(2)[0].sum(-1)


def group_masked_scores(scores: torch.Tensor, num_groups: int | None, group_topk: int | None) -> torch.Tensor:
    """`scores` [tokens, experts] with the experts of every dropped group at -inf (unchanged without groups)."""
    if not num_groups or num_groups == 1:
        return scores
    num_tokens, num_experts = scores.shape
    grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(NUM_EXPERTS_PER_GROUP_SCORE, dim=-1).values.sum(dim=-1)
    kept = group_scores.topk(group_topk, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(num_tokens, num_experts)


class GroupLimitedTopK:
    """A router's `router_replay` hook that routes freely with transformers' group rule."""

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups, group_topk, compute_topk):
        expert_ids = group_masked_scores(scores, num_groups, group_topk).topk(topk, dim=-1).indices
        return scores.gather(1, expert_ids), expert_ids


def install_group_limited_topk(model) -> None:
    """Give every router of `model` (a GPTModel with grouped routers) the transformers group rule."""
    for layer in model.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            router.router_replay = GroupLimitedTopK()
