"""An MoE layer's local experts as stacked weights, one grouped GEMM per projection: megatron-core's experts module
for the local layer spec (no Transformer Engine, no grouped_gemm package), chosen by --moe-grouped-gemm (model.py).

megatron-core's token dispatcher hands over the tokens routed to this rank's experts sorted by expert,
`tokens_per_expert` of them for each; the module computes what `SequentialMLP` computes expert by expert (fc1,
SwiGLU, times the routing probability, fc2) as two `torch.nn.functional.grouped_mm` calls, without a Python loop
over experts. Weights: `linear_fc1.weight` [num_local_experts, 2 * moe_ffn_hidden_size, hidden] (each expert's
[gate; up], a SequentialMLP expert's `linear_fc1.weight`) and `linear_fc2.weight` [num_local_experts, hidden,
moe_ffn_hidden_size]. Their dist_checkpointing entries are SequentialMLP's (same keys, global shapes and offsets),
so torch_dist checkpoints move between the two. Expert parallelism as megatron-core's experts: each rank holds a
contiguous block of experts, marked `allreduce` False under EP (grads.py, DDP's expert buffers). Whole experts per
rank: no expert tensor parallelism (TE's grouped experts have it).

Not the routing or the token exchange (megatron-core's router and dispatcher), not the HF names (hf_weights.py
splits the stacks into experts).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

# torch grouped_mm's operands need rows of a multiple of 16 bytes.
GROUPED_MM_ALIGNMENT_BYTES = 16


class StackedExpertLinear(nn.Module):
    """One projection of every local expert: `weight` [num_local_experts, out_features, in_features]."""

    def __init__(self, num_local_experts: int, out_features: int, in_features: int, config, init_method):
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = nn.Parameter(torch.empty(num_local_experts, out_features, in_features, device=device,
                                               dtype=config.params_dtype))
        # megatron-core's rule for expert weights: under expert parallelism DDP sums their gradients over the
        # expert data-parallel group, not the data-parallel one.
        expert_parallel = config.expert_model_parallel_size > 1
        self.weight.allreduce = not expert_parallel
        # megatron-core's gradient norm counts an unmarked weight on tensor-parallel rank 0 only (a replica
        # elsewhere); under expert parallelism the tensor-parallel ranks may hold different experts.
        set_tensor_model_parallel_attributes(self.weight, is_parallel=expert_parallel, dim=0, stride=1)
        if config.perform_initialization:
            # On the GPU every expert-parallel rank draws its own experts, as megatron-core's experts do.
            fork = (contextlib.nullcontext() if config.use_cpu_initialization
                    else get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()))
            with fork, torch.no_grad():
                init_method(self.weight)

    def forward(self, grouped: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
        """grouped [num_tokens, in_features] sorted by expert, group_ends [num_local_experts] (int32, cumulative)."""
        if grouped.shape[0] == 0:
            # No token for these experts. grouped_mm's backward refuses empty operands; an empty matmul keeps the
            # tokens and the weight in the graph, so this rank still joins the dispatcher's backward all-to-all.
            return grouped @ self.weight.sum(0).T
        return F.grouped_mm(grouped, self.weight.transpose(-2, -1), offs=group_ends)


class GroupedExperts(nn.Module):
    """megatron-core's experts interface: `forward(permuted_hidden, tokens_per_expert, permuted_probs)` ->
    (output, None), built by MoELayer as `GroupedExperts(num_local_experts, config, pg_collection=...)`."""

    def __init__(self, num_local_experts: int, config, pg_collection):
        super().__init__()
        assert config.gated_linear_unit and not config.add_bias_linear, "Qwen3-MoE experts: SwiGLU, no biases"
        # Whole experts per rank: the start-up check (validate_megatron_args.unbuilt_megatron_features) refuses ETP > 1.
        assert pg_collection.expt_tp.size() == 1, "--moe-grouped-gemm without TE needs --expert-tensor-parallel-size 1"
        hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size
        alignment = GROUPED_MM_ALIGNMENT_BYTES // config.params_dtype.itemsize
        if hidden % alignment or ffn % alignment:
            raise ValueError(f"--moe-grouped-gemm: torch's grouped_mm needs hidden_size ({hidden}) and "
                             f"moe_intermediate_size ({ffn}) to be multiples of {alignment} in "
                             f"{config.params_dtype}; drop --moe-grouped-gemm for this model")
        self.config = config
        self.num_local_experts = num_local_experts
        self.ep_group, self.dp_group = pg_collection.ep, pg_collection.expt_dp
        self.linear_fc1 = StackedExpertLinear(num_local_experts, 2 * ffn, hidden, config, config.init_method)
        self.linear_fc2 = StackedExpertLinear(num_local_experts, hidden, ffn, config,
                                              config.output_layer_init_method)

    def forward(self, permuted_hidden: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        group_ends = torch.cumsum(torch.as_tensor(tokens_per_expert), 0).to(
            device=permuted_hidden.device, dtype=torch.int32, non_blocking=True)
        gate, up = self.linear_fc1(permuted_hidden, group_ends).chunk(2, dim=-1)
        intermediate = self.config.activation_func(gate) * up
        # SequentialMLP's order and dtypes: the probability scales the activation, then back to its dtype.
        intermediate = (intermediate * permuted_probs.unsqueeze(-1)).to(intermediate.dtype)
        return self.linear_fc2(intermediate, group_ends), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """SequentialMLP's checkpoint entries: `{prefix}experts.linear_fc{1,2}.weight` of global shape
        [..., num_experts, out, in] (this rank's experts one block of it) and one empty `_extra_state` object per
        expert and projection."""
        from megatron.core.dist_checkpointing import ShardedTensor
        from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

        ep_rank, ep_size = self.ep_group.rank(), self.ep_group.size()
        num_experts = ep_size * self.num_local_experts
        expert_axis = len(sharded_offsets)
        replica_id = (0, 0, self.dp_group.rank())
        state = {}
        for name, linear in (("linear_fc1", self.linear_fc1), ("linear_fc2", self.linear_fc2)):
            state[f"{prefix}{name}.weight"] = ShardedTensor.from_rank_offsets(
                f"{prefix}experts.{name}.weight", linear.weight, *sharded_offsets, (expert_axis, ep_rank, ep_size),
                replica_id=replica_id, prepend_axis_num=expert_axis)
            for local in range(self.num_local_experts):
                expert = ep_rank * self.num_local_experts + local
                state[f"{prefix}{name}._extra_state{expert}"] = make_sharded_object_for_checkpoint(
                    None, f"{prefix}experts.{name}._extra_state",
                    (*sharded_offsets, (expert_axis, expert, num_experts)), replica_id)
        return state
