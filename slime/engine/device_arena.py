"""Device tensors that come back at the same addresses after their memory is freed: a range of virtual addresses
reserved once, with physical memory mapped into it and unmapped from it (the CUDA driver's virtual memory
management, through ctypes; what SGLang's torch_memory_saver does with a preloaded allocator).

Why: a colocated RL run frees the engine's weights and KV cache on every step so the trainer can use the memory,
and the engine's decode CUDA graphs bake in their addresses. Put back by ordinary allocations, the tensors land
elsewhere and every graph a rollout needs must be captured again (10-45 ms each on an H200, inside the rollout);
put back here, the graphs stay valid (cuda_graph.ParkedGraphs checks the addresses before taking them back).

`StableBuffers` is the interface the engine uses: tensors of fixed (shape, dtype) specs, allocated and freed as a
whole. It falls back to ordinary allocations (one per dtype, addresses not kept) on the CPU, and where the driver
has no virtual memory management or refuses it; `stable` says which. Not here: what the tensors hold (a freed
arena's contents are gone; host copies are host_weights.py's), or keeping anything from touching a freed tensor
(the owner replaces every view it handed out before it frees).
"""

from __future__ import annotations

import ctypes
import logging
import weakref

import torch

from slime.utils.flat_buffer import flat_empty, flat_layout, flat_views

logger = logging.getLogger(__name__)

_ALLOCATION_TYPE_PINNED = 1
_LOCATION_TYPE_DEVICE = 1
_ACCESS_READ_WRITE = 3
_GRANULARITY_MINIMUM = 0
_ERROR_OUT_OF_MEMORY = 2


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requested_handle_types", ctypes.c_int), ("location", _Location),
                ("win32_handle_meta_data", ctypes.c_void_p), ("compression_type", ctypes.c_ubyte),
                ("gpu_direct_rdma_capable", ctypes.c_ubyte), ("usage", ctypes.c_ushort),
                ("reserved", ctypes.c_ubyte * 36)]  # zeros past the fields this driver version reads


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class DriverError(RuntimeError):
    pass


class _Driver:
    """The few driver entry points the arena calls, each checked."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        u64, size = ctypes.c_uint64, ctypes.c_size_t
        signatures = {
            "cuMemGetAllocationGranularity": [ctypes.POINTER(size), ctypes.POINTER(_AllocationProp), ctypes.c_int],
            "cuMemAddressReserve": [ctypes.POINTER(u64), size, size, u64, u64],
            "cuMemAddressFree": [u64, size],
            "cuMemCreate": [ctypes.POINTER(u64), size, ctypes.POINTER(_AllocationProp), u64],
            "cuMemRelease": [u64],
            "cuMemMap": [u64, size, size, u64, u64],
            "cuMemUnmap": [u64, size],
            "cuMemSetAccess": [u64, size, ctypes.POINTER(_AccessDesc), size],
            "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
        }
        for name, argtypes in signatures.items():
            function = getattr(self.lib, name)
            function.argtypes, function.restype = argtypes, ctypes.c_int

    def __call__(self, name: str, *args) -> None:
        result = getattr(self.lib, name)(*args)
        if result != 0:
            message = ctypes.c_char_p()
            self.lib.cuGetErrorString(result, ctypes.byref(message))
            error = f"{name} failed: CUresult {result} ({(message.value or b'?').decode()})"
            if result == _ERROR_OUT_OF_MEMORY:  # the type torch's own allocations raise, so callers catch one
                raise torch.OutOfMemoryError(f"{error}: the device has no room for the engine's weights or KV cache "
                                             "(lower --sglang-mem-fraction-static / gpu_memory_utilization, or "
                                             "free the memory first)")
            raise DriverError(error)


_driver: _Driver | None = None


def _get_driver() -> _Driver:
    global _driver
    if _driver is None:
        _driver = _Driver()
    return _driver


class _DeviceBytes:
    """A device pointer as a __cuda_array_interface__ (torch.as_tensor wraps it without copying). A tensor made from
    it keeps it alive, and through `owner` the arena: the addresses are not given back while a view exists."""

    def __init__(self, owner: DeviceArena, address: int, num_bytes: int):
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (num_bytes,), "typestr": "|u1", "data": (address, False),
                                         "strides": None, "version": 2}


_deferred: list[tuple] = []  # arenas collected while a CUDA graph was being captured: given back at the next map


def _give_back(driver: _Driver, device: torch.device, address: int, num_bytes: int, mapping: dict) -> None:
    """Unmap and free an arena nothing references any more (its finalizer); quiet at interpreter exit, when the
    driver may already be gone. During a CUDA graph capture (another engine's, in this process) the synchronize
    would break the capture, so the arena waits in `_deferred`."""
    try:
        if torch.cuda.is_current_stream_capturing():
            _deferred.append((driver, device, address, num_bytes, mapping))
            return
        if mapping.get("handle") is not None:
            torch.cuda.synchronize(device)
            driver("cuMemUnmap", address, num_bytes)
            driver("cuMemRelease", mapping.pop("handle"))
        driver("cuMemAddressFree", address, num_bytes)
    except Exception:
        logger.debug("freeing a device arena at %#x failed", address, exc_info=True)


def _give_back_deferred() -> None:
    while _deferred and not torch.cuda.is_current_stream_capturing():
        _give_back(*_deferred.pop())


class DeviceArena:
    """`num_bytes` (rounded up to the driver's granularity) of device addresses reserved at construction; `map`
    backs them with fresh physical memory and returns them as one uint8 tensor, `unmap` gives the memory back to
    the device (the addresses stay reserved), `close` gives the addresses back too. So does the garbage collector
    once neither the arena nor a tensor made by `map` is referenced: an engine dropped unreleased frees its memory."""

    def __init__(self, device: torch.device, num_bytes: int):
        if device.index is None:
            device = torch.device(device.type, torch.cuda.current_device())
        self.device = device
        self.driver = _get_driver()
        torch.cuda.synchronize(device)  # the device's primary context exists before the first driver call
        _give_back_deferred()
        self.prop = _AllocationProp(type=_ALLOCATION_TYPE_PINNED,
                                    location=_Location(_LOCATION_TYPE_DEVICE, device.index))
        granularity = ctypes.c_size_t()
        self.driver("cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(self.prop),
                    _GRANULARITY_MINIMUM)
        self.num_bytes = -(-max(num_bytes, 1) // granularity.value) * granularity.value
        address = ctypes.c_uint64()
        self.driver("cuMemAddressReserve", ctypes.byref(address), self.num_bytes, 0, 0, 0)
        self.address = address.value
        self.mapping: dict = {}  # "handle": the physical memory mapped now, if any (shared with the finalizer)
        self._finalizer = weakref.finalize(self, _give_back, self.driver, device, self.address, self.num_bytes,
                                           self.mapping)

    @property
    def mapped(self) -> bool:
        return self.mapping.get("handle") is not None

    def map(self) -> torch.Tensor:
        if not self.mapped:
            _give_back_deferred()
            handle = ctypes.c_uint64()
            self.driver("cuMemCreate", ctypes.byref(handle), self.num_bytes, ctypes.byref(self.prop), 0)
            mapped = False
            try:
                self.driver("cuMemMap", self.address, self.num_bytes, 0, handle.value, 0)
                mapped = True
                access = _AccessDesc(location=self.prop.location, flags=_ACCESS_READ_WRITE)
                self.driver("cuMemSetAccess", self.address, self.num_bytes, ctypes.byref(access), 1)
            except BaseException:  # nothing half-mapped stays behind: a retry starts from scratch
                if mapped:
                    self.driver("cuMemUnmap", self.address, self.num_bytes)
                self.driver("cuMemRelease", handle.value)
                raise
            self.mapping["handle"] = handle.value
        return torch.as_tensor(_DeviceBytes(self, self.address, self.num_bytes), device=self.device)

    def unmap(self) -> None:
        """Give the physical memory back; every kernel queued on the device finishes first."""
        if not self.mapped:
            return
        torch.cuda.synchronize(self.device)
        self.driver("cuMemUnmap", self.address, self.num_bytes)
        self.driver("cuMemRelease", self.mapping.pop("handle"))

    def close(self) -> None:
        """Unmap and give the addresses back now (otherwise done when nothing references the arena)."""
        self._finalizer()


_supported: dict[torch.device, bool] = {}


def arena_supported(device: torch.device) -> bool:
    """Whether a DeviceArena maps and unmaps on `device` (a 1-byte round trip, once per device; False on the CPU or
    where the driver refuses, with the reason logged)."""
    if device.type != "cuda":
        return False
    if device not in _supported:
        try:
            arena = DeviceArena(device, 1)
            arena.map().fill_(1)
            arena.close()
            _supported[device] = True
        except (OSError, AttributeError, DriverError, torch.OutOfMemoryError) as error:
            logger.warning("device memory at stable addresses unavailable (%s): freed engine memory comes back at "
                           "new addresses, and CUDA graphs are captured again after each release", error)
            _supported[device] = False
    return _supported[device]


class StableBuffers:
    """Tensors of (shape, dtype) `specs`, contiguous and aligned as flat_buffer lays them out, allocated and freed
    together, at the same addresses every time where `stable` (an arena), else as ordinary allocations."""

    def __init__(self, device: torch.device, specs: list[tuple[torch.Size, torch.dtype]]):
        self.device = device
        self.specs = [(torch.Size(shape), dtype) for shape, dtype in specs]
        self.offsets, num_bytes = flat_layout(self.specs)
        self.arena = DeviceArena(device, num_bytes) if arena_supported(device) else None

    @property
    def stable(self) -> bool:
        return self.arena is not None

    def allocate(self) -> list[torch.Tensor]:
        """Uninitialized tensors of the specs (an arena's come back at the addresses of the last allocation)."""
        if self.arena is None:
            return flat_empty(self.specs, self.device)
        return flat_views(self.arena.map(), self.specs, self.offsets)

    def free(self) -> None:
        """Give an arena's memory back (ordinary allocations go when their last view does)."""
        if self.arena is not None:
            self.arena.unmap()
