"""The device storage of an engine model's weights while it is released (colocated RL: the trainer uses the GPU
memory while the engine sleeps), and putting it back: either a host copy, or nothing at all when the caller will
overwrite every weight before the next generation ("discard").

On CUDA the copy goes to pinned host buffers allocated at the first release and reused by every later one:
pinning a model's worth of host memory took most of a release (0.7-1.1 s for 1.2 GB on an H200 host), the copy
itself tens of milliseconds; a colocated RL run releases once per rollout. On the CPU the copy is the parameters'
own storage.

The parameters live in one StableBuffers (device_arena.py), from start-up where the device maps memory at fixed
addresses (`place`), else from the first release: every resume puts each weight back at the same address, so
decode CUDA graphs captured before the release stay valid. A discarding release copies nothing (a colocated run
pushes every weight after each resume, so a copy would be overwritten unread); its resume maps the storage, and the
weights hold garbage until loaded: `missing` is the set of checkpoint names not loaded since the discard, and the
engine refuses to generate while it is not empty. Not here: the KV cache (kv_cache.py) or the CUDA graphs that hold
the weights' addresses (cuda_graph.py).
"""

from __future__ import annotations

import torch

from slime.engine.device_arena import StableBuffers


class HostWeights:
    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: dict[str, torch.Tensor] | None = None  # host copies, kept for the next release on CUDA
        self.discarded = False  # the last release copied nothing
        self.storage: StableBuffers | None = None  # the parameters' device storage from the first release on
        self.released = False
        self.missing: set[str] = set()

    def place(self, model: torch.nn.Module) -> None:
        """Before the checkpoint is loaded (every element of every parameter is then written): the parameters'
        storage made now, where it keeps its addresses (a CUDA device whose driver maps memory at fixed
        addresses), so CUDA graphs captured at start-up stay valid across every release. The constructor's
        tensors go first, so the model is on the device once at the peak, not twice. Elsewhere a no-op (the
        storage is made at the first release)."""
        if self.device.type != "cuda" or self.storage is not None:
            return
        params = dict(model.named_parameters())
        storage = _storage_for(params, self.device)
        if not storage.stable:
            return
        self.storage = storage
        for param in params.values():
            param.data = torch.empty(0, dtype=param.dtype, device=self.device)
        torch.cuda.empty_cache()
        for param, view in zip(params.values(), storage.allocate()):
            param.data = view

    @property
    def stable(self) -> bool:
        """Whether a resume puts every parameter back at the address it has now."""
        return self.storage is not None and self.storage.stable

    def release(self, model: torch.nn.Module, weight_names: set[str] | None = None) -> None:
        """Free every parameter's device storage, copied to the host first, or discarded when `weight_names` (the
        checkpoint names that must all be loaded again before the weights are valid) is given; a no-op when
        already released."""
        if self.released:
            return
        params = dict(model.named_parameters())
        if self.storage is None:
            self.storage = _storage_for(params, self.device)
        on_cuda = self.device.type == "cuda"
        self.discarded = weight_names is not None
        if self.discarded:
            self.missing = set(weight_names)
        elif not on_cuda:
            self.buffers = {name: param.data for name, param in params.items()}
        else:
            self.buffers = self.buffers or {}
            for name, param in params.items():
                buffer = self.buffers.get(name)
                if buffer is None or buffer.shape != param.shape or buffer.dtype != param.dtype:
                    buffer = self.buffers[name] = torch.empty(param.shape, dtype=param.dtype, pin_memory=True)
                buffer.copy_(param.data, non_blocking=True)
            torch.cuda.synchronize(self.device)
        for param in params.values():
            param.data = torch.empty(0, dtype=param.dtype, device=self.device)
        self.storage.free()
        self.released = True

    def resume(self, model: torch.nn.Module) -> None:
        """Put the host copy back on the device, or after a discard map the storage uninitialized; a no-op when not
        released."""
        if not self.released:
            return
        params = dict(model.named_parameters())
        if not self.discarded and self.device.type != "cuda":
            for name, param in params.items():
                param.data = self.buffers[name]  # on the CPU the copy is the parameters' own storage
            self.buffers = None
        else:
            for (name, param), view in zip(params.items(), self.storage.allocate()):
                param.data = view
                if not self.discarded:
                    view.copy_(self.buffers[name], non_blocking=True)
            if not self.discarded:
                torch.cuda.synchronize(self.device)
        self.released = False

    def loaded(self, names) -> None:
        """Checkpoint names just copied into the model (after a discard, the weights are valid once all are)."""
        self.missing.difference_update(names)


def _storage_for(params: dict[str, torch.nn.Parameter], device: torch.device) -> StableBuffers:
    return StableBuffers(device, [(param.shape, param.dtype) for param in params.values()])
