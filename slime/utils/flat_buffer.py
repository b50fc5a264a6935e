"""One device allocation for many tensors: `flat_empty` gives uninitialized tensors of the given shapes and dtypes as
views of one buffer per dtype, each starting ALIGNMENT_BYTES-aligned as its own allocation would (vectorized
kernels and compiled code expect aligned inputs).

Why: a colocated hand-over brings a model's worth of tensors back to the device on every step (the trainer's
parameters, optimizer state and weight snapshots; the engine's weights), right after an empty_cache, so each tensor
allocated on its own is a driver call (cudaMalloc), and freeing them one cudaFree each. Not here: the copies into
the views (the callers, on whichever stream they choose). `flat_layout` is the layout (the same alignment, tensors
of mixed dtypes in one byte buffer) and `flat_views` the tensors of such a buffer (engine/device_arena.py maps one
at fixed addresses).
"""

from __future__ import annotations

import torch

ALIGNMENT_BYTES = 512  # the CUDA caching allocator's block granularity


def flat_empty(specs: list[tuple[torch.Size, torch.dtype]], device) -> list[torch.Tensor]:
    """Contiguous tensors of (shape, dtype) `specs`, in order, sharing one allocation per dtype on `device`, laid
    out as `flat_layout` lays out each dtype's tensors."""
    views: list[torch.Tensor | None] = [None] * len(specs)
    for dtype in dict.fromkeys(dtype for _, dtype in specs):
        indices = [index for index, (_, spec_dtype) in enumerate(specs) if spec_dtype == dtype]
        offsets, num_bytes = flat_layout([specs[index] for index in indices])
        buffer = torch.empty(num_bytes // dtype.itemsize, dtype=dtype, device=device)
        for index, offset in zip(indices, offsets):
            shape = torch.Size(specs[index][0])
            start = offset // dtype.itemsize
            views[index] = buffer[start:start + shape.numel()].view(shape)
    return views


def flat_layout(specs: list[tuple[torch.Size, torch.dtype]]) -> tuple[list[int], int]:
    """Byte offsets of (shape, dtype) `specs` laid out in order in one buffer, each ALIGNMENT_BYTES-aligned, and
    the buffer's size in bytes."""
    offsets, num_bytes = [], 0
    for shape, dtype in specs:
        offsets.append(num_bytes)
        num_bytes += -(-torch.Size(shape).numel() * dtype.itemsize // ALIGNMENT_BYTES) * ALIGNMENT_BYTES
    return offsets, num_bytes


def flat_views(memory: torch.Tensor, specs: list[tuple[torch.Size, torch.dtype]],
               offsets: list[int]) -> list[torch.Tensor]:
    """The tensors of `specs` as views of the uint8 buffer `memory` at the byte `offsets` of `flat_layout`."""
    return [memory[offset:offset + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)
            for (shape, dtype), offset in zip(specs, offsets)]
