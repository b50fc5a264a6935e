"""SiLU-and-multiply for gated MLPs whose gate and up projections are fused into one matmul (one Triton kernel,
`triton_fused.silu_and_mul`, when the model runner sets `use_triton`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def __init__(self):
        super().__init__()
        self.use_triton = False

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from slime.engine.layers.triton_fused import silu_and_mul

            return silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
