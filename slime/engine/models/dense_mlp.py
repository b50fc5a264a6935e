"""The gated SiLU feed-forward (SwiGLU) of dense decoder layers and of Qwen2-MoE's shared expert, with gate and up
projections fused into one `gate_up_proj` matmul (`weight_loader.py` maps HF's gate_proj / up_proj onto its halves).

Over an engine's ranks the intermediate dimension is split: gate_up_proj column-parallel (each of gate and up cut
to the rank's slice), down_proj row-parallel, whose all-reduce sums the ranks' outputs (or, `reduce_output=False`,
is left to the caller, which sums several partial outputs with one all-reduce).
"""

from __future__ import annotations

import torch
from torch import nn

from slime.engine.layers.activation import SiluAndMul
from slime.engine.parallel.linear import MergedColumnParallelLinear, RowParallelLinear
from slime.engine.parallel.state import SINGLE, ParallelState


class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, parallel: ParallelState = SINGLE,
                 reduce_output: bool = True, what: str = "intermediate_size"):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, False, parallel, what)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, parallel, reduce_output, what)
        self.act = SiluAndMul()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(hidden)))
