"""The device storage of an engine model's weights while it is released (colocated RL: the trainer uses the GPU
memory while the engine sleeps), and putting it back: either a host copy, or nothing at all when the caller will
overwrite every weight before the next generation ("discard").

On CUDA the copy goes to pinned host buffers allocated at the first release and reused by every later one:
pinning a model's worth of host memory took most of a release (0.7-1.1 s for 1.2 GB on an H200 host), the copy
itself tens of milliseconds; a colocated RL run releases once per rollout. On the CPU the copy is the parameters'
own storage.

A discarding release copies nothing (a colocated run pushes every weight after each resume, so a copy would be
overwritten unread); its resume is one allocation per dtype, the parameters views of it, and the weights hold
garbage until loaded: `missing` is the set of checkpoint names not loaded since the discard, and the engine
refuses to generate while it is not empty. Not here: the KV cache (model_runner.py) or the CUDA graphs that hold
the weights' addresses.
"""

from __future__ import annotations

import torch

from slime.utils.flat_buffer import flat_empty


class HostWeights:
    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: dict[str, torch.Tensor] | None = None
        self.released = False
        # name -> (shape, dtype) of every parameter while released by discarding (no buffer holds the shapes)
        self.discarded: dict[str, tuple[torch.Size, torch.dtype]] | None = None
        self.missing: set[str] = set()

    def release(self, model: torch.nn.Module, weight_names: set[str] | None = None) -> None:
        """Free every parameter's device storage, copied to the host first, or discarded when `weight_names` (the
        checkpoint names that must all be loaded again before the weights are valid) is given; a no-op when
        already released."""
        if self.released:
            return
        if weight_names is not None:
            self.discarded = {name: (param.shape, param.dtype) for name, param in model.named_parameters()}
            self.missing = set(weight_names)
            for param in model.parameters():
                param.data = torch.empty(0, dtype=param.dtype, device=self.device)
            self.released = True
            return
        on_cuda = self.device.type == "cuda"
        if self.buffers is None or not on_cuda:
            self.buffers = {}
        for name, param in model.named_parameters():
            if not on_cuda:
                self.buffers[name] = param.data
            else:
                buffer = self.buffers.get(name)
                if buffer is None or buffer.shape != param.shape or buffer.dtype != param.dtype:
                    buffer = self.buffers[name] = torch.empty(param.shape, dtype=param.dtype, pin_memory=True)
                buffer.copy_(param.data, non_blocking=True)
            param.data = torch.empty(0, dtype=param.dtype, device=self.device)
        if on_cuda:
            torch.cuda.synchronize(self.device)
        self.released = True

    def resume(self, model: torch.nn.Module) -> None:
        """Put the host copy back on the device, or after a discard allocate the storage uninitialized; a no-op
        when not released."""
        if not self.released:
            return
        if self.discarded is not None:
            self._allocate(model)
        else:
            for name, param in model.named_parameters():
                param.data = self.buffers[name].to(self.device, non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            else:
                self.buffers = None  # on the CPU they are the parameters' storage again
        self.released = False

    def loaded(self, names) -> None:
        """Checkpoint names just copied into the model (after a discard, the weights are valid once all are)."""
        self.missing.difference_update(names)

    def _allocate(self, model: torch.nn.Module) -> None:
        """One device allocation per dtype for all parameters, not one per parameter (each is a driver call)."""
        params = dict(model.named_parameters())
        for name, view in zip(self.discarded, flat_empty(list(self.discarded.values()), self.device)):
            params[name].data = view
        self.discarded = None
