"""DeviceRoom: how much device memory a colocated trainer's offload gave up (what its next onload takes back), and
whether that onload fits in the memory free right now, beside the engines' memory, so that it may run while the
engines release theirs instead of after them (train.py's hand-over to training).

Why it is safe to decide from the free memory at the onload's start: the engines are idle then (the rollout is
over) and a release only frees memory, so what is free can only grow until the onload is done; the trainer's
other allocations (activations, gradients) come after the whole hand-over. Not here: the offload itself
(fsdp_utils/offload.py, megatron_utils/offload.py, weight_snapshot.py) or the waiting (slime/ray/actor_group.py).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

# Kept free beyond what the onload takes back, as a fraction of the device: the caching allocator's rounding and
# fragmentation while the blocks come back (little: they come back as one flat buffer per dtype), the CUDA
# context's own growth.
ONLOAD_MARGIN_FRACTION = 0.01


def onload_fits(onload_bytes: int, free_bytes: int, total_bytes: int) -> bool:
    """Whether taking `onload_bytes` back leaves the margin free."""
    return onload_bytes + ONLOAD_MARGIN_FRACTION * total_bytes <= free_bytes


class DeviceRoom:
    def __init__(self, device: torch.device):
        self.device = device
        self.onload_bytes = 0  # what the last offload freed and the next onload allocates again

    @contextmanager
    def measuring_offload(self, not_coming_back: int = 0):
        """Around an offload: the tensors it frees (not the reserved memory, which holds the train step's cached
        blocks), less `not_coming_back` bytes of them that no onload allocates again (transient copies)."""
        if self.device.type != "cuda":
            yield
            return
        before = torch.cuda.memory_allocated(self.device)
        yield
        self.onload_bytes = max(0, before - torch.cuda.memory_allocated(self.device) - not_coming_back)

    def onload_fits_now(self) -> bool:
        """Whether the next onload fits in the device memory free now (always on the CPU: nothing moves)."""
        if self.device.type != "cuda":
            return True
        free, total = torch.cuda.mem_get_info(self.device)
        return onload_fits(self.onload_bytes, free, total)
