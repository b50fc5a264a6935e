"""HostStorageCopies: the bytes of a set of device storages, copied to one pinned host buffer, released from the
device and given back, with every tensor object kept (and so every view of it, and every reference to it held
elsewhere: FSDP's, an optimizer's, Megatron's buffers').

The unit is the storage. `release` resizes it to zero bytes: each tensor over it keeps its shape, dtype and device
and holds no memory (reading it before `restore` is the caller's error); `restore` allocates it again (one allocation
per storage: tensors laid out in one flat buffer, flat_buffer.py, come back in one) and copies its bytes in. The
host side is one buffer, the storages laid out one after another at ALIGNMENT_BYTES, reused while they fit: so
offloads pin nothing new, and a model's tensors first held one storage each fit, once moved into flat buffers
(fsdp_utils/offload.py), where they were.

Copies are queued on the current stream, non-blocking (a caller may pick a side stream); ordering a `release` after
the copies that read the storage (a synchronize) is the caller's. Not here: which tensors move, and when (the
backends' offload modules).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

from slime.utils.flat_buffer import ALIGNMENT_BYTES


def storage_bytes(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over a storage's first `nbytes` bytes."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


def storage_key(storage: torch.UntypedStorage) -> int:
    """The storage object's identity (its data pointer changes on a resize; this does not)."""
    return storage._cdata


def storages_of(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct storages, holding bytes, under `tensors`, in order of first appearance."""
    storages: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() > 0:
            storages.setdefault(storage_key(storage), storage)
    return list(storages.values())


class HostStorageCopies:
    def __init__(self):
        self._buffer: torch.Tensor | None = None  # uint8, pinned when the storages are on a GPU
        self._slots: dict[int, tuple[int, int]] = {}  # storage key -> (offset, nbytes) in the buffer
        self._released: list[tuple[torch.UntypedStorage, int, bool]] = []  # (storage, nbytes, its bytes kept)
        self._released_keys: set[int] = set()

    @property
    def released(self) -> bool:
        return bool(self._released)

    def released_only(self, keys: set[int]) -> bool:
        """Whether something is released and every released storage is one of `keys`."""
        return self.released and all(storage_key(storage) in keys for storage, _, _ in self._released)

    def copy_to_host(self, storages: list[torch.UntypedStorage],
                     only: list[torch.UntypedStorage] | None = None) -> None:
        """Queue the copies of `storages`' bytes (or of `only`, some of them, whose host bytes are stale) into the
        host buffer, on the current stream. A different set of storages than the last is laid out anew and copied
        whole: the other slots' bytes belong to the old layout. Refused while storages are released: their bytes
        are only in the host buffer, at the current layout."""
        if self._released:
            raise RuntimeError("copying to the host while storages are released would lose their bytes; restore first")
        if self._lay_out(storages):
            only = None
        for storage in storages if only is None else only:
            offset, nbytes = self._slots[storage_key(storage)]
            self._buffer[offset:offset + nbytes].copy_(storage_bytes(storage, nbytes), non_blocking=True)

    def _lay_out(self, storages: list[torch.UntypedStorage]) -> bool:
        """Slots for `storages` in the host buffer (grown only when they do not fit); whether the layout changed."""
        slots, end = {}, 0
        for storage in storages:
            slots[storage_key(storage)] = (end, storage.nbytes())
            end += -(-storage.nbytes() // ALIGNMENT_BYTES) * ALIGNMENT_BYTES
        if slots == self._slots:
            return False
        if self._buffer is None or self._buffer.numel() < end:
            pin = any(storage.device.type == "cuda" for storage in storages)
            if self._buffer is not None and pin:  # outgrown (Adam's state came after the first offload): the
                self._buffer = None  # host allocator keeps a freed pinned block cached, rounded up to a power of 2
                empty_host_cache = getattr(getattr(torch.accelerator, "memory", None), "empty_host_cache", None)
                if empty_host_cache is not None:
                    empty_host_cache()
            self._buffer = torch.empty(end, dtype=torch.uint8, pin_memory=pin)
        self._slots = slots
        return True

    def host_value(self, tensor: torch.Tensor) -> torch.Tensor:
        """A released `tensor`'s value in its storage's host copy (a view of the host buffer); KeyError for a
        tensor not released here (once restored, the host copy may be stale)."""
        key = storage_key(tensor.untyped_storage())
        if key not in self._released_keys:
            raise KeyError("the tensor's storage is not released here")
        offset, _ = self._slots[key]
        itemsize = tensor.dtype.itemsize  # slots start ALIGNMENT_BYTES-aligned: a whole number of elements in
        return self._buffer.view(tensor.dtype).as_strided(tensor.shape, tensor.stride(),
                                                          offset // itemsize + tensor.storage_offset())

    def host_buffer_pointer(self) -> int | None:
        return None if self._buffer is None else self._buffer.data_ptr()

    def release(self, storages: list[torch.UntypedStorage], keep_bytes: bool = True) -> None:
        """Free `storages` on the device: their bytes kept in the host copies (copied and complete: the caller
        synchronized), or forgotten (`keep_bytes=False`: they come back zeroed)."""
        for storage in storages:
            if keep_bytes and storage_key(storage) not in self._slots:
                raise AssertionError("a storage released with its bytes kept was never copied to the host")
            self._released.append((storage, storage.nbytes(), keep_bytes))
            self._released_keys.add(storage_key(storage))
            storage.resize_(0)

    def restore(self, copying=contextlib.nullcontext()) -> None:
        """Allocate every released storage again, on the current stream, and queue its bytes' copy back inside
        `copying` (the current stream by default); forgotten ones are zeroed."""
        released, self._released = self._released, []
        self._released_keys = set()
        for storage, nbytes, _ in released:
            storage.resize_(nbytes)
        with copying:
            for storage, nbytes, kept in released:
                device_bytes = storage_bytes(storage, nbytes)
                if kept:
                    offset, _ = self._slots[storage_key(storage)]
                    device_bytes.copy_(self._buffer[offset:offset + nbytes], non_blocking=True)
                else:
                    device_bytes.zero_()

    def forget_released(self) -> None:
        """The released storages stay empty: their tensors were given new storages (from `host_value`)."""
        self._released = []
        self._released_keys = set()
