"""One device allocation for many tensors: `flat_empty` gives uninitialized tensors of the given shapes and dtypes as
views of one buffer per dtype, each starting ALIGNMENT_BYTES-aligned as its own allocation would (vectorized
kernels and compiled code expect aligned inputs).

Why: a colocated hand-over brings a model's worth of tensors back to the device on every step (the trainer's
parameters, optimizer state and weight snapshots; the engine's weights), right after an empty_cache, so each tensor
allocated on its own is a driver call (cudaMalloc), and freeing them one cudaFree each. Not here: the copies into
the views (the callers, on whichever stream they choose). `flat_layout` gives the same alignment for tensors of
mixed dtypes laid out in one byte buffer (engine/device_arena.py maps such a buffer at fixed addresses).
"""

from __future__ import annotations

import torch

ALIGNMENT_BYTES = 512  # the CUDA caching allocator's block granularity


def flat_empty(specs: list[tuple[torch.Size, torch.dtype]], device) -> list[torch.Tensor]:
    """Contiguous tensors of (shape, dtype) `specs`, in order, sharing one allocation per dtype on `device`."""
    offsets, sizes = [], {}
    for shape, dtype in specs:
        offset = sizes.get(dtype, 0)
        offsets.append(offset)
        step = max(1, ALIGNMENT_BYTES // dtype.itemsize)
        sizes[dtype] = offset + -(-torch.Size(shape).numel() // step) * step
    buffers = {dtype: torch.empty(size, dtype=dtype, device=device) for dtype, size in sizes.items()}
    return [buffers[dtype][offset:offset + torch.Size(shape).numel()].view(shape)
            for (shape, dtype), offset in zip(specs, offsets)]


def flat_layout(specs: list[tuple[torch.Size, torch.dtype]]) -> tuple[list[int], int]:
    """Byte offsets of (shape, dtype) `specs` laid out in order in one buffer, each ALIGNMENT_BYTES-aligned, and
    the buffer's size in bytes."""
    offsets, num_bytes = [], 0
    for shape, dtype in specs:
        offsets.append(num_bytes)
        num_bytes += -(-torch.Size(shape).numel() * dtype.itemsize // ALIGNMENT_BYTES) * ALIGNMENT_BYTES
    return offsets, num_bytes
