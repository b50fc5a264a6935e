"""Host-to-device copies of a step's small input arrays through a ring of pinned (page-locked) host buffers.

Why: a copy from ordinary (pageable) host memory may make the host wait until the GPU has finished everything
queued before it, so with overlapped scheduling the next step's inputs would only go out once the step in flight
had finished, serialising host and GPU again. From pinned memory the copy is queued and the call returns at once.
A buffer is reused only after the copy that last read it has finished (a CUDA event per slot); the ring is long
enough that this wait is already over in practice.

On the CPU there is nothing to stage: arrays become tensors that share their memory.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

NUM_SLOTS = 32  # copies in flight at most: a step makes about five, and at most two steps are in flight


class HostStaging:
    def __init__(self, device: torch.device, num_slots: int = NUM_SLOTS):
        self.device = device
        self.pinned = device.type == "cuda"
        self.buffers: list[torch.Tensor | None] = [None] * num_slots
        self.events: list[torch.cuda.Event | None] = [None] * num_slots
        self.next_slot = 0

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """A new device tensor with `array`'s contents (queued, not waited for)."""
        if not self.pinned:
            return torch.from_numpy(np.ascontiguousarray(array))
        out = torch.empty(array.shape, dtype=_torch_dtype(array.dtype), device=self.device)
        self.copy_(out, array)
        return out

    def to_device_packed(self, arrays: list[np.ndarray], dtype) -> list[torch.Tensor]:
        """1-D arrays as device tensors of `dtype`, sent in one transfer. Each piece starts 16-byte aligned: Triton
        kernels are compiled per pointer alignment, and a misaligned piece would trigger a recompilation mid-run."""
        align = 16 // np.dtype(dtype).itemsize
        sizes = [len(array) for array in arrays]
        padded_sizes = [-(-size // align) * align for size in sizes]
        packed = np.zeros(sum(padded_sizes), dtype=dtype)
        offset = 0
        for array, padded_size in zip(arrays, padded_sizes):
            packed[offset : offset + len(array)] = array
            offset += padded_size
        pieces = self.to_device(packed).split(padded_sizes)
        return [piece[:size] for piece, size in zip(pieces, sizes)]

    def copy_(self, destination: torch.Tensor, array: np.ndarray) -> None:
        """destination.copy_(array), queued on the current stream without waiting for the GPU."""
        if not self.pinned:
            destination.copy_(torch.from_numpy(np.ascontiguousarray(array)))
            return
        slot = self.next_slot
        self.next_slot = (slot + 1) % len(self.buffers)
        if self.events[slot] is not None:
            self.events[slot].synchronize()
        buffer = self.buffers[slot]
        if buffer is None or buffer.numel() < array.nbytes:
            buffer = self.buffers[slot] = torch.empty(max(array.nbytes, 4096), dtype=torch.uint8, pin_memory=True)
        host = buffer[: array.nbytes].view(_torch_dtype(array.dtype)).view(array.shape)
        host.numpy()[...] = array
        destination.copy_(host, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.events[slot] = event


@functools.cache  # called for every copy of every step
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
