"""Weight-update endpoints of the engine server: from tensors (shared memory / CUDA IPC handles), from a
torch.distributed broadcast, and from disk (plus /pull_weights, which first brings a host-local checkpoint up to a
published version: slime.engine.server.local_checkpoint). All validation happens before any parameter is touched, so a
rejected update (unknown name, wrong shape) leaves the model exactly as it was.

Receiving a broadcast and deserializing handles happen off the driver thread (they do not touch the engine); only
the final copy into the model runs on it, between two steps. Every update flushes the prefix cache (KV computed
under the old weights must not be reused), whatever the request's `flush_cache` says. `receive_broadcast` also
serves the LoRA route /load_lora_adapter_from_distributed (lora_routes.py). Not the transport itself
(`slime.utils.weight_transport`) and not the engine's loader (`slime.engine.models.weight_loader`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from datetime import timedelta
from pathlib import Path

import torch

from slime.engine.memory_tags import EngineMemoryReleasedError
from slime.engine.models.weight_loader import (
    EMBEDDING_WEIGHT_NAMES,
    IGNORED_SUFFIXES,
    tied_embedding_name,
    vl_weight_name,
)
from slime.engine.parallel.rank_weights import RankError
from slime.engine.server import local_checkpoint
from slime.engine.server.protocol import RequestError, require_fields
from slime.utils import weight_transport
from slime.utils.daemon_threads import run_in_daemon_thread

DEFAULT_GROUP_NAME = "weight_update_group"
GROUP_TIMEOUT = timedelta(minutes=10)  # the trainer's rank 0 joins within its own start-up; big models load slowly


class EngineWeightReceiver:
    """The engine side of a weight update (the trainer side is `slime.backends.weight_sender`)."""

    def __init__(self, engine_loop, device: torch.device, weight_dirs: list[Path], model_path: str):
        self.loop = engine_loop
        self.model_path = model_path  # version 0 of a /pull_weights chain
        self.device = device
        self.weight_dirs = [Path(d).resolve() for d in weight_dirs]
        self.weight_shapes = engine_loop.engine.named_weight_shapes()
        self.groups: dict[str, object] = {}
        self._group_locks: dict[str, threading.Lock] = {}

    # ---- validation ------------------------------------------------------------------------------------------
    def check_names_and_shapes(self, names_and_shapes, field: str) -> None:
        """RequestError naming the first unknown weight or wrong shape."""
        is_vl = EMBEDDING_WEIGHT_NAMES[1] in self.weight_shapes
        for name, shape in names_and_shapes:
            if name.endswith(IGNORED_SUFFIXES):
                continue
            expected = self.weight_shapes.get(vl_weight_name(name) if is_vl else name)
            if expected is None and name == "lm_head.weight":
                expected = self.weight_shapes.get(tied_embedding_name(self.weight_shapes))  # tied embeddings
            if expected is None:
                raise RequestError(f"{field}: unknown weight name {name!r} for this model")
            if tuple(shape) != tuple(expected[0]):
                raise RequestError(f"{field}: weight {name!r} has shape {tuple(shape)}, expected {tuple(expected[0])}")

    def check_weight_dir(self, path: str, field: str = "/update_weights_from_disk field 'model_path'") -> None:
        """RequestError unless `path` (links resolved) lies inside one of the allowed folders."""
        resolved = Path(path).resolve()
        if not any(resolved == d or d in resolved.parents for d in self.weight_dirs):
            raise RequestError(
                f"{field}: {path!r} is outside the folders this server may load from "
                f"({', '.join(map(str, self.weight_dirs))}); start it with --weights-dir-allowlist DIR"
            )

    async def _load(self, load, *args) -> None:
        try:
            await self.loop.call(load, *args)
        except (ValueError, EngineMemoryReleasedError, RankError) as error:
            raise RequestError(str(error)) from error

    @property
    def tp_size(self) -> int:
        return self.loop.engine.config.tp_size

    def _with_ranks(self, payload: dict) -> dict:
        """A successful update's reply, with every rank's weight version and checksum of what it loaded."""
        return {**payload, "ranks": self.loop.engine.rank_reports}

    def _on_other_ranks(self, target: str, *args):
        """A context that runs `target` on a sharded engine's other ranks beside the block (nullcontext at one)."""
        ranks = self.loop.engine.ranks
        return contextlib.nullcontext() if ranks is None else ranks.calling(target, *args)

    # ---- endpoints -------------------------------------------------------------------------------------------
    async def update_from_tensor(self, body) -> dict:
        body = require_fields(
            body,
            "/update_weights_from_tensor",
            {"serialized_named_tensors": list},
            {"load_format": (str, None), "flush_cache": (bool, True), "weight_version": (str, None)},
        )
        if body["load_format"] not in (None, "direct"):
            raise RequestError(
                f"/update_weights_from_tensor field 'load_format' must be null or 'direct' (tensors made by "
                f"slime.utils.weight_transport.serialize_named_tensors), got {body['load_format']!r}"
            )
        items = body["serialized_named_tensors"]
        if len(items) != self.tp_size or not all(isinstance(item, str) for item in items):
            raise RequestError(
                f"/update_weights_from_tensor field 'serialized_named_tensors' must be a list of {self.tp_size} "
                f"string(s), one per tensor-parallel rank (index = rank), got {len(items)} item(s)"
            )
        try:
            named_tensors = await asyncio.to_thread(weight_transport.deserialize_named_tensors, items[0])
        except ValueError as error:
            raise RequestError(f"/update_weights_from_tensor field 'serialized_named_tensors': {error}") from error
        self.check_names_and_shapes(
            [(name, tensor.shape) for name, tensor in named_tensors], "serialized_named_tensors"
        )
        await self._load(self.loop.engine.update_weights_from_tensors, named_tensors, body["weight_version"],
                         items if self.tp_size > 1 else None)
        del named_tensors  # drop our mapping of the sender's memory so its segments can be freed
        return self._with_ranks({"success": True, "message": "Succeeded to update model weights."})

    async def update_from_disk(self, body) -> dict:
        body = require_fields(
            body,
            "/update_weights_from_disk",
            {"model_path": str},
            {"load_format": (str, None), "weight_version": (str, None), "flush_cache": (bool, True)},
        )
        if body["load_format"] not in (None, "auto", "safetensors"):
            raise RequestError("/update_weights_from_disk field 'load_format' must be null, 'auto' or 'safetensors'")
        self.check_weight_dir(body["model_path"])
        engine = self.loop.engine
        try:
            await self.loop.call(engine.update_weights_from_disk, body["model_path"], body["weight_version"])
        except (ValueError, FileNotFoundError, RankError) as error:
            raise RequestError(f"/update_weights_from_disk field 'model_path': {error}") from error
        except EngineMemoryReleasedError as error:
            raise RequestError(str(error)) from error
        return self._with_ranks({"success": True, "message": "Succeeded to update model weights.",
                                 "num_paused_requests": 0})

    async def pull(self, body) -> dict:
        """POST /pull_weights {local_checkpoint_dir, source_dir, target_version} (slime's SGLang patch): bring the
        local checkpoint up to `target_version` of `source_dir`; the weights themselves do not change here."""
        body = require_fields(body, "/pull_weights", {"local_checkpoint_dir": str, "source_dir": str,
                                                      "target_version": int}, {})
        for field in ("local_checkpoint_dir", "source_dir"):
            self.check_weight_dir(body[field], f"/pull_weights field {field!r}")
        local, served = Path(body["local_checkpoint_dir"]).resolve(), Path(self.model_path).resolve()
        if local == served or local in served.parents:
            raise RequestError(f"/pull_weights field 'local_checkpoint_dir': {str(local)!r} holds the served "
                               "checkpoint, which a pull would overwrite; use a folder of its own")
        if body["target_version"] < 0:
            raise RequestError(f"/pull_weights field 'target_version' must be >= 0, got {body['target_version']}")
        try:
            await asyncio.to_thread(local_checkpoint.pull, body["local_checkpoint_dir"], self.model_path,
                                    body["source_dir"], body["target_version"])
        except (ValueError, OSError, local_checkpoint.ChecksumMismatchError) as error:
            return {"success": False, "message": f"{type(error).__name__}: {error}"}
        return {"success": True, "message": "Success."}

    async def init_group(self, body) -> dict:
        body = require_fields(
            body,
            "/init_weights_update_group",
            {"master_address": str, "master_port": int, "rank_offset": int, "world_size": int},
            {"group_name": (str, DEFAULT_GROUP_NAME), "backend": (str, "nccl")},
        )
        backend, name = body["backend"], body["group_name"]
        if backend not in ("gloo", "nccl"):
            raise RequestError(f"/init_weights_update_group field 'backend' must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and self.device.type != "cuda":
            raise RequestError("/init_weights_update_group field 'backend': nccl needs a CUDA engine; use gloo on CPU")
        if name in self.groups:
            raise RequestError(f"/init_weights_update_group field 'group_name': group {name!r} already exists")
        rank = body["rank_offset"]  # this engine's ranks join as rank_offset + tp_rank
        if not 0 < rank <= body["world_size"] - self.tp_size:
            raise RequestError(
                f"/init_weights_update_group: rank_offset {rank} must be in [1, world_size={body['world_size']} - "
                f"{self.tp_size}] (rank 0 is the trainer; this engine's {self.tp_size} rank(s) join as rank_offset + "
                "tp_rank)"
            )
        init_method = f"tcp://{body['master_address']}:{body['master_port']}"
        args = (backend, init_method, body["world_size"], rank, name, GROUP_TIMEOUT)

        def init_on_every_rank():
            with self._on_other_ranks("weights.init_group", *args):
                return weight_transport.init_custom_process_group(*args)

        try:
            group = await run_in_daemon_thread(init_on_every_rank)
        except ValueError as error:
            raise RequestError(f"/init_weights_update_group: {error}") from error
        except Exception as error:  # noqa: BLE001
            return {"success": False, "message": f"Failed to initialize custom process group: {error}"}
        self.groups[name] = group
        self._group_locks[name] = threading.Lock()
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    async def receive_broadcast(self, body: dict, route: str, keep_on_other_ranks: bool = True) -> list:
        """The tensors the trainer broadcasts over `body["group_name"]` ({names, dtypes, shapes}; `body` already
        parsed by require_fields), received on every rank of this engine (each joined the group at rank_offset +
        tp_rank): rank 0's are returned; the other ranks keep theirs until `weights.apply_stash` or, with
        `keep_on_other_ranks` False (a LoRA adapter, which rank 0 hands every rank itself), drop them."""
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        group_name = body["group_name"]
        if group_name not in self.groups:
            raise RequestError(f"{route} field 'group_name': no group {group_name!r}; POST /init_weights_update_group "
                               "first")
        if not len(names) == len(dtypes) == len(shapes):
            raise RequestError(f"{route}: 'names', 'dtypes' and 'shapes' must have the same length, got "
                               f"{len(names)}, {len(dtypes)}, {len(shapes)}")
        if not all(isinstance(n, str) for n in names):
            raise RequestError(f"{route} field 'names' must be a list of strings")
        if not all(isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes):
            raise RequestError(f"{route} field 'shapes' must be a list of lists of ints")
        try:
            torch_dtypes = [weight_transport.parse_dtype(d) for d in dtypes]
        except ValueError as error:
            raise RequestError(f"{route} field 'dtypes': {error}") from error
        group, lock = self.groups[group_name], self._group_locks[group_name]

        def receive():
            with lock:  # collectives on one group must run in the order the trainer issues them
                with self._on_other_ranks("weights.receive", group_name, names, torch_dtypes, shapes,
                                          keep_on_other_ranks):
                    return weight_transport.receive_named_tensors(group, names, torch_dtypes, shapes, self.device)

        return await run_in_daemon_thread(receive)

    async def update_from_distributed(self, body) -> dict:
        route = "/update_weights_from_distributed"
        body = require_fields(
            body,
            route,
            {"names": list, "dtypes": list, "shapes": list},
            {
                "group_name": (str, DEFAULT_GROUP_NAME),
                "flush_cache": (bool, True),
                "weight_version": (str, None),
                "load_format": (str, None),
            },
        )
        if body["load_format"] not in (None, "direct"):
            raise RequestError(f"{route} field 'load_format' must be null or 'direct'")
        # Receive every tensor even if a name is wrong: skipping would leave the trainer's broadcast hanging.
        named_tensors = await self.receive_broadcast(body, route)
        self.check_names_and_shapes([(n, s) for n, s in zip(body["names"], body["shapes"])], "names/shapes")
        await self._load(self.loop.engine.apply_received_weights, named_tensors, body["weight_version"])
        return self._with_ranks({"success": True, "message": "Succeeded to update parameter online."})

    async def destroy_group(self, body) -> dict:
        body = require_fields(body, "/destroy_weights_update_group", {}, {"group_name": (str, DEFAULT_GROUP_NAME)})
        name = body["group_name"]
        group = self.groups.pop(name, None)
        if group is None:
            raise RequestError(f"/destroy_weights_update_group field 'group_name': no group {name!r}")
        self._group_locks.pop(name, None)
        def destroy_on_every_rank():
            with self._on_other_ranks("weights.destroy_group", name):
                weight_transport.destroy_custom_process_group(group)

        await asyncio.to_thread(destroy_on_every_rank)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

