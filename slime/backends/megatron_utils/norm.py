"""RMSNorm for megatron-core's local layer spec that also runs under sequence parallelism.

The local spec's `WrappedTorchNorm` refuses `--sequence-parallel` (Apex's and TE's norms are the ones Megatron
allows there), although the norm itself is per token: with the sequence split over the tensor-parallel ranks each
rank normalises its own tokens. What sequence parallelism needs is the weight marked `sequence_parallel`, so that
its gradient (each rank's tokens' share) is summed over the TP group (grads.py). Numerically this is
`torch.nn.RMSNorm`, as the local spec builds it.

Not LayerNorm: every model family the backend builds uses RMSNorm.
"""

from __future__ import annotations

import torch


class RMSNorm:
    """Built by megatron-core's `build_module` with WrappedTorchNorm's arguments; returns a torch.nn.RMSNorm."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused_kwargs):
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        norm.weight.sequence_parallel = config.sequence_parallel
        return norm
