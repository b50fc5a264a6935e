"""Colocated offload of the Megatron trainer's GPU state by storage, so every tensor, view and reference stays valid.

While the engines generate, the trainer's parameter and gradient buffers, the optimizer's main weights and its state
leave the GPU. megatron-core's own `optimizer.offload_to_cpu` rebinds `p.data` to a host copy: with fp32 parameters
the distributed optimizer's main weights are views of the parameter buffer, so the rebind reads a buffer already
freed (CUDA "invalid argument"), and after the restore the optimizer would step a copy the model never sees. Here the
unit is the storage: its bytes go to a pinned host buffer (kept and reused across offloads) and the storage is
resized to zero; onload resizes it back and copies the bytes in, so tensors sharing a storage (views, `main_grad`,
fp32 main weights inside the parameter buffer) are all restored at once. Gradient storages are dropped, not copied,
and come back zeroed.

Not here: which tensors a backend offloads (megatron_utils/backend.py).
"""

from __future__ import annotations

import torch


def _bytes_of(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over a storage's first `nbytes` bytes."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


class StorageOffload:
    """Moves the storages of given tensors to the host and back, keeping each storage object (and so every view)."""

    def __init__(self):
        self._host: dict[int, torch.Tensor] = {}  # storage key -> host bytes, reused while the size stays
        self._offloaded: list[tuple[torch.UntypedStorage, int, bool]] = []  # (storage, nbytes, keep the bytes)

    @property
    def offloaded(self) -> bool:
        return bool(self._offloaded)

    def offload(self, keep: list[torch.Tensor], drop: list[torch.Tensor] = ()) -> None:
        """Free the storages of `keep` (their bytes copied to the host) and `drop` (their bytes forgotten). A storage
        reached from both is kept; one already empty is skipped."""
        if self._offloaded:
            raise RuntimeError("the trainer's state is already offloaded; onload it before offloading again")
        storages: dict[int, tuple[torch.UntypedStorage, bool]] = {}
        for tensors, copy in ((keep, True), (drop, False)):
            for tensor in tensors:
                storage = tensor.untyped_storage()
                key = storage._cdata  # the storage object's identity; its data pointer moves on a resize
                if storage.nbytes() > 0 and key not in storages:
                    storages[key] = (storage, copy)
        for key, (storage, copy) in storages.items():
            nbytes = storage.nbytes()
            if copy:
                host = self._host.get(key)
                if host is None or host.numel() != nbytes:
                    host = self._host[key] = torch.empty(nbytes, dtype=torch.uint8,
                                                         pin_memory=storage.device.type == "cuda")
                host.copy_(_bytes_of(storage, nbytes), non_blocking=True)
            self._offloaded.append((storage, nbytes, copy))
        if storages and next(iter(storages.values()))[0].device.type == "cuda":
            torch.cuda.synchronize()
        for storage, _, _ in self._offloaded:
            storage.resize_(0)
        stale = set(self._host) - {s._cdata for s, _, copy in self._offloaded if copy}
        for key in stale:  # storages gone since the last offload (a reset optimizer's old state)
            del self._host[key]

    def onload(self) -> None:
        """Give every offloaded storage its bytes back (dropped ones zeroed)."""
        for storage, nbytes, copy in self._offloaded:
            storage.resize_(nbytes)
            device_bytes = _bytes_of(storage, nbytes)
            if copy:
                device_bytes.copy_(self._host[storage._cdata], non_blocking=True)
            else:
                device_bytes.zero_()
        if self._offloaded and self._offloaded[0][0].device.type == "cuda":
            torch.cuda.synchronize()
        self._offloaded = []
