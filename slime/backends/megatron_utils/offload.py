"""Colocated offload of the Megatron trainer's GPU state by storage, so every tensor, view and reference stays valid.

While the engines generate, the trainer's parameter and gradient buffers, the optimizer's main weights and its state
leave the GPU. megatron-core's own `optimizer.offload_to_cpu` rebinds `p.data` to a host copy: with fp32 parameters
the distributed optimizer's main weights are views of the parameter buffer, so the rebind reads a buffer already
freed (CUDA "invalid argument"), and after the restore the optimizer would step a copy the model never sees. Here the
unit is the storage (host_storage_copies.py): its bytes go to a pinned host buffer (reused across offloads) and it is
resized to zero; onload resizes it back and copies the bytes in, so tensors sharing a storage (views, `main_grad`,
fp32 main weights inside the parameter buffer) are all restored at once. Gradient storages are dropped, not copied,
and come back zeroed.

Not here: which tensors a backend offloads (megatron_utils/backend.py).
"""

from __future__ import annotations

import torch

from slime.backends.host_storage_copies import HostStorageCopies, storage_key, storages_of


class StorageOffload:
    """Moves the storages of given tensors to the host and back, keeping each storage object (and so every view)."""

    def __init__(self):
        self._copies = HostStorageCopies()  # one pinned host buffer, reused across offloads

    @property
    def offloaded(self) -> bool:
        return self._copies.released

    def offload(self, keep: list[torch.Tensor], drop: list[torch.Tensor] = ()) -> None:
        """Free the storages of `keep` (their bytes copied to the host) and `drop` (their bytes forgotten). A storage
        reached from both is kept; one already empty is skipped."""
        if self.offloaded:
            raise RuntimeError("the trainer's state is already offloaded; onload it before offloading again")
        kept = storages_of(keep)
        kept_keys = {storage_key(storage) for storage in kept}
        dropped = [storage for storage in storages_of(drop) if storage_key(storage) not in kept_keys]
        self._copies.copy_to_host(kept)
        if any(storage.device.type == "cuda" for storage in kept + dropped):
            torch.cuda.synchronize()
        self._copies.release(kept)
        self._copies.release(dropped, keep_bytes=False)

    def onload(self) -> None:
        """Give every offloaded storage its bytes back (dropped ones zeroed)."""
        self._copies.restore()
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
