"""The sparse MoE feed-forward block of Qwen3-MoE and Qwen2-MoE decoder layers: router (`gate`, a bias-free linear
to one logit per expert), routed experts, and Qwen2-MoE's shared expert scaled by its sigmoid gate.

When the model runner gives it a `routed_experts_cache` (a [num_cache_slots, top_k] int32 view, one row per KV-cache
slot), the block writes each token's selected expert ids to its token's slot, so a request's routing can be read
back for every position whose KV it holds, prefix-cache hits included (SGLang's return_routed_experts). Module
names follow Hugging Face's (`mlp.gate`, `mlp.experts`, `mlp.shared_expert`, `mlp.shared_expert_gate`).

Over an engine's ranks the router and the shared expert's gate are replicated (every rank routes every token alike,
so the recorded expert ids are global and equal on every rank), the routed experts are split by EP block and
intermediate slice (`layers/moe.py`) and the shared expert by its intermediate dimension like a dense MLP; the
ranks' partial outputs, routed and shared together, are summed by one all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from slime.engine.layers.moe import GroupedExperts, select_experts
from slime.engine.models.dense_mlp import DenseMLP
from slime.engine.models.model_config import ModelConfig
from slime.engine.parallel.state import SINGLE, ParallelState


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelState = SINGLE):
        super().__init__()
        self.parallel = parallel
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = GroupedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                      parallel)
        self.has_shared_expert = config.shared_expert_intermediate_size > 0
        if self.has_shared_expert:
            self.shared_expert = DenseMLP(config.hidden_size, config.shared_expert_intermediate_size, parallel,
                                          reduce_output=False, what="shared_expert_intermediate_size")
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.routed_experts_cache: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = select_experts(self.gate(hidden), self.top_k, self.norm_topk_prob)
        if self.routed_experts_cache is not None:
            self.routed_experts_cache[slot_mapping] = expert_ids.to(torch.int32)
        out = self.experts(hidden, expert_ids, weights)
        if self.has_shared_expert:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return self.parallel.all_reduce(out)
