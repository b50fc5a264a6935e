"""Where this process sits in its engine's tensor / expert parallel layout, and the collectives the sharded model
runs over it.

An engine of `tp_size` ranks shards attention by heads and dense MLPs by their intermediate dimension over all
ranks. Its MoE experts are split into `ep_size` contiguous blocks (EP rank e owns experts [e*E/ep, (e+1)*E/ep)),
each block sharded by its intermediate dimension over the `moe_tp_size = tp_size // ep_size` ranks that share it
(SGLang's "TP4EP2"). Every partial output is summed by one all-reduce over the whole group. `tp_size == 1` is the
single-device engine: every collective is the identity and no process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    ep_size: int = 1
    group: Any = None  # the model's collectives (NCCL on GPUs, gloo on CPUs); None when tp_size == 1

    def __post_init__(self):
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is not a rank of tp_size {self.tp_size}")
        if self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ValueError(f"--ep-size {self.ep_size} must divide --tp-size {self.tp_size}")

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.ep_size

    @property
    def ep_rank(self) -> int:
        return self.tp_rank // self.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        return self.tp_rank % self.moe_tp_size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (identity at one rank)."""
        if self.tp_size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (e.g. the KV blocks each rank's free memory holds)."""
        if self.tp_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ranks' shards [..., d] concatenated in rank order along the last dimension: [..., tp_size * d]."""
        if self.tp_size == 1:
            return tensor
        # The ranks' tensors stacked along dim 0 ([tp_size * rows, ...]: gloo accepts no other output layout).
        gathered = torch.empty((self.tp_size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype,
                               device=tensor.device)
        _all_gather_single(gathered, tensor.contiguous(), group=self.group)
        gathered = gathered.view(self.tp_size, *tensor.shape)
        return gathered.movedim(0, -2).reshape(*tensor.shape[:-1], self.tp_size * tensor.shape[-1])


SINGLE = ParallelState()
# torch 2.13 renames all_gather_into_tensor (and warns on the old name); older releases have only the old one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by --tp-size {parts} (engine Config.tp_size); choose a "
                         "--tp-size that divides it")
    return total // parts


@dataclass(frozen=True)
class HeadShard:
    """This rank's attention heads: q heads [q_start, q_start + num_heads), K/V heads [kv_start, kv_start +
    num_kv_heads). With fewer K/V heads than ranks, each K/V head is stored on `kv_replicas` ranks (rank r holds
    head r // kv_replicas), as SGLang and vLLM do."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int
    kv_replicas: int


def head_shard(num_heads: int, num_kv_heads: int, parallel: ParallelState) -> HeadShard:
    tp, rank = parallel.tp_size, parallel.tp_rank
    local_q = divide(num_heads, tp, "num_attention_heads")
    if num_kv_heads >= tp:
        local_kv = divide(num_kv_heads, tp, "num_key_value_heads")
        return HeadShard(local_q, local_kv, rank * local_q, rank * local_kv, 1)
    if tp % num_kv_heads:
        raise ValueError(f"--tp-size {tp} (engine Config.tp_size) is not a multiple of num_key_value_heads "
                         f"({num_kv_heads}); with fewer K/V heads than ranks each head is replicated, which needs a "
                         "whole number of copies")
    replicas = tp // num_kv_heads
    return HeadShard(local_q, 1, rank * local_q, rank // replicas, replicas)
