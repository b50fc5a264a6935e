"""Tensor-parallel linears: each rank holds a slice of the weight and the decoder's collectives make the sum.

- `MergedColumnParallelLinear`: several column blocks fused into one matmul (gate/up of a SwiGLU MLP), each block
  split by its output dimension; rank r holds rows [r * size / tp, (r + 1) * size / tp) of every block, blocks
  side by side. Its output stays local: the next layer (a row-parallel one) consumes it as it is.
- `QKVParallelLinear`: the attention's fused q/k/v projection, split by heads; rank r's output is
  [q (its q heads) | k (its K/V heads) | v], with K/V heads replicated when there are fewer than ranks
  (`parallel.state.head_shard`).
- `RowParallelLinear`: split by the input dimension; each rank's partial product is summed by an all-reduce
  (unless the caller sums several partial outputs with one all-reduce of its own: `reduce_output=False`), and
  the bias, held whole by every rank, is added once after the sum.

At tp_size 1 each is an `nn.Linear` (same parameter names, shapes and forward). What each rank holds of a full
Hugging Face tensor is described by the attributes here and copied by `models/weight_loader.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slime.engine.parallel.state import SINGLE, HeadShard, ParallelState, divide, head_shard


class MergedColumnParallelLinear(nn.Linear):
    """Blocks of full output sizes `output_sizes`, each split over the ranks: local weight [sum(sizes) / tp, in]."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, parallel: ParallelState = SINGLE,
                 what: str = "intermediate_size"):
        """`what`: the checkpoint's config field of the split size, named if it does not divide."""
        self.tp_rank = parallel.tp_rank
        self.output_sizes = list(output_sizes)
        self.local_sizes = [divide(size, parallel.tp_size, what) for size in output_sizes]
        super().__init__(input_size, sum(self.local_sizes), bias=bias)


class QKVParallelLinear(nn.Linear):
    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 parallel: ParallelState = SINGLE):
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.shard: HeadShard = head_shard(num_heads, num_kv_heads, parallel)
        local = (self.shard.num_heads + 2 * self.shard.num_kv_heads) * head_dim
        super().__init__(hidden_size, local, bias=bias)


class RowParallelLinear(nn.Linear):
    """Full input size `input_size`, of which this rank holds columns [input_start, input_start + local)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, parallel: ParallelState = SINGLE,
                 reduce_output: bool = True, what: str = "intermediate_size", input_start: int | None = None,
                 local_input_size: int | None = None):
        """`input_start` / `local_input_size` override the even split (o_proj follows the rank's q heads)."""
        assert reduce_output or not bias, "a bias must be added once, after the caller's all-reduce"
        self.parallel = parallel
        self.reduce_output = reduce_output
        self.total_input_size = input_size
        local = divide(input_size, parallel.tp_size, what) if local_input_size is None else local_input_size
        self.input_start = parallel.tp_rank * local if input_start is None else input_start
        super().__init__(local, output_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.linear(x, self.weight, self.bias)
        out = F.linear(x, self.weight)
        if self.reduce_output:
            self.parallel.all_reduce(out)
        return out if self.bias is None else out + self.bias
