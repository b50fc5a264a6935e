"""The adapters' device storage and the batched LoRA computation.

Every targeted linear (targets.py) gets stacked buffers of `num_slots` adapter slots at the engine's max rank R:
A [num_slots, num_slices * R, in] (the slices' A side by side, a fused qkv_proj has three) and, per slice, B
[slice_out, num_slots, R] holding B * scale (folded in when the adapter is written; ranks below R are zero-padded).
A forward hook adds delta = B (A x) to the linear's output, in one of two ways set by the model runner before each
forward:

- segmented (`set_batch`, eager steps): for each group of the step's tokens that share a slot, one shrink matmul
  for all slices and one expand matmul per slice on those tokens' rows only (gathered with index_select, added back
  with index_add_; a step whose tokens all share one adapter gathers nothing). Host-side shapes: never captured.
- dense (`set_graph_rows`, the decode CUDA graphs): static shapes, indices on the device. Every token goes through
  every slot's A (one matmul against all slots' A), the result is multiplied by the token's one-hot slot row (a
  static device buffer the runner fills before each replay) and goes through all slots' B at once, so a captured
  graph serves any mix of adapters. It costs num_slots times the segmented path's LoRA FLOPs, small for a decode
  step's few rows. The piecewise prefill graphs are not used with LoRA.

Tokens of requests without an adapter (slot -1) get nothing either way, so one step mixes adapters and the base
model. In an engine of several ranks every rank holds its part of each slot (targets.py: B's rows of a
column-parallel linear's output shard, A's columns of a row-parallel one's input shard); a row-parallel linear's
low-rank products are summed over the ranks (one all-reduce of tokens x R values) before its B. Not the slot
bookkeeping (registry.py).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from slime.engine.lora.adapter import LoraAdapter
from slime.engine.lora.registry import NO_ADAPTER, LoraRegistry
from slime.engine.lora.targets import WHOLE, check_adapter_shapes, find_targets

logger = logging.getLogger(__name__)


class LoraLinear:
    """The slots of one engine linear with `slice_sizes` output slices (their sum is its output size)."""

    def __init__(self, owner: LoraSlots, module: nn.Linear, slice_sizes: list[int], num_slots: int, max_rank: int):
        self.owner = owner
        self.max_rank = max_rank
        factory = {"device": module.weight.device, "dtype": module.weight.dtype}
        self.a = torch.zeros(num_slots, len(slice_sizes) * max_rank, module.in_features, **factory)
        self.b = [torch.zeros(size, num_slots, max_rank, **factory) for size in slice_sizes]
        self.slice_bounds = [(int(start), int(start + size))
                             for start, size in zip(np.cumsum([0, *slice_sizes[:-1]]), slice_sizes)]
        self.active = [False] * num_slots  # whether the slot's adapter targets this linear at all
        # A row-parallel linear of a sharded engine whose output is already summed over the ranks: each rank's
        # A x covers its input shard, so the low-rank products are summed too before B (a few values per token).
        # When the caller sums the partial outputs itself (reduce_output False), the partial deltas add up there.
        parallel = getattr(module, "parallel", None)
        self.reduce_shrunk = parallel if (parallel is not None and parallel.tp_size > 1
                                          and getattr(module, "reduce_output", False)) else None
        self.handle = module.register_forward_hook(self._add_delta)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        for b in self.b:
            b[:, slot].zero_()
        self.active[slot] = False

    def write(self, slot: int, slice_index: int, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        rank, rows = a.shape[0], slice_index * self.max_rank
        self.a[slot, rows : rows + rank].copy_(a)
        self.b[slice_index][:, slot, :rank].copy_(b.to(torch.float32) * scale)
        self.active[slot] = True

    def _add_delta(self, _module, inputs, output: torch.Tensor) -> torch.Tensor | None:
        if self.owner.dense:
            return self._add_dense_delta(inputs[0], output)
        segments = self.owner.segments
        if not segments:
            return None
        x, rank = inputs[0], self.max_rank
        for slot, rows in segments:
            if not self.active[slot]:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            shrunk = xs @ self.a[slot].T  # [tokens, num_slices * R]
            if self.reduce_shrunk is not None:
                self.reduce_shrunk.all_reduce(shrunk)
            parts = [shrunk[:, i * rank : (i + 1) * rank] @ b[:, slot].T for i, b in enumerate(self.b)]
            delta = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            if rows is None:
                output.add_(delta)
            else:
                output.index_add_(0, rows, delta)
        return output

    def _add_dense_delta(self, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        num_tokens, (num_slots, width, in_features) = x.shape[0], self.a.shape
        weights = self.owner.row_weights[:num_tokens, :, None]  # [tokens, slots, 1]: the token's one-hot slot
        shrunk = x @ self.a.view(num_slots * width, in_features).T
        if self.reduce_shrunk is not None:
            self.reduce_shrunk.all_reduce(shrunk)
        shrunk = shrunk.view(num_tokens, num_slots, width) * weights
        shrunk = shrunk.view(num_tokens, num_slots, len(self.b), self.max_rank)
        for index, (b, (start, end)) in enumerate(zip(self.b, self.slice_bounds)):
            output[:, start:end].add_(shrunk[:, :, index].reshape(num_tokens, -1) @ b.view(b.shape[0], -1).T)
        return output


class LoraSlots:
    def __init__(self, model: nn.Module, num_slots: int, max_rank: int, max_graph_rows: int):
        """`max_graph_rows`: the largest decode CUDA graph's batch size (rows of the dense path's one-hot buffer)."""
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.targets, slice_sizes = find_targets(model)
        modules = dict(model.named_modules())
        self.linears = {name: LoraLinear(self, modules[name], sizes, num_slots, max_rank)
                        for name, sizes in slice_sizes.items()}
        self.device = next(model.parameters()).device
        # (slot, token rows on the device, or None for every row) of the step being run; empty: no adapter in it
        self.segments: list[tuple[int, torch.Tensor | None]] = []
        # the dense path (decode CUDA graphs): on, and each row's one-hot slot (a static buffer graphs read)
        self.dense = False
        dtype = next(model.parameters()).dtype
        self.row_weights = torch.zeros(max_graph_rows, num_slots, dtype=dtype, device=self.device)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for linear in self.linears.values() for t in (linear.a, *linear.b))

    def check(self, adapter: LoraAdapter) -> None:
        check_adapter_shapes(adapter.modules, self.targets)

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter` into `slot` (cleared first: modules it does not target get no delta)."""
        self.check(adapter)
        self.clear(slot)
        for hf_name, (a, b) in adapter.modules.items():
            target = self.targets[hf_name]
            linear = self.linears[target.module_name]
            a = a[:, target.columns[0] : target.columns[1]]  # this rank's input shard (row-parallel), else all
            indices = range(len(linear.b)) if target.slice_index == WHOLE else [target.slice_index]
            for index, (start, end) in zip(indices, target.rows, strict=True):  # this rank's rows of each slice
                linear.write(slot, index, a, b[start:end], adapter.scale)

    def clear(self, slot: int) -> None:
        for linear in self.linears.values():
            linear.clear(slot)

    def set_graph_rows(self, row_slots: np.ndarray) -> None:
        """Dense path: the slot of each row of the next decode graph replay (or capture), in row order; the rows
        past them (a bucket's padding) get none."""
        self.dense = True
        weights = np.zeros(tuple(self.row_weights.shape), dtype=np.float32)
        rows = np.flatnonzero(row_slots != NO_ADAPTER)
        weights[rows, row_slots[rows]] = 1.0
        self.row_weights.copy_(torch.from_numpy(weights))

    def set_batch(self, token_slots: np.ndarray) -> None:
        """Segmented path: the slot of every token of the next forward (NO_ADAPTER for none), in flat-batch order."""
        self.dense = False
        used = np.unique(token_slots)
        used = used[used != NO_ADAPTER]
        if len(used) == 1 and token_slots[0] == used[0] and (token_slots == used[0]).all():
            self.segments = [(int(used[0]), None)]
            return
        self.segments = [(int(slot), torch.from_numpy(np.flatnonzero(token_slots == slot)).to(self.device))
                         for slot in used]


def build_lora_slots(model: nn.Module, config, device: torch.device, max_graph_rows: int):
    """The model runner's (LoraSlots, LoraRegistry) for an engine Config with enable_lora (allocated before the KV
    cache is sized from the memory left)."""
    slots = LoraSlots(model, config.max_loras_per_batch, config.max_lora_rank, max_graph_rows)
    if device.type == "cuda" and not config.enforce_eager and config.prefill_cuda_graphs:
        logger.info("enable_lora: prefill and mixed steps run eagerly (LoRA groups their tokens by adapter with "
                    "host-side shapes); decode steps replay CUDA graphs")
    logger.info("enable_lora: %d slots at rank %d on %d linears, %.1f MiB", slots.num_slots, slots.max_rank,
                len(slots.linears), slots.num_bytes / 2**20)
    return slots, LoraRegistry(slots.num_slots)
