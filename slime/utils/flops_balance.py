"""slime's --balance-by-flops cost model: the forward FLOPs of a sequence of L tokens are proportional to
`coefficient * L + L**2`, with the linear coefficient taken from the model config (slime's flops_utils: the QKV,
output and MLP projections and the LM head are linear in L, causal attention's QK^T and AV quadratic). With it,
each optimizer step's samples are split over the data-parallel ranks (--balance-data, which --balance-by-flops turns
on) and a rank's samples over its micro-batches so that their FLOPs, not their token counts, are even.

The partitions are greedy (largest workload first, into the least-loaded part), not slime's Karmarkar-Karp; the
cost model is slime's. Pure Python (the RolloutManager and the trainers both use it).
"""

from __future__ import annotations

import math


def linear_coefficient(config: dict) -> float:
    """`coefficient` of the cost model for an HF config dict (a multimodal model's text_config)."""
    config = config.get("text_config", config)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    groups = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    num_layers = config["num_hidden_layers"]

    def linear_per_layer(ffn: int) -> int:  # per token: QKV, output projection (slime counts it h x h), MLP
        return 2 * hidden * heads * head_dim + 4 * hidden * groups * head_dim + 2 * hidden * hidden + 6 * hidden * ffn

    num_experts = config.get("num_experts") or config.get("n_routed_experts") or config.get("num_local_experts")
    if num_experts:
        moe_ffn = config["moe_intermediate_size"] * config["num_experts_per_tok"]
        moe_ffn += config.get("shared_expert_intermediate_size") or 0
        dense_layers = len(config.get("mlp_only_layers") or [])
        linear = dense_layers * linear_per_layer(config["intermediate_size"])
        linear += (num_layers - dense_layers) * linear_per_layer(moe_ffn)
    else:
        linear = num_layers * linear_per_layer(config["intermediate_size"])
    linear += 2 * hidden * config["vocab_size"]  # the LM head
    quadratic = num_layers * 2 * heads * head_dim  # causal QK^T (half of L^2) and AV
    return linear / quadratic


def workloads(lengths: list[int], coefficient: float) -> list[float]:
    return [coefficient * length + length * length for length in lengths]


def balanced_micro_batches(indices: list[int], lengths: list[int], max_tokens: int,
                           coefficient: float) -> list[list[int]]:
    """slime's --balance-by-flops packing of one step's samples: ceil(tokens / max_tokens) micro-batches (one per
    sample when that is at least the number of samples) with even FLOPs; a micro-batch may exceed max_tokens."""
    num_bins = max(1, math.ceil(sum(lengths[i] for i in indices) / max_tokens))
    if num_bins >= len(indices):
        return [[i] for i in indices]
    costs = dict(zip(indices, workloads([lengths[i] for i in indices], coefficient)))
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    loads = [0.0] * num_bins
    for index in sorted(indices, key=lambda i: (-costs[i], i)):
        target = min(range(num_bins), key=lambda b: (loads[b], b))
        bins[target].append(index)
        loads[target] += costs[index]
    return [sorted(b) for b in bins]
