"""Tensor-parallel shards <-> full tensors of Megatron parameters.

megatron-core marks every sharded parameter (`tensor_model_parallel`, `partition_dim`); expert parameters
(`allreduce` False) are sharded over the expert tensor-parallel group, the rest over the tensor-parallel group.
One layout needs more than a split along `partition_dim`: a gated `linear_fc1` shard is [gate_r; up_r], so the
full tensor is defined as [gate; up] and split / joined by halves.

Not the HF layout (hf_mapping/) and not pipeline or expert-parallel placement (names.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _group(param):
    from megatron.core import parallel_state

    if getattr(param, "allreduce", True):
        return parallel_state.get_tensor_model_parallel_group()
    return parallel_state.get_expert_tensor_parallel_group()


def is_sharded(param) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False)) and dist.get_world_size(_group(param)) > 1


def _is_gated(name: str) -> bool:
    # Every model family the backend builds uses SwiGLU (model.py sets gated_linear_unit).
    return ".linear_fc1.weight" in name


def shard_of(full: torch.Tensor, name: str, param) -> torch.Tensor:
    """This rank's shard of the full tensor `full` of parameter `param` (named `name`)."""
    if not is_sharded(param):
        return full
    group = _group(param)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if _is_gated(name):
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])
    return full.chunk(size, dim=param.partition_dim)[rank]


def full_tensor(name: str, param, local: torch.Tensor | None = None) -> torch.Tensor:
    """The full tensor of a (possibly sharded) parameter, or of `local` laid out like it (its gradient);
    collective over its tensor-parallel group."""
    local = param.detach() if local is None else local
    if not is_sharded(param):
        return local
    group = _group(param)
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, local.contiguous(), group=group)
    if _is_gated(name):
        halves = [shard.chunk(2) for shard in shards]
        return torch.cat([torch.cat([gate for gate, _ in halves]), torch.cat([up for _, up in halves])])
    return torch.cat(shards, dim=param.partition_dim)
