"""Mixture-of-experts feed-forward for the engine: a top-k softmax router (`select_experts`) and the routed experts
(`GroupedExperts`), computed with the token-expert pairs sorted by expert so every expert's tokens are one
contiguous group.

The groups run as one `torch.nn.functional.grouped_mm` per projection when this torch has it (CPU and CUDA;
static shapes, so decode CUDA graphs capture it: the group offsets are computed on the device, never read on the
host); otherwise as one matmul per expert over its slice. Either way no Python loop over tokens. Expert weights are
stored as transformers 5 stores them in memory: `gate_up_proj` [num_experts, 2 * intermediate, hidden] (gate rows
first) and `down_proj` [num_experts, hidden, intermediate].

Sharded over an engine's ranks (`parallel.state`), a rank holds the experts of its EP block, [first_expert,
first_expert + num_local_experts), each cut to its moe_tp slice of the intermediate dimension: its output is a
partial sum (the caller all-reduces it), and a token-expert pair whose expert lives on another rank contributes
zero here. Such pairs sort after every local group, past the last offset, where grouped_mm computes nothing (its
documented contract: rows beyond offs[-1] are ignored; the shapes stay static), and are masked out of the result.

Not the router's parameters or the shared expert (`models/moe_block.py`), not weight-name mapping
(`models/weight_loader.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slime.engine.layers.activation import SiluAndMul
from slime.engine.parallel.state import SINGLE, ParallelState


def select_experts(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """(weights [num_tokens, top_k] in the logits' dtype, expert ids [num_tokens, top_k]) of a softmax router:
    softmax in float32 over all experts, the top_k largest, renormalized to sum 1 when `norm_topk_prob` (Qwen3-MoE,
    Qwen2-MoE's convention)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), expert_ids


# torch >= 2.10 names it torch.nn.functional.grouped_mm; 2.9 has the same kernel as torch._grouped_mm.
GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_available() -> bool:
    return GROUPED_MM is not None


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 parallel: ParallelState = SINGLE):
        super().__init__()
        self.num_experts = num_experts
        self.num_local_experts = num_experts // parallel.ep_size
        self.first_expert = parallel.ep_rank * self.num_local_experts
        self.intermediate_size = intermediate_size
        self.local_intermediate_size = intermediate_size // parallel.moe_tp_size
        self.moe_tp_rank = parallel.moe_tp_rank
        local, inter = self.num_local_experts, self.local_intermediate_size
        assert local * parallel.ep_size == num_experts and inter * parallel.moe_tp_size == intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(local, 2 * inter, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(local, hidden_size, inter))
        self.act = SiluAndMul()
        # Set by the model runner after checking grouped_mm works for this device and dtype.
        self.use_grouped_mm = grouped_mm_available()

    def forward(self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """hidden [num_tokens, hidden]; expert_ids (global), weights [num_tokens, top_k] -> [num_tokens, hidden]
        (this rank's part of it when the experts are sharded)."""
        num_tokens, top_k = expert_ids.shape
        flat_ids = expert_ids.reshape(-1)
        is_local = None
        if self.num_local_experts != self.num_experts:
            flat_ids = flat_ids - self.first_expert
            is_local = (flat_ids >= 0) & (flat_ids < self.num_local_experts)
            flat_ids = torch.where(is_local, flat_ids, self.num_local_experts)  # after every local group
        sorted_ids, order = torch.sort(flat_ids)
        grouped_hidden = hidden[order // top_k]
        # ends[e] = number of pairs routed to experts <= e: the groups' end offsets, computed on the device.
        expert_range = torch.arange(self.num_local_experts, device=hidden.device)
        ends = torch.searchsorted(sorted_ids, expert_range, right=True).to(torch.int32)
        intermediate = self.act(self._grouped_linear(grouped_hidden, self.gate_up_proj, ends))
        out = self._grouped_linear(intermediate, self.down_proj, ends)
        out = out * weights.reshape(-1)[order].unsqueeze(-1)
        if is_local is not None:  # the other ranks' pairs: rows never computed (uninitialized), replaced
            out = torch.where(is_local[order].unsqueeze(-1), out, 0.0)
        unsorted = torch.empty_like(out).index_copy_(0, order, out)
        return unsorted.view(num_tokens, top_k, -1).sum(dim=1)

    def _grouped_linear(self, grouped: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """grouped [num_pairs, in] sorted by expert; weight [num_experts, out, in] -> [num_pairs, out]."""
        if self.use_grouped_mm:
            return GROUPED_MM(grouped, weight.transpose(-2, -1), offs=ends)
        out = grouped.new_empty(grouped.shape[0], weight.shape[1])
        start = 0
        for expert, end in enumerate(ends.tolist()):
            if end > start:
                out[start:end] = grouped[start:end] @ weight[expert].T
            start = end
        return out
