"""Context parallelism of packed THD micro-batches (megatron's layout): every sample of a packed row is padded to
a multiple of 2 x CP tokens and cut into 2 x CP equal chunks; CP rank r holds chunks r and 2 x CP - 1 - r of every
sample (the causal work is then the same on every rank), the samples' pieces concatenated in sample order.

Three pieces: `CpLayout`, where each token of the padded row lives (carried to every layer by `CpPackedSeqParams`); `gather_sequence`, the autograd all-gather of
K / V over the CP group (backward: the full gradient summed over the group, then this rank's slice; gloo has no
reduce-scatter); `sum_over_context_parallel`, the full per-token outputs (log-probs, entropy, values) from each
rank's share, which every CP rank then uses identically in the same loss (backward: the gradient passes through
unchanged, each rank's share having come from its own tokens only). The weight gradients are then summed over
data x context parallel ranks by megatron's DDP.

Not the attention itself (attention.py) and not the micro-batch schedule (micro_batches.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams


def context_parallel_group():
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


@dataclass
class CpLayout:
    """The CP split of one packed row whose samples (padding included) have `sample_lengths`, all multiples of
    2 x cp_size. `local_index`: positions in the padded row of this rank's tokens, in its local order;
    `gather_index`: for each padded-row position, its index in the rank-major concatenation of every rank's
    local tokens (what `gather_sequence` returns)."""

    sample_lengths: list[int]
    cp_size: int
    cp_rank: int
    local_index: torch.Tensor
    gather_index: torch.Tensor
    masks: dict = field(default_factory=dict, repr=False)  # causal masks by (query start, chunk)

    @classmethod
    def of(cls, sample_lengths: list[int], cp_size: int, cp_rank: int) -> "CpLayout":
        lengths = np.asarray(sample_lengths, dtype=np.int64)
        if (lengths % (2 * cp_size)).any():
            raise ValueError(f"sample lengths {sample_lengths} must be multiples of 2 x context-parallel size "
                             f"{2 * cp_size}")
        starts = np.cumsum(lengths) - lengths
        chunk = lengths // (2 * cp_size)
        # chunk j of every sample lives on rank min(j, 2 x cp - 1 - j), first or second of that rank's two
        rank_of_chunk = np.minimum(np.arange(2 * cp_size), 2 * cp_size - 1 - np.arange(2 * cp_size))
        local_start = np.cumsum(2 * chunk) - 2 * chunk  # where sample s begins in every rank's local tokens
        local_length = int((2 * chunk).sum())
        gather, local = [], []
        for sample, (start, size) in enumerate(zip(starts.tolist(), chunk.tolist())):
            for j in range(2 * cp_size):
                owner = int(rank_of_chunk[j])
                second_half = j >= cp_size
                offset = owner * local_length + int(local_start[sample]) + second_half * size
                gather.append(np.arange(offset, offset + size))
            local.append(np.arange(start + cp_rank * size, start + (cp_rank + 1) * size))
            first_of_mirror = 2 * cp_size - 1 - cp_rank
            local.append(np.arange(start + first_of_mirror * size, start + (first_of_mirror + 1) * size))
        return cls(list(sample_lengths), cp_size, cp_rank, torch.from_numpy(np.concatenate(local)),
                   torch.from_numpy(np.concatenate(gather)))

    @property
    def local_chunk_lengths(self) -> list[int]:
        return [length // (2 * self.cp_size) for length in self.sample_lengths]

    def causal_mask(self, query_start: int, chunk: int, device: torch.device) -> torch.Tensor:
        """[chunk, query_start + chunk]: query a (global position query_start + a) sees keys 0 .. query_start + a.
        Made once per layout, shared by every layer."""
        key = (query_start, chunk)
        if key not in self.masks:
            self.masks[key] = torch.ones(chunk, query_start + chunk, dtype=torch.bool, device=device).tril(query_start)
        return self.masks[key]


@dataclass
class CpPackedSeqParams(PackedSeqParams):
    """megatron's PackedSeqParams of a padded row, carrying this rank's CP layout (its gather index on the row's
    device), built once per micro-batch on the host: every layer's attention, and its recompute, reads it here."""

    cp_layout: CpLayout | None = None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, group):
        ctx.group, ctx.rank, ctx.length = group, dist.get_rank(group), local.shape[0]
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, local.contiguous(), group=group)
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.length:(ctx.rank + 1) * ctx.length], None


def gather_sequence(local: torch.Tensor, layout: CpLayout, group) -> torch.Tensor:
    """This rank's tokens [T / cp, ...] -> every token of the padded row in row order [T, ...]."""
    gathered = _GatherSequence.apply(local, group)
    return gathered.index_select(0, layout.gather_index)


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, share: torch.Tensor, group):
        total = share.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_over_context_parallel(share: torch.Tensor, group) -> torch.Tensor:
    """Every rank's share (zeros where another rank holds the token) -> the full tensor on every rank."""
    return _SumOverGroup.apply(share, group)
