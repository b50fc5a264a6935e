"""WeightSnapshot: copies of one training process's weight tensors, by tag ("actor", "ref", "teacher",
"pushed:<version>"). The train flow switches weight sets by copying a tag into the live tensors (the seed's
`_switch_model`): a reference or teacher model runs through the same sharded modules.

Where a copy lives: host memory (pinned) by default; the tags given to `place_on_device` (decided once, when the
device has room: `device_tags`) keep a device copy while the trainer is on the device, so saving and restoring
them are device-to-device copies. A tag placed "backed" (the ref, the teacher: they change only when saved) also
keeps its host copy: `offload` frees its device copy at no copy cost and `onload` uploads it again on a side stream,
which a restore waits for on the stream. An unbacked tag (the actor's transient save around a ref pass) has no host
copy and is dropped on offload; it must be saved again before a restore. Backend-neutral: it sees only the
(name, tensor) pairs the backend says this process holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from slime.backends.side_stream import SideStream
from slime.utils.flat_buffer import flat_empty

# Device memory kept free besides the snapshots: activations, the gathered layers and the engines' transient use.
DEVICE_HEADROOM_FRACTION = 0.25
# Device bytes per weight the optimizer has not allocated when the placement is decided (before the first step):
# at most an fp32 main copy and Adam's two fp32 moments.
OPTIMIZER_BYTES_PER_WEIGHT = 12


def device_tags(tags: list[str], set_bytes: int, free_bytes: int, total_bytes: int, reserved_bytes: int) -> list[str]:
    """The longest prefix of `tags` (in priority order) whose device copies, `set_bytes` each, fit in the free
    memory less `reserved_bytes` (state not allocated yet, e.g. Adam's moments before the first step) and the
    headroom (DEVICE_HEADROOM_FRACTION of the device)."""
    room = free_bytes - reserved_bytes - DEVICE_HEADROOM_FRACTION * total_bytes
    count = max(0, min(len(tags), int(room // set_bytes))) if set_bytes > 0 else len(tags)
    return tags[:count]


class WeightSnapshot:
    def __init__(self, local_weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]):
        self.local_weights = local_weights
        self.tags: dict[str, dict[str, torch.Tensor]] = {}  # host copies
        self.device_copies: dict[str, dict[str, torch.Tensor]] = {}
        self.placement: dict[str, bool] = {}  # tag kept on the device -> backed by a host copy
        self.uploads: SideStream | None = None

    def place_on_device(self, device: torch.device, tags: list[str], engines_release_memory: bool = False) -> None:
        """Decide once, before saving them, which of `tags` (in priority order) keep a device copy: as many as fit
        (`device_tags`) beside the optimizer state still to be allocated (fp32 main weights and Adam's moments,
        OPTIMIZER_BYTES_PER_WEIGHT). "actor" is unbacked (a transient save), the others backed by a host copy.
        `engines_release_memory`: engines share the device but release their memory while this process trains
        (colocated offload), so what they hold now is free when the copies are used; only this process counts."""
        weights = [tensor for _, tensor in self.local_weights()]
        set_bytes = sum(tensor.numel() * tensor.element_size() for tensor in weights)
        free, total = torch.cuda.mem_get_info(device)
        if engines_release_memory:
            free = total - torch.cuda.memory_reserved(device)
        reserved = OPTIMIZER_BYTES_PER_WEIGHT * sum(tensor.numel() for tensor in weights)
        self.placement = {tag: tag != "actor" for tag in device_tags(tags, set_bytes, free, total, reserved)}
        self.uploads = SideStream(device)

    @torch.no_grad()
    def save(self, tag: str) -> None:
        self._wait(tag)
        weights = list(self.local_weights())
        on_device = tag in self.placement and all(tensor.is_cuda for _, tensor in weights)
        if on_device:
            store = self.device_copies.setdefault(tag, {})
            new = [(name, tensor) for name, tensor in weights if name not in store]
            if new:  # one allocation per dtype (flat_buffer.py): the actor's transient copy is made every step
                views = flat_empty([(tensor.shape, tensor.dtype) for _, tensor in new], new[0][1].device)
                store.update((name, view) for (name, _), view in zip(new, views))
            for name, tensor in weights:
                store[name].copy_(tensor)  # same stream as every reader of the live tensors: no sync
        else:
            self.device_copies.pop(tag, None)  # a stale device copy must not win over the new host one
        if not on_device or self.placement[tag]:
            self._save_to_host(tag, weights)

    def _save_to_host(self, tag: str, weights: list[tuple[str, torch.Tensor]]) -> None:
        pin = torch.cuda.is_available()
        store = self.tags.setdefault(tag, {})
        for name, tensor in weights:
            if name not in store:
                store[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            store[name].copy_(tensor, non_blocking=True)
        if pin:
            torch.cuda.current_stream().synchronize()  # the copies above only, not a side stream's

    @torch.no_grad()
    def restore(self, tag: str) -> None:
        self._wait(tag)
        weights = list(self.local_weights())
        store = self.device_copies.get(tag) if all(tensor.is_cuda for _, tensor in weights) else None
        if store is None:
            if tag not in self.tags:
                raise KeyError(f"weight set {tag!r} was not saved since the last offload (its device copy is gone)")
            store = self.tags[tag]
        for name, tensor in weights:
            tensor.copy_(store[name], non_blocking=True)
        if store is not self.device_copies.get(tag) and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()

    def drop(self, tag: str) -> None:
        self._wait(tag)
        self.device_copies.pop(tag, None)
        self.tags.pop(tag, None)

    def unbacked_device_bytes(self) -> int:
        """Device bytes of the copies an offload drops for good (the unbacked tags': no onload brings them back)."""
        return sum(tensor.numel() * tensor.element_size() for tag, store in self.device_copies.items()
                   if not self.placement.get(tag) for tensor in store.values())

    def offload(self) -> None:
        """Free the device copies (backed tags keep their host copy; unbacked ones are gone)."""
        for tag in list(self.device_copies):
            self._wait(tag)  # an upload still writing it: the frees are ordered after it on the stream
            del self.device_copies[tag]

    @torch.no_grad()
    def onload(self) -> None:
        """Upload the backed tags' host copies on the side stream; a save, restore or drop of a tag waits for it."""
        for tag, backed in self.placement.items():
            if not backed or tag not in self.tags or tag in self.device_copies:
                continue
            host = self.tags[tag]
            views = flat_empty([(tensor.shape, tensor.dtype) for tensor in host.values()], self.uploads.device)
            store = dict(zip(host, views))
            with self.uploads.copying(tag):
                for name, tensor in host.items():
                    store[name].copy_(tensor, non_blocking=True)
            self.device_copies[tag] = store

    def _wait(self, tag: str) -> None:
        if self.uploads is not None:
            self.uploads.wait(tag)


def place_weight_sets(snapshot: WeightSnapshot, args, device: torch.device, with_ref: bool,
                      engines_release_memory: bool) -> None:
    """The weight sets swapped in every step (the actor's transient save, the ref, the OPD teacher) live on the
    device where it has room; not with --weight-snapshots-on-host. Engines that share the device and keep their
    memory while this process trains (colocated without offload) count as used: the sets take what is free beside
    them, else stay on the host (each ref pass then copies ~3 weight sets over PCIe)."""
    if device.type != "cuda" or args.weight_snapshots_on_host:
        return
    backed = {"ref": with_ref, "teacher": bool(args.opd_teacher_load)}
    if any(backed.values()):
        snapshot.place_on_device(device, ["actor"] + [tag for tag, used in backed.items() if used],
                                 engines_release_memory)
