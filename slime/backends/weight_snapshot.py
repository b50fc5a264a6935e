"""WeightSnapshot: host copies of one training process's weight tensors, by tag ("actor", "ref", "teacher",
"pushed:<version>"). The train flow switches weight sets by copying a tag into the live tensors (the seed's
`_switch_model`): a reference or teacher model costs host memory, not device memory, and runs through the same
sharded modules. Backend-neutral: it sees only the (name, tensor) pairs the backend says this process holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch


class WeightSnapshot:
    def __init__(self, local_weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]):
        self.local_weights = local_weights
        self.tags: dict[str, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def save(self, tag: str) -> None:
        pin = torch.cuda.is_available()
        store = self.tags.setdefault(tag, {})
        for name, tensor in self.local_weights():
            if name not in store:
                store[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            store[name].copy_(tensor, non_blocking=True)
        if pin:
            torch.cuda.synchronize()

    @torch.no_grad()
    def restore(self, tag: str) -> None:
        store = self.tags[tag]
        for name, tensor in self.local_weights():
            tensor.copy_(store[name], non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def drop(self, tag: str) -> None:
        self.tags.pop(tag)
