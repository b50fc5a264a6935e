"""The adapters' device storage and the batched LoRA computation.

Every targeted linear (targets.py) gets stacked buffers of `num_slots` adapter slots at the engine's max rank R:
A [num_slots, num_slices * R, in] (the slices' A side by side, a fused qkv_proj has three) and, per slice, B
[num_slots, slice_out, R] holding B * scale (folded in when the adapter is written; ranks below R are zero-padded).
A forward hook adds, for each segment of the step's tokens that share a slot, delta = B (A x) to the linear's output
rows of those tokens: one shrink matmul for all slices, one expand matmul per slice. Tokens of requests without an
adapter get nothing (slot -1), so one step mixes adapters and the base model.

The segments are set by the model runner before each forward (`set_batch`): host-side shapes, so these steps run
eagerly (the engine turns CUDA graphs off with enable_lora). Not the slot bookkeeping (registry.py).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from slime.engine.lora.adapter import LoraAdapter
from slime.engine.lora.registry import NO_ADAPTER
from slime.engine.lora.targets import check_adapter_shapes, find_targets


class LoraLinear:
    """The slots of one engine linear with `slice_sizes` output slices (their sum is its output size)."""

    def __init__(self, owner: LoraSlots, module: nn.Linear, slice_sizes: list[int], num_slots: int, max_rank: int):
        self.owner = owner
        self.max_rank = max_rank
        factory = {"device": module.weight.device, "dtype": module.weight.dtype}
        self.a = torch.zeros(num_slots, len(slice_sizes) * max_rank, module.in_features, **factory)
        self.b = [torch.zeros(num_slots, size, max_rank, **factory) for size in slice_sizes]
        self.starts = np.cumsum([0, *slice_sizes[:-1]]).tolist()
        self.active = [False] * num_slots  # whether the slot's adapter targets this linear at all
        self.handle = module.register_forward_hook(self._add_delta)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        for b in self.b:
            b[slot].zero_()
        self.active[slot] = False

    def write(self, slot: int, slice_index: int, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        rank, rows = a.shape[0], slice_index * self.max_rank
        self.a[slot, rows : rows + rank].copy_(a)
        self.b[slice_index][slot, :, :rank].copy_(b.to(torch.float32) * scale)
        self.active[slot] = True

    def _add_delta(self, _module, inputs, output: torch.Tensor) -> torch.Tensor | None:
        segments = self.owner.segments
        if not segments:
            return None
        x, rank = inputs[0], self.max_rank
        for slot, rows in segments:
            if not self.active[slot]:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            shrunk = xs @ self.a[slot].T  # [tokens, num_slices * R]
            parts = [shrunk[:, i * rank : (i + 1) * rank] @ b[slot].T for i, b in enumerate(self.b)]
            delta = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            if rows is None:
                output.add_(delta)
            else:
                output.index_add_(0, rows, delta)
        return output


class LoraSlots:
    def __init__(self, model: nn.Module, num_slots: int, max_rank: int):
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.targets, slice_sizes = find_targets(model)
        modules = dict(model.named_modules())
        self.linears = {name: LoraLinear(self, modules[name], sizes, num_slots, max_rank)
                        for name, sizes in slice_sizes.items()}
        self.device = next(model.parameters()).device
        # (slot, token rows on the device, or None for every row) of the step being run; empty: no adapter in it
        self.segments: list[tuple[int, torch.Tensor | None]] = []

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
            self.linears[target.module_name].write(slot, target.slice_index, a, b, adapter.scale)

    def clear(self, slot: int) -> None:
        for linear in self.linears.values():
            linear.clear(slot)

    def set_batch(self, token_slots: np.ndarray) -> None:
        """The slot of every token of the next forward (NO_ADAPTER for none), in flat-batch order."""
        used = np.unique(token_slots)
        used = used[used != NO_ADAPTER]
        if len(used) == 1 and token_slots[0] == used[0] and (token_slots == used[0]).all():
            self.segments = [(int(used[0]), None)]
            return
        self.segments = [(int(slot), torch.from_numpy(np.flatnonzero(token_slots == slot)).to(self.device))
                         for slot in used]
