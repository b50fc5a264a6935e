"""The engine's biased, group-limited sigmoid router (`layers/grouped_router.py`) against transformers' routers of
GLM-4.5 (`Glm4MoeTopkRouter`) and DeepSeek-V3 (`DeepseekV3TopkRouter`): same expert sets and weights for one group
and for real group limits, with norm_topk_prob on and off; and the two halves (choice, weights) on their own."""

import pytest
import torch
from transformers import DeepseekV3Config, Glm4MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

from slime.engine.layers.grouped_router import choice_scores, routed_weights, select_experts_grouped

CASES = [  # (router class, config class, num_experts, top_k, n_group, topk_group, norm_topk_prob)
    (Glm4MoeTopkRouter, Glm4MoeConfig, 16, 4, 1, 1, True),
    (Glm4MoeTopkRouter, Glm4MoeConfig, 16, 3, 4, 2, False),
    (DeepseekV3TopkRouter, DeepseekV3Config, 32, 8, 8, 4, True),
    (DeepseekV3TopkRouter, DeepseekV3Config, 24, 6, 6, 3, False),
]


@pytest.mark.parametrize("router_class, config_class, num_experts, top_k, n_group, topk_group, norm", CASES)
def test_matches_transformers(router_class, config_class, num_experts, top_k, n_group, topk_group, norm):
    config = config_class(hidden_size=32, n_routed_experts=num_experts, num_experts_per_tok=top_k, n_group=n_group,
                          topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
    router = router_class(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(std=0.5, generator=generator)
        router.e_score_correction_bias.normal_(std=0.5, generator=generator)
    hidden = torch.randn(64, 32, generator=generator)
    with torch.no_grad():
        logits, expected_weights, expected_ids = router(hidden)
        weights, ids = select_experts_grouped(logits, router.e_score_correction_bias, top_k, n_group, topk_group,
                                              2.5, norm)
    expected_order = expected_ids.sort(dim=-1)
    order = ids.sort(dim=-1)
    assert torch.equal(order.values, expected_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), expected_weights.gather(1, expected_order.indices),
                               atol=1e-6, rtol=1e-6)
    # The bias changes the choice on these numbers (else the test could not see it ignored).
    unbiased = select_experts_grouped(logits, None, top_k, n_group, topk_group, 2.5, norm)[1]
    assert not torch.equal(unbiased.sort(dim=-1).values, order.values)


def test_group_limit_masks_whole_groups():
    # 2 groups of 4; group 1 holds the single best expert but group 0 has the better top-2 sum.
    scores = torch.tensor([[0.80, 0.79, 0.10, 0.10, 0.95, 0.05, 0.05, 0.05]])
    masked = choice_scores(scores, None, n_group=2, topk_group=1)
    assert torch.isinf(masked[0, 4:]).all() and torch.equal(masked[0, :4], scores[0, :4])
    ids = torch.topk(masked, 2, dim=-1).indices
    assert sorted(ids[0].tolist()) == [0, 1]  # a plain top-2 would take expert 4


def test_weights_come_from_unbiased_scores():
    scores = torch.tensor([[0.2, 0.6, 0.9, 0.1]])
    bias = torch.tensor([5.0, 0.0, 0.0, 0.0])
    ids = torch.topk(choice_scores(scores, bias, 1, 1), 2, dim=-1).indices
    assert sorted(ids[0].tolist()) == [0, 2]
    weights = routed_weights(scores, ids, 2.0, norm_topk_prob=True)
    expected = scores.gather(1, ids) / scores.gather(1, ids).sum() * 2.0
    torch.testing.assert_close(weights, expected)


def test_refuses_uneven_groups():
    with pytest.raises(ValueError, match="n_group=3"):
        choice_scores(torch.rand(2, 8), None, n_group=3, topk_group=2)
