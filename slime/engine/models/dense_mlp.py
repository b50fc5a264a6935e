"""The gated SiLU feed-forward (SwiGLU) of dense decoder layers and of Qwen2-MoE's shared expert, with gate and up
projections fused into one `gate_up_proj` matmul (`weight_loader.py` maps HF's gate_proj / up_proj onto its halves).
"""

from __future__ import annotations

import torch
from torch import nn

from slime.engine.layers.activation import SiluAndMul


class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(hidden)))
