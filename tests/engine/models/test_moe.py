"""The engine's MoE pieces against independent references: the grouped (sorted-by-expert) expert compute, through
torch's grouped_mm and through the per-expert fallback, equals evaluating every selected expert token by token; the
router equals transformers' Qwen3-MoE router (same weights, same ids and weights, norm_topk_prob on and off)."""

import pytest
import torch
import torch.nn.functional as F

from slime.engine.layers.moe import GroupedExperts, grouped_mm_available, select_experts


def token_by_token(experts: GroupedExperts, hidden, expert_ids, weights):
    out = torch.zeros_like(hidden)
    for token in range(hidden.shape[0]):
        for slot in range(expert_ids.shape[1]):
            expert = int(expert_ids[token, slot])
            gate, up = (experts.gate_up_proj[expert] @ hidden[token]).chunk(2)
            out[token] += weights[token, slot] * (experts.down_proj[expert] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_grouped_experts_match_token_by_token(use_grouped_mm):
    if use_grouped_mm and not grouped_mm_available():
        pytest.skip("this torch has no torch.nn.functional.grouped_mm")
    generator = torch.Generator().manual_seed(0)
    experts = GroupedExperts(num_experts=6, hidden_size=16, intermediate_size=8)
    with torch.no_grad():
        experts.gate_up_proj.normal_(generator=generator)
        experts.down_proj.normal_(generator=generator)
    experts.use_grouped_mm = use_grouped_mm
    hidden = torch.randn(11, 16, generator=generator)
    # Expert 4 gets no token: an empty group in the middle of the offsets.
    expert_ids = torch.tensor([[0, 5], [5, 0], [1, 2], [2, 3], [3, 1], [0, 1], [5, 2], [2, 0], [3, 5], [1, 0], [0, 3]])
    weights = torch.rand(11, 2, generator=generator)
    with torch.no_grad():
        got = experts(hidden, expert_ids, weights)
        expected = token_by_token(experts, hidden, expert_ids, weights)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_matches_transformers(norm_topk_prob):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob)
    router = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(20, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden)
        weights, expert_ids = select_experts(hidden @ router.weight.T, 3, norm_topk_prob)
    assert torch.equal(expert_ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights)
    if norm_topk_prob:
        torch.testing.assert_close(weights.sum(-1), torch.ones(20))
