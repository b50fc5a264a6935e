"""The Megatron backend's MoE routers bound to routing replay (slime/backends/routing_replay.py: slime's stages).

megatron-core's `TopKRouter` takes its top-k from its `router_replay` hook when it has one
(`moe_utils.topk_routing_with_score_function` calls `get_replay_topk(scores, topk, num_groups, group_topk,
compute_topk)`); here that hook asks the shared `RoutingReplay` for the MoE layer's expert ids (free, recorded or
replayed) and hands back the router's own scores at those ids, so the routing weights stay megatron-core's (the
softmax over the chosen experts' logits for Qwen3-MoE's renormalised top-k) and the router still learns.

Each pipeline stage binds the MoE layers it holds (global MoE layer numbers, as the engine's routing records count
them) and measures the router agreement of those; `take_agreement` sums it over the pipeline so the flow's
data-parallel sum covers every layer. With sequence parallelism each tensor-parallel rank's routers see its slice
of the packed row: it replays the same slice of the row's routing (`sequence_parallel_routing`). Not the replay policy (the train flow sets the stages), not the micro-batch
contexts (micro_batches.py enters them around each forward and before each recompute in the backward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slime.backends.megatron_utils.grouped_routing import group_masked_scores
from slime.backends.megatron_utils.model import moe_layer_pattern
from slime.backends.megatron_utils.names import chunk_offsets
from slime.backends.routing_replay import FREE_ROW, RoutingReplay


class MegatronRoutingReplay(RoutingReplay):
    """A RoutingReplay of one pipeline stage and tensor-parallel rank. Its agreement counts are summed over the
    pipeline group (each stage counts its layers) and, with sequence parallelism, over the tensor-parallel group
    (each rank routes its slice of the row); its records are then gathered over the tensor-parallel group, so a
    record is the whole (padded) row, as an R3 routing is."""

    def __init__(self, *args, sequence_parallel: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.sequence_parallel = sequence_parallel

    def take_agreement(self) -> torch.Tensor:
        from megatron.core import parallel_state

        agreement = super().take_agreement()
        groups = [parallel_state.get_pipeline_model_parallel_group()]
        if self.sequence_parallel:
            groups.append(parallel_state.get_tensor_model_parallel_group())
        for group in groups:
            if dist.get_world_size(group) > 1:
                agreement = agreement.to("cuda" if dist.get_backend(group) == "nccl" else "cpu")
                dist.all_reduce(agreement, group=group)
        return agreement.cpu()

    def take_records(self) -> list[torch.Tensor]:
        from megatron.core import parallel_state

        records = super().take_records()
        if not self.sequence_parallel:
            return records
        group = parallel_state.get_tensor_model_parallel_group()
        gathered = []
        for record in records:
            slices = [torch.empty_like(record) for _ in range(dist.get_world_size(group))]
            dist.all_gather(slices, record.contiguous(), group=group)
            gathered.append(torch.cat(slices))
        return gathered


def sequence_parallel_routing(routing: torch.Tensor | None, padded_length: int) -> torch.Tensor | None:
    """This tensor-parallel rank's rows of a micro-batch's routing under sequence parallelism: the row padded to
    `padded_length` with rows that route freely (the padding segment), then the rank's contiguous slice."""
    from megatron.core import parallel_state

    if routing is None:
        return None
    if routing.shape[0] < padded_length:
        padding = routing.new_full((padded_length - routing.shape[0], *routing.shape[1:]), FREE_ROW)
        routing = torch.cat([routing, padding])
    size = parallel_state.get_tensor_model_parallel_world_size()
    return routing.chunk(size)[parallel_state.get_tensor_model_parallel_rank()]


class _ReplayedTopK:
    """One router's `router_replay` hook: the expert ids of MoE layer `layer` from `replay`. `scores` are the
    router's choice scores (softmax scores or logits; sigmoid scores plus the expert bias); with expert groups the
    dropped groups' experts are masked first (grouped_routing.py, transformers' rule), so routing freely (fallthrough,
    record, and the agreement measure) respects the group limit. The hook returns the unmasked scores at the ids:
    megatron-core weighs a sigmoid router's experts by its own unbiased scores."""

    def __init__(self, replay: RoutingReplay, layer: int):
        self.replay, self.layer = replay, layer

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups, group_topk, compute_topk):
        expert_ids = self.replay.select(self.layer, group_masked_scores(scores, num_groups, group_topk))
        return scores.gather(1, expert_ids), expert_ids


def install_routers(model_chunks, hf_config) -> RoutingReplay | None:
    """Bind the router of every MoE layer of this rank's chunks; the replay object (None for a dense model)."""
    pattern = moe_layer_pattern(model_chunks[0].config)
    moe_layers = [layer for layer, sparse in enumerate(pattern) if sparse]
    if not moe_layers:
        return None
    routers = {}  # MoE layer number -> router
    for vp_stage, chunk in enumerate(model_chunks):
        layer_offset, _ = chunk_offsets(chunk, vp_stage if len(model_chunks) > 1 else None)
        for index, layer in enumerate(chunk.decoder.layers):
            if hasattr(layer.mlp, "router"):
                routers[moe_layers.index(layer_offset + index)] = layer.mlp.router
    config = model_chunks[0].config
    replay = MegatronRoutingReplay(len(moe_layers), config.moe_router_topk, config.num_moe_experts,
                                   local_layers=sorted(routers), sequence_parallel=config.sequence_parallel,
                                   layer_indices=moe_layers, num_hidden_layers=hf_config.num_hidden_layers)
    for layer, router in routers.items():
        router.router_replay = _ReplayedTopK(replay, layer)
    return replay
