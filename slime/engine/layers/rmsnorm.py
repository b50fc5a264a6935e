"""RMSNorm as in Llama / Qwen (computed in float32, cast back), alone or after the residual add (`add_and_norm`).
With `use_triton` (set by the model runner on CUDA) each runs as one Triton kernel (`triton_fused.rms_norm`,
`triton_fused.add_rms_norm`)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.use_triton = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from slime.engine.layers.triton_fused import rms_norm

            return rms_norm(x, self.weight, self.eps)
        return torch_rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the pre-norm decoder's residual stream step."""
        if self.use_triton:
            from slime.engine.layers.triton_fused import add_rms_norm

            return add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self(residual), residual


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension in float32, cast back, times `weight` (broadcast from the right)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)
