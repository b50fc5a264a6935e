"""The Engine's LoRA side (a mixin of `Engine`): load an adapter into a free slot, unload it, resolve a request's
adapter name to its slot and prefix-cache salt, and release the slot when the request finishes. Runs on the engine's
driver thread between two steps, like every engine change. Not the HTTP routes (server/lora_routes.py) and not the
computation (slots.py).
"""

from __future__ import annotations

import dataclasses
import logging

from slime.engine.lora.adapter import AdapterError, LoraAdapter, read_peft_folder
from slime.engine.lora.registry import NO_ADAPTER, LoadedAdapter
from slime.engine.sequence import Sequence

logger = logging.getLogger(__name__)
TENSOR_SOURCE = "__tensor__"


class EngineLora:
    def _require_lora(self, action: str) -> None:
        if self.model_runner.lora is None:
            raise AdapterError(f"cannot {action}: the engine was started without enable_lora (--enable-lora; "
                               "slime: --sglang-enable-lora or --lora-rank > 0)")

    def load_lora_adapter(self, name: str, adapter: LoraAdapter, source: str = TENSOR_SOURCE) -> LoadedAdapter:
        """Put `adapter` into a free slot under `name`; AdapterError (nothing changed) if it does not fit."""
        self._require_lora("load a LoRA adapter")
        runner = self.model_runner
        if adapter.rank > runner.lora.max_rank:
            raise AdapterError(f"adapter rank r={adapter.rank} exceeds the engine's max_lora_rank="
                               f"{runner.lora.max_rank} (--max-lora-rank; slime: --sglang-max-lora-rank)")
        runner.lora.check(adapter)
        slot = runner.lora_registry.free_slot(name)
        self._drain()  # a step in flight must not read a slot while it is written
        if self.config.tp_size > 1:  # the other ranks get it through their pipe (pickled): host copies, not handles
            adapter = dataclasses.replace(adapter, modules={name: (a.cpu(), b.cpu())
                                                            for name, (a, b) in adapter.modules.items()})
        runner.write_lora_slot(slot, adapter)  # on every rank (engine/parallel/every_rank.py)
        loaded = runner.lora_registry.add(name, slot, adapter.rank, source, adapter.checksums)
        logger.info("loaded LoRA adapter %r (rank %d) into slot %d", name, adapter.rank, slot)
        return loaded

    def load_lora_adapter_from_folder(self, name: str, path: str) -> LoadedAdapter:
        self._require_lora("load a LoRA adapter")
        return self.load_lora_adapter(name, read_peft_folder(path, self.model_runner.lora.max_rank), str(path))

    def unload_lora_adapter(self, name: str) -> None:
        """Forget `name`; its slot is reused once the requests already using it have finished."""
        self._require_lora("unload a LoRA adapter")
        self.model_runner.lora_registry.remove(name)

    def loaded_lora_adapters(self) -> dict[str, str]:
        """name -> where it came from (a folder, or "__tensor__"), SGLang's `loaded_adapters`."""
        if self.model_runner.lora is None:
            return {}
        return {name: adapter.source for name, adapter in self.model_runner.lora_registry.adapters.items()}

    def _attach_lora(self, seq: Sequence, name: str | None) -> None:
        """Give a new request its adapter's slot and prefix-cache salt (None: the base model)."""
        if name is None:
            return
        self._require_lora(f"serve LoRA adapter {name!r}")
        adapter = self.model_runner.lora_registry.acquire(name)
        seq.lora_slot, seq.cache_salt = adapter.slot, adapter.cache_salt

    def _detach_lora(self, seq: Sequence) -> None:
        if seq.lora_slot != NO_ADAPTER:
            self.model_runner.lora_registry.release(seq.lora_slot)
            seq.lora_slot = NO_ADAPTER
