"""Gradient bookkeeping of the Megatron backend between backward and the optimizer step, the rules of
megatron-core's `finalize_model_grads` on the DDP grad buffers (`param.main_grad`, optimizer.py):
- summed over the tensor-parallel group: the weights that see only part of the work on each TP rank (norms under
  sequence parallelism, the q/k norms of each rank's heads);
- summed over the embedding group: with tied embeddings and PP > 1, the first stage's embedding and the last
  stage's output-layer copy are one weight;
- summed over data parallelism by DDP's `finish_grad_sync` (reduce-scattered: each rank's slice of the buffer
  holds the sum, which the distributed optimizer steps): every rank's loss is its share of the global loss, so the
  sum of the ranks' gradients is the gradient of the whole batch. Expert weights (`is_expert`) are DDP's expert
  buffers, summed over the expert data-parallel group instead.
The sums over TP and the embedding group run on the whole buffer before the data-parallel one (they commute).

Not the norm and clipping (megatron's optimizer computes them over its slices) and not the optimizer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


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
    """An expert weight: megatron-core marks them `allreduce` False (DDP sums their gradients over the expert
    data-parallel group, not plain data parallelism: an expert's tokens reach it from every rank of its
    expert-parallel group through the token dispatcher)."""
    return not getattr(param, "allreduce", True)


def finalize_grads(model_chunks, ddp_chunks) -> None:
    """`model_chunks` the GPTModels, `ddp_chunks` their DDP wrappers (whose buffers hold the gradients)."""
    from megatron.core import parallel_state

    config = model_chunks[0].config
    tp_summed = []
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            if (config.sequence_parallel and getattr(param, "sequence_parallel", False)) or (
                    config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)):
                tp_summed.append(param.main_grad)
    _all_reduce_grads(tp_summed, parallel_state.get_tensor_model_parallel_group())
    tied = [weight.main_grad for weight in _tied_embedding_weights(model_chunks) if weight.requires_grad]
    if tied and parallel_state.is_rank_in_embedding_group():
        _all_reduce_grads(tied, parallel_state.get_embedding_group())
    for ddp_chunk in ddp_chunks:
        ddp_chunk.finish_grad_sync()
