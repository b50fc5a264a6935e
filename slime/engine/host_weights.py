"""The host copy of an engine model's weights while their device storage is released (colocated RL: the trainer
uses the GPU memory while the engine sleeps), and putting them back.

On CUDA the copy goes to pinned host buffers allocated at the first release and reused by every later one:
pinning a model's worth of host memory took most of a release (0.7-1.1 s for 1.2 GB on an H200 host), the copy
itself tens of milliseconds; a colocated RL run releases once per rollout. On the CPU the copy is the parameters'
own storage. Not here: the KV cache (model_runner.py) or the CUDA graphs that hold the weights' addresses.
"""

from __future__ import annotations

import torch


class HostWeights:
    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: dict[str, torch.Tensor] | None = None
        self.released = False

    def release(self, model: torch.nn.Module) -> None:
        """Copy every parameter to the host and free its device storage; a no-op when already released."""
        if self.released:
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
        """Put the host copy back on the device; a no-op when not released."""
        if not self.released:
            return
        for name, param in model.named_parameters():
            param.data = self.buffers[name].to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        else:
            self.buffers = None  # on the CPU they are the parameters' storage again
        self.released = False
