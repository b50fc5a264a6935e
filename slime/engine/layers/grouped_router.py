"""The sigmoid router of GLM-4.5 / GLM-4.6 / GLM-4.7 and the DeepSeek-V3 family (DeepSeek V3/R1, Kimi K2, Moonlight),
as pure functions of the router logits: the engine's MoE block and the FSDP trainer's re-bound routers share them.

The math (transformers' `Glm4MoeTopkRouter` / `DeepseekV3TopkRouter`, SGLang's biased grouped top-k):
- scores = sigmoid(logits), in float32;
- choice = scores + e_score_correction_bias: the bias only CHOOSES experts, it never weighs them;
- the experts form `n_group` equal groups; each group is ranked by the sum of its two best choice scores, the best
  `topk_group` groups are kept and every expert of the others is masked to -inf;
- ids = the `top_k` best masked choice scores;
- weights = the UNBIASED scores at those ids, divided by (their sum + 1e-20) when `norm_topk_prob`, times
  `routed_scaling_factor`.

`choice_scores` is the id-choosing half on its own: routing replay picks (or replays) ids on it, then
`routed_weights` gives the weights of whatever ids were used. Not the softmax router of Qwen-MoE
(`layers/moe.py: select_experts`) and not the experts or the shared expert (`models/moe_block.py`).
"""

from __future__ import annotations

import torch

GROUP_SCORE_TOP = 2  # a group's rank: the sum of its best two choice scores (HF, SGLang, DeepSeek's reference code)


def choice_scores(scores: torch.Tensor, correction_bias: torch.Tensor | None, n_group: int,
                  topk_group: int) -> torch.Tensor:
    """Biased scores [num_tokens, num_experts] with the experts of the dropped groups at -inf: a plain top-k over
    them gives the router's ids. `scores` are the unbiased sigmoid scores (float32)."""
    choice = scores if correction_bias is None else scores + correction_bias.to(scores.dtype)
    if n_group <= 1 or topk_group >= n_group:
        return choice
    num_tokens, num_experts = choice.shape
    if num_experts % n_group:
        raise ValueError(f"n_group={n_group} does not divide the {num_experts} routed experts")
    grouped = choice.view(num_tokens, n_group, num_experts // n_group)
    group_scores = grouped.topk(min(GROUP_SCORE_TOP, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    kept_groups = torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    return grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)


def routed_weights(scores: torch.Tensor, expert_ids: torch.Tensor, routed_scaling_factor: float,
                   norm_topk_prob: bool) -> torch.Tensor:
    """The routing weights [num_tokens, top_k] of `expert_ids`: unbiased scores gathered there, renormalised
    (norm_topk_prob), times routed_scaling_factor. Differentiable in `scores`."""
    weights = scores.gather(1, expert_ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor


def select_experts_grouped(router_logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int,
                           n_group: int, topk_group: int, routed_scaling_factor: float,
                           norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [num_tokens, top_k] float32, expert ids [num_tokens, top_k] int64) of the biased, group-limited
    sigmoid router for `router_logits` [num_tokens, num_experts] (computed in float32 by the caller, as HF does).
    The ids are unsorted within a row (like HF's and SGLang's `topk(sorted=False)`): compare them as sets."""
    scores = torch.sigmoid(router_logits.float())
    expert_ids = torch.topk(choice_scores(scores, correction_bias, n_group, topk_group), top_k, dim=-1,
                            sorted=False).indices
    return routed_weights(scores, expert_ids, routed_scaling_factor, norm_topk_prob), expert_ids
