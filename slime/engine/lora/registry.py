"""Adapter names -> slots of the engine's LoRA buffers, and the requests holding each slot. Plain Python.

A slot is free when no adapter is loaded in it and no request still uses it: unloading an adapter removes its name
at once (new requests naming it are refused) but its slot is reused only after the last request that started with
it finished, so an in-flight request never switches adapter mid-generation. Each load gets a fresh id, the prefix
cache's salt for that adapter's requests: KV computed under one adapter (or under an earlier adapter of the same
name) is never reused by another.
"""

from __future__ import annotations

from dataclasses import dataclass

from slime.engine.lora.adapter import AdapterError

NO_ADAPTER = -1  # the slot of a request served by the base model (Sequence.lora_slot)


@dataclass
class LoadedAdapter:
    name: str
    slot: int
    load_id: int
    rank: int
    source: str  # the folder it came from, or "__tensor__" (SGLang's marker for a tensor push)
    checksums: dict[str, float]  # PEFT tensor name -> float64 sum of the tensor as received

    @property
    def cache_salt(self) -> str:
        return f"lora:{self.load_id}"


class LoraRegistry:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.adapters: dict[str, LoadedAdapter] = {}
        self.num_requests = [0] * num_slots  # requests holding each slot
        self.loaded_slots: set[int] = set()
        self.num_loads = 0

    def free_slot(self, name: str) -> int:
        """A slot `name` may be loaded into; AdapterError if the name is taken or every slot is busy."""
        if not isinstance(name, str) or not name:
            raise AdapterError(f"lora_name must be a non-empty string, got {name!r}")
        if name in self.adapters:
            raise AdapterError(f"adapter {name!r} is already loaded; unload it first or use a new name "
                               "(e.g. <name>@<version>)")
        for slot in range(self.num_slots):
            if slot not in self.loaded_slots and self.num_requests[slot] == 0:
                return slot
        busy = self.num_slots - len(self.loaded_slots)
        raise AdapterError(f"all {self.num_slots} LoRA slots are in use ({len(self.loaded_slots)} adapters loaded"
                           + (f", {busy} unloaded but still used by running requests" if busy else "")
                           + "); unload an adapter first or start the engine with a larger max_loras_per_batch "
                           "(--max-loras-per-batch; slime: --sglang-max-loras-per-batch)")

    def add(self, name: str, slot: int, rank: int, source: str, checksums: dict[str, float]) -> LoadedAdapter:
        self.num_loads += 1
        self.adapters[name] = LoadedAdapter(name, slot, self.num_loads, rank, source, checksums)
        self.loaded_slots.add(slot)
        return self.adapters[name]

    def remove(self, name: str) -> LoadedAdapter:
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise AdapterError(f"adapter {name!r} is not loaded; loaded: {sorted(self.adapters)}")
        self.loaded_slots.discard(adapter.slot)
        return adapter

    def acquire(self, name: str) -> LoadedAdapter:
        """The adapter a new request names, counted as using its slot until `release`."""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise AdapterError(f"unknown LoRA adapter {name!r} (lora_path); loaded: {sorted(self.adapters)}")
        self.num_requests[adapter.slot] += 1
        return adapter

    def release(self, slot: int) -> None:
        assert self.num_requests[slot] > 0, f"LoRA slot {slot} released more often than acquired"
        self.num_requests[slot] -= 1

    def is_in_use(self, slot: int) -> bool:
        return slot in self.loaded_slots or self.num_requests[slot] > 0
