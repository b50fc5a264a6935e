"""The sparse feed-forward block of GLM-4.5 / 4.6 / 4.7 (and of the DeepSeek-V3 family, same router and experts):
the router `gate` (a float32 [num_experts, hidden] weight and the float32 `e_score_correction_bias` BUFFER), the
routed experts, and an always-on shared expert without a gate (`shared_experts`, HF's name).

The router is `layers/grouped_router.select_experts_grouped` on float32 logits (transformers keeps the gate in
float32 whatever the model's dtype; so does this block). The correction bias is loaded from the checkpoint
(`weight_loader` loads this one buffer by name) and never sent by a trainer: a weight push leaves it as loaded, and
a released engine keeps it on the device (buffers are not released). Routed ids go to `routed_experts_cache` like
`moe_block.SparseMoeBlock`'s. Not the softmax router of Qwen-MoE (`moe_block.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slime.engine.layers.grouped_router import select_experts_grouped
from slime.engine.layers.moe import GroupedExperts
from slime.engine.models.dense_mlp import DenseMLP
from slime.engine.models.model_config import ModelConfig
from slime.engine.parallel.state import SINGLE, ParallelState

CORRECTION_BIAS = "e_score_correction_bias"  # the router's one checkpoint buffer (weight_loader loads it)


class SigmoidRouter(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.register_buffer(CORRECTION_BIAS, torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 router logits [num_tokens, num_experts]."""
        return F.linear(hidden.float(), self.weight.float())


class SigmoidMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelState = SINGLE):
        super().__init__()
        self.parallel = parallel
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.routed_scaling_factor = config.routed_scaling_factor
        self.gate = SigmoidRouter(config.num_experts, config.hidden_size)
        self.experts = GroupedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                      parallel)
        self.has_shared_expert = config.shared_expert_intermediate_size > 0
        if self.has_shared_expert:
            self.shared_experts = DenseMLP(config.hidden_size, config.shared_expert_intermediate_size, parallel,
                                           reduce_output=False, what="n_shared_experts * moe_intermediate_size")
        self.routed_experts_cache: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = select_experts_grouped(
            self.gate(hidden), self.gate.e_score_correction_bias, self.top_k, self.n_group, self.topk_group,
            self.routed_scaling_factor, self.norm_topk_prob)
        if self.routed_experts_cache is not None:
            self.routed_experts_cache[slot_mapping] = expert_ids.to(torch.int32)
        out = self.experts(hidden, expert_ids, weights.to(hidden.dtype))
        if self.has_shared_expert:
            out = out + self.shared_experts(hidden)
        return self.parallel.all_reduce(out)
