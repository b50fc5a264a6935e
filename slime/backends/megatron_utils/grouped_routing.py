"""Group-limited top-k routing as transformers (and SGLang, DeepSeek) compute it, for megatron-core's routers.

DeepSeek-V3's router (also GLM-4.5's, with one group) splits the experts into `n_group` groups, scores each group by
the sum of its **two** best choice scores (sigmoid + `e_score_correction_bias`), keeps the best `topk_group` groups
and takes the top-k experts of those. megatron-core 0.16.1 (`moe_utils.group_limited_topk`) scores a group by the
sum of its best `topk // group_topk` instead: the same only where that is 2 (DeepSeek-V3 / R1: 8 // 4). A router's
`router_replay` hook is the one place megatron-core lets a caller choose the top-k (it hands the hook the choice
scores and takes the ids back, then weighs the chosen experts by their unbiased sigmoid scores itself), so every
grouped router gets one: `GroupLimitedTopK` here, or moe_router.py's replay hook, which masks the same groups
before asking the routing replay.

Not the group rule itself (engine/layers/grouped_router.py's, the engine's and the FSDP trainer's too), not the
routing replay (moe_router.py) and not the weights (megatron-core's: the unbiased sigmoid scores at the
chosen ids, renormalised, times the routed scaling factor).
"""

from __future__ import annotations

import torch

from slime.engine.layers.grouped_router import choice_scores


def group_masked_scores(scores: torch.Tensor, num_groups: int | None, group_topk: int | None) -> torch.Tensor:
    """`scores` [tokens, experts] (the router's choice scores) with the experts of every dropped group at -inf,
    unchanged without groups: the engine's rule (engine/layers/grouped_router.py), shared with the FSDP trainer."""
    if not num_groups or num_groups == 1:
        return scores
    return choice_scores(scores, None, num_groups, group_topk)


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
