"""RMSNorm as in Llama / Qwen (computed in float32, cast back). Not fused with the residual add. With `use_triton`
(set by the model runner on CUDA) the same math runs as one Triton kernel (`triton_fused.rms_norm`)."""

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
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
