"""SGLang's LoRA routes on the engine server: /load_lora_adapter (a PEFT folder), /unload_lora_adapter and slime's
/load_lora_adapter_from_tensors (a trainer's push: PEFT-named tensors by handle, one serialized list per engine
rank or one for all, and the adapter's config; rank 0 opens the first and hands every rank its part) and
/load_lora_adapter_from_distributed (the same tensors broadcast over the weight-update group that
/init_weights_update_group formed, received on every engine rank). Every successful load answers the float64 sum of each tensor as received
(`checksums`), so the sender can verify the push tensor by tensor. Replies are SGLang's LoRAUpdateOutput
(`success`, `error_message`, `loaded_adapters`) plus `lora_name`; a bad request is a 400 naming the problem.

Parsing and deserializing run off the driver thread; only the copy into the slots runs on it, between two steps.
Not the engine's adapter logic (engine/lora/).
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from slime.engine.lora.adapter import AdapterError, adapter_from_tensors
from slime.engine.memory_tags import EngineMemoryReleasedError
from slime.engine.server.io import read_json
from slime.engine.server.protocol import RequestError, require_fields
from slime.engine.server.weights import DEFAULT_GROUP_NAME
from slime.utils import weight_transport


def register_lora_routes(app: FastAPI, state) -> None:
    loop, engine = state.engine_loop, state.engine

    async def reply(name: str, extra: dict | None = None) -> JSONResponse:
        loaded = await loop.call(engine.loaded_lora_adapters)  # read on the driver thread, which changes it
        return JSONResponse({"success": True, "error_message": "", "lora_name": name, "loaded_adapters": loaded,
                             **(extra or {})})

    async def failure(error: Exception) -> JSONResponse:
        loaded = await loop.call(engine.loaded_lora_adapters)
        return JSONResponse({"success": False, "error_message": str(error), "error": {"message": str(error)},
                             "loaded_adapters": loaded}, status_code=400)

    def max_rank() -> int:
        if engine.model_runner.lora is None:
            engine._require_lora("load a LoRA adapter")
        return engine.config.max_lora_rank

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = require_fields(await read_json(request), "/load_lora_adapter", {"lora_name": str, "lora_path": str},
                              {"pinned": (bool, False)})
        state.weights.check_weight_dir(body["lora_path"], "/load_lora_adapter field 'lora_path'")
        try:
            loaded = await loop.call(engine.load_lora_adapter_from_folder, body["lora_name"], body["lora_path"])
        except (AdapterError, EngineMemoryReleasedError) as error:
            return await failure(error)
        return await reply(body["lora_name"], {"checksums": loaded.checksums})

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = require_fields(await read_json(request), "/unload_lora_adapter", {"lora_name": str})
        try:
            await loop.call(engine.unload_lora_adapter, body["lora_name"])
        except AdapterError as error:
            return await failure(error)
        return await reply(body["lora_name"])

    @app.post("/load_lora_adapter_from_tensors")
    async def load_lora_adapter_from_tensors(request: Request):
        body = require_fields(await read_json(request), "/load_lora_adapter_from_tensors",
                              {"lora_name": str, "config": dict, "serialized_named_tensors": list},
                              {"weight_version": (str, None), "pinned": (bool, False)})
        items = body["serialized_named_tensors"]
        tp_size = engine.config.tp_size
        if len(items) not in (1, tp_size) or not all(isinstance(item, str) for item in items):
            raise RequestError(f"/load_lora_adapter_from_tensors field 'serialized_named_tensors' must be a list of "
                               f"{tp_size} string(s), one per engine rank, or one for all, got {len(items)} item(s)")
        try:
            named_tensors = await asyncio.to_thread(weight_transport.deserialize_named_tensors, items[0])
        except ValueError as error:
            raise RequestError(f"/load_lora_adapter_from_tensors field 'serialized_named_tensors': {error}") from None
        try:
            adapter = await asyncio.to_thread(adapter_from_tensors, body["config"], named_tensors, max_rank())
            await loop.call(engine.load_lora_adapter, body["lora_name"], adapter)
        except (AdapterError, EngineMemoryReleasedError) as error:
            return await failure(error)
        finally:
            del named_tensors  # the sender's shared memory is freed once nothing here maps it
        return await reply(body["lora_name"], {"checksums": adapter.checksums, "weight_version": body["weight_version"]})

    @app.post("/load_lora_adapter_from_distributed")
    async def load_lora_adapter_from_distributed(request: Request):
        """The adapter's PEFT-named tensors broadcast by the trainer's rank 0 over the weight-update group
        (/init_weights_update_group): every rank of this engine receives them (the collective needs them all), rank 0
        builds the adapter and writes it into every rank's slot, as /load_lora_adapter_from_tensors does."""
        route = "/load_lora_adapter_from_distributed"
        body = require_fields(await read_json(request), route,
                              {"lora_name": str, "config": dict, "names": list, "dtypes": list, "shapes": list},
                              {"group_name": (str, DEFAULT_GROUP_NAME), "weight_version": (str, None),
                               "pinned": (bool, False)})
        # Receive every tensor before refusing anything else: a half-done broadcast would leave the trainer hanging.
        named_tensors = await state.weights.receive_broadcast(body, route, keep_on_other_ranks=False)
        try:
            adapter = await asyncio.to_thread(adapter_from_tensors, body["config"], named_tensors, max_rank())
            await loop.call(engine.load_lora_adapter, body["lora_name"], adapter)
        except (AdapterError, EngineMemoryReleasedError) as error:
            return await failure(error)
        finally:
            del named_tensors
        return await reply(body["lora_name"], {"checksums": adapter.checksums, "weight_version": body["weight_version"]})


def adapter_for_model(state, model: str | None) -> str | None:
    """The OpenAI endpoints' `model`: a loaded adapter's name selects it (SGLang's convention), anything else the
    base model."""
    lora = state.engine.model_runner.lora_registry
    return model if lora is not None and model in lora.adapters else None
