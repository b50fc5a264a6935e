"""Gradient bookkeeping of the Megatron backend between backward and the optimizer step, the rules of
megatron-core's `finalize_model_grads` for a model without its DDP wrapper:
- summed over the tensor-parallel group: the weights that see only part of the work on each TP rank (norms under
  sequence parallelism, the q/k norms of each rank's heads);
- summed over the embedding group: with tied embeddings and PP > 1, the first stage's embedding and the last
  stage's output-layer copy are one weight;
- summed over data parallelism: every rank's loss is its share of the global loss, so the sum of the ranks'
  gradients is the gradient of the whole batch. Expert weights (`allreduce` False) are summed over the expert
  data-parallel group instead: with expert parallelism an expert's tokens arrive from every rank of its
  expert-parallel group through the token dispatcher, so its gradient already holds their share.
Then the global L2 norm (each distinct weight counted once: a shard on every rank of its tensor-parallel group,
a replicated weight on the group's rank 0; the dense weights' squares summed over the model-parallel group, the
experts' over the expert tensor x expert x pipeline group) and clipping, as `torch.nn.utils.clip_grad_norm_`.

Not the optimizer (slime/backends/fsdp_utils/optimizer.py's AdamW and schedule serve both backends).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from slime.backends.megatron_utils import tp_shards


def _all_reduce_grads(grads: list[torch.Tensor], group) -> None:
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(reduced)


def _tied_embedding_weights(model_chunks) -> list[torch.nn.Parameter]:
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return []
    weights = []
    for chunk in model_chunks:
        if chunk.share_embeddings_and_output_weights and (chunk.pre_process or chunk.post_process):
            weights.append(chunk.shared_embedding_or_output_weight())
    return weights


def is_expert(param) -> bool:
    """An expert weight: megatron-core marks them `allreduce` False (not summed over plain data parallelism)."""
    return not getattr(param, "allreduce", True)


def finalize_grads(model_chunks) -> None:
    from megatron.core import parallel_state

    config = model_chunks[0].config
    tp_summed = []
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if param.grad is None:
                continue
            if (config.sequence_parallel and getattr(param, "sequence_parallel", False)) or (
                    config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)):
                tp_summed.append(param.grad)
    _all_reduce_grads(tp_summed, parallel_state.get_tensor_model_parallel_group())
    tied = [weight.grad for weight in _tied_embedding_weights(model_chunks) if weight.grad is not None]
    if tied and parallel_state.is_rank_in_embedding_group():
        _all_reduce_grads(tied, parallel_state.get_embedding_group())
    params = [param for chunk in model_chunks for param in chunk.parameters() if param.grad is not None]
    _all_reduce_grads([param.grad for param in params if not is_expert(param)],
                      parallel_state.get_data_parallel_group(with_context_parallel=True))
    expert_grads = [param.grad for param in params if is_expert(param)]
    if expert_grads:
        _all_reduce_grads(expert_grads, parallel_state.get_expert_data_parallel_group())


def clip_grad_norm(model_chunks, max_norm: float) -> float:
    """Global L2 norm of the gradients of the whole model (returned), clipped in place when max_norm is finite."""
    from megatron.core import parallel_state

    grads, counted = [], {False: [], True: []}  # counted: dense and expert gradients of distinct weights
    for chunk in model_chunks:
        for param in chunk.parameters():
            if param.grad is None:
                continue
            grads.append(param.grad)
            if getattr(param, "shared", False):
                continue  # the last stage's copy of a tied embedding: the first stage counts it
            if tp_shards.is_sharded(param) or tp_shards.shard_rank(param) == 0:
                counted[is_expert(param)].append(param.grad)
    device = grads[0].device if grads else "cpu"
    squared = torch.zeros((), dtype=torch.float64, device=device)
    groups = {False: parallel_state.get_model_parallel_group(),
              True: parallel_state.get_expert_tensor_model_pipeline_parallel_group()}
    for expert, group in groups.items():
        part = torch.zeros((), dtype=torch.float64, device=device)
        if counted[expert]:
            part = torch.stack([g.double().square().sum() for g in counted[expert]]).sum()
        dist.all_reduce(part, group=group)
        squared += part
    total = float(squared.sqrt())
    if math.isfinite(max_norm) and grads:
        coefficient = min(1.0, max_norm / (total + 1e-6))
        if coefficient < 1.0:
            torch._foreach_mul_(grads, coefficient)
    return total
