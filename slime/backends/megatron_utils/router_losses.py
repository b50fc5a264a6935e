"""The Megatron backend's MoE router losses (--moe-aux-loss-coeff with --moe-router-load-balancing-type,
--moe-z-loss-coeff) and load metric, with the FSDP backend's definitions (slime/backends/moe_aux_loss.py): each
router's training forward computes its layer's losses and attaches them to its routing probabilities with
megatron-core's `MoEAuxLossAutoScaler` (the loss's gradient enters the backward there, so it works on every
pipeline stage and in an activation recompute, where the layer routes again with gradients).

Each loss enters as its share of the step's mean over micro-batches and data-parallel ranks (1 / (micro-batches x
DP ranks)), as the FSDP backend adds it; megatron-core's own load-balancing loss stays off (model.py). With
sequence parallelism each tensor-parallel rank's router sees its slice of the row: the losses are per slice and
averaged over the slices (seq_aux_loss, per sample, is refused there at parse time). Metrics: the per-layer values
averaged over the step's micro-batches and every MoE layer of the pipeline (and slice), as one metric dict of
shares that the train flow's sum over micro-batches and ranks turns into that mean.

Not the router binding for replay (moe_router.py) and not the loss math (moe_aux_loss.py).
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch
import torch.distributed as dist

from slime.backends.moe_aux_loss import router_losses


class RouterLosses:
    """`sigmoid`: the routers score experts by sigmoid (GLM-4.5, DeepSeek-V3): the losses' probabilities are the
    sigmoid scores normalised over the experts (megatron-core's rule, the FSDP backend's too), else the softmax."""

    def __init__(self, args, num_experts: int, sequence_parallel: bool, sigmoid: bool = False):
        self.args, self.num_experts, self.sequence_parallel = args, num_experts, sequence_parallel
        self.sigmoid = sigmoid
        self.active = False
        self.sample_lengths: list[int] = []  # of the micro-batch whose layers run
        self._share = 0.0
        self._sums: dict[str, torch.Tensor] = {}
        self._num_values: dict[str, int] = {}

    def start(self, num_micro_batches: int, dp_size: int) -> None:
        """Before a forward-backward of `num_micro_batches` micro-batches."""
        from megatron.core import parallel_state

        slices = parallel_state.get_tensor_model_parallel_world_size() if self.sequence_parallel else 1
        self.active, self._share = True, 1.0 / (num_micro_batches * dp_size * slices)
        self._sums, self._num_values = defaultdict(float), defaultdict(int)

    def on_routing(self, logits: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
        """A router's output probabilities [tokens, experts] with its layer's losses attached (training forwards
        with gradients only: not the no-grad first forward of a recomputed layer)."""
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        if not (self.active and torch.is_grad_enabled()):
            return probs
        logits = logits.reshape(-1, self.num_experts)
        expert_ids = routing_map.nonzero()[:, 1].view(routing_map.shape[0], -1)  # top-k ids, ascending
        if self.sigmoid:
            scores = logits.float().sigmoid()
            full_probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            full_probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        total, metrics = router_losses(self.args, [(logits, full_probs, expert_ids)], self.num_experts,
                                       self.sample_lengths)
        for key, value in metrics.items():
            self._sums[key] = self._sums[key] + value.detach().double()
            self._num_values[key] += 1
        if total is None:
            return probs
        return MoEAuxLossAutoScaler.apply(probs, total * self._share)

    def finish(self, dp_size: int) -> dict:
        """After the forward-backward: {metric: share of the step's mean} (collective over the pipeline group)."""
        from megatron.core import parallel_state

        self.active = False
        keys = sorted(self._sums)
        if not keys:
            return {}
        device = next(iter(self._sums.values())).device
        totals = torch.stack([torch.stack([torch.as_tensor(self._sums[k], dtype=torch.float64, device=device),
                                           torch.tensor(float(self._num_values[k]), dtype=torch.float64,
                                                        device=device)]) for k in keys])
        groups = [parallel_state.get_pipeline_model_parallel_group()]
        if self.sequence_parallel:
            groups.append(parallel_state.get_tensor_model_parallel_group())
        for group in groups:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(totals, group=group)
        return {key: float(total / count) / dp_size for key, (total, count) in zip(keys, totals.tolist())}


def _routing_with_losses(losses: RouterLosses, original, logits, padding_mask=None):
    probs, routing_map = original(logits, padding_mask=padding_mask)
    return losses.on_routing(logits, probs, routing_map), routing_map


def install_router_losses(args, model_chunks) -> RouterLosses | None:
    """Bind every MoE router of this rank's chunks to one RouterLosses; None without MoE layers or router losses."""
    routers = [layer.mlp.router for chunk in model_chunks for layer in chunk.decoder.layers
               if hasattr(layer.mlp, "router")]
    if not routers:
        return None
    config = model_chunks[0].config
    losses = RouterLosses(args, config.num_moe_experts, config.sequence_parallel,
                          sigmoid=config.moe_router_score_function == "sigmoid")
    for router in routers:
        router.routing = functools.partial(_routing_with_losses, losses, router.routing)
    return losses
