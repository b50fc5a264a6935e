"""Push the trainer's LoRA adapter (only its tensors, never the base) into running engines, verified tensor by tensor.

Each push loads a new adapter version named `policy@<version>` (with several adapters, --lora-adapter-names, each
one on its own as `<name>@<version>`; an engine refuses a name already loaded) and, once
the engine answered with checksums that match, unloads every other `policy@*` version the engine reports holding but
the previous one (kept for the requests the rollout built before it learnt of the new name: `KEEP_VERSIONS`). The
engine's own list decides, so an engine restarted by fault tolerance (pushed the current version alone) and the
engines that kept running both end at the same two versions. An engine that cannot be reached is skipped and
reported (`unreachable_engines`), as the full-weight push does. Transports:
- "tensor" (same host; colocated or not): POST /load_lora_adapter_from_tensors with the PEFT-named tensors by handle
  (shared memory on the CPU, CUDA IPC on a GPU), one serialized list per engine rank, and the adapter's config;
- "distributed" (engines on GPUs of their own, the weight sender's "distributed" mode): rank 0 forms the same
  one-time broadcast group with every engine rank as the full-weight sender would (weight_sender.init_weight_group;
  in a LoRA run the adapter pusher is the only sender, so the group is its own: one per engine rank, never two), then
  per push POSTs /load_lora_adapter_from_distributed {lora_name, config, names, dtypes, shapes, weight_version} to
  every engine at once and broadcasts the adapter's tensors alone; every engine rank receives them, rank 0 loads;
- "disk" (--update-weight-transport disk: engines on other hosts, or wherever no broadcast group can be formed):
  rank 0 writes a PEFT folder under --update-weight-disk-dir and each engine loads it (POST /load_lora_adapter),
  then the folder is removed unless --update-weight-disk-keep-files.
Every load answers `checksums` (the float64 sum of each tensor as the engine holds it); a missing, extra or differing
tensor fails the push naming it. With --check-lora-weight-equal the tensors sent must also equal the trainer's
parameters exactly (a push in a lower-precision engine dtype fails, naming the first tensor it rounds).

Not the adapter's gathering (the backends' `adapter_weights`) nor the engine side (slime/engine/server/lora_routes.py).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
import torch.distributed as dist

from slime.backends.engine_ranks import as_engine_map
from slime.backends.engine_server_info import engines_dtype, server_infos
from slime.backends.lora_adapter import save_peft_folder, split_by_adapter, to_peft_name
from slime.backends.weight_push_result import WeightPushResult
from slime.backends.weight_sender import (
    WEIGHT_GROUP_NAME,
    _post,
    _post_all,
    destroy_weight_group,
    init_weight_group,
)
from slime.config.flags_lora import SERVED_ADAPTER_NAME, served_adapter_name
from slime.engine.lora.adapter import tensor_checksum
from slime.utils.weight_transport import broadcast_named_tensors, serialize_named_tensors

logger = logging.getLogger(__name__)
ADAPTER_MODES = ("tensor", "distributed", "disk")
KEEP_VERSIONS = 2
CHECKSUM_RTOL = 1e-9  # float64 sums of the same values in another order (an engine on another device)


class AdapterPushError(RuntimeError):
    """An engine does not hold the adapter the trainer sent (the message names the engine and the tensor)."""


def checksums(named: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each tensor's checksum as the engine computes it on what it receives (engine/lora/adapter.py)."""
    return {name: tensor_checksum(tensor) for name, tensor in named.items()}


def compare_checksums(url: str, adapter_name: str, expected: dict[str, float], got: dict | None) -> None:
    """Raise AdapterPushError naming the first tensor the engine lacks, holds in addition, or holds differently."""
    got = got or {}
    for name in sorted(expected.keys() | got.keys()):
        if name not in got:
            raise AdapterPushError(f"{url}: adapter {adapter_name}: the engine reports no checksum for {name}")
        if name not in expected:
            raise AdapterPushError(f"{url}: adapter {adapter_name}: the engine holds {name}, which was not sent")
        want, have = expected[name], float(got[name])
        if abs(want - have) > CHECKSUM_RTOL * max(1.0, abs(want)):
            raise AdapterPushError(f"{url}: adapter {adapter_name}: tensor {name} has checksum {have!r} in the "
                                   f"engine, {want!r} in the trainer")


class AdapterPusher:
    def __init__(self, adapter_weights: Callable[[], dict[str, torch.Tensor]],
                 config_of: Callable[[dict[str, torch.Tensor]], dict], rank: int, *,
                 headers: dict | None = None, disk_dir: str | None = None,
                 keep_files: bool = False, check_weight_equal: bool = False, adapter_names: list[str] | None = None,
                 on_gpu: bool = False, master_address: str = "127.0.0.1"):
        """`adapter_names` (--lora-adapter-names): the trainer holds several adapters (PEFT's in-memory names
        `...lora_A.<name>.weight`), each pushed as `<name>@<version>`; None: one, pushed as `policy@<version>`.
        `on_gpu` / `master_address`: the "distributed" transport's group (nccl on a GPU, else gloo) and rendezvous."""
        self.adapter_weights, self.config_of, self.rank = adapter_weights, config_of, rank
        self.adapter_names = list(adapter_names) if adapter_names else None
        self.headers = dict(headers or {})
        self.disk_dir, self.keep_files, self.check_weight_equal = disk_dir, keep_files, check_weight_equal
        self.engines: dict[int, str] = {}  # engine index -> URL
        self.mode = self.transport = "tensor"
        self.engines_dtype: torch.dtype | None = None
        self.pushed: dict[str, list[str]] = {}  # per adapter, its versions pushed, oldest first (across reconnections)
        self.on_gpu, self.master_address = on_gpu, master_address
        self.group = None  # rank 0's broadcast group with every engine rank ("distributed")

    @property
    def engine_urls(self) -> list[str]:
        return list(self.engines.values())

    def connect(self, engine_urls: list[str] | dict[int, str], mode: str = "tensor",
                backend: str | None = None) -> None:
        """`mode`: the weight sender's. "distributed": the broadcast group is formed here (`backend`: gloo or nccl;
        None: nccl when the adapter lives on a GPU), after the previous connection's is destroyed."""
        transport = mode
        if transport not in ADAPTER_MODES:
            raise ValueError(f"unknown adapter push mode {mode!r}; choose {', '.join(ADAPTER_MODES)}")
        if transport == "disk" and not self.disk_dir:
            raise ValueError("LoRA adapters reach engines on other devices or hosts through a PEFT folder: pass "
                             "--update-weight-disk-dir (a folder trainer and engines share)")
        if self.group is not None and self.rank == 0:
            destroy_weight_group(self.group, self.engine_urls, self.headers)
            self.group = None
        self.engines, self.mode, self.transport = as_engine_map(engine_urls), mode, transport
        if self.rank == 0:
            logger.info("LoRA adapter pushes to %d engine(s): transport %r", len(self.engines), transport)
            infos = server_infos(self.engine_urls, self.headers)
            self.engines_dtype = engines_dtype(self.engine_urls, self.headers, infos)
            if transport == "distributed":
                engine_ranks = {engine: int((infos.get(url) or {}).get("tp_size") or 1)
                                for engine, url in self.engines.items()}
                self.group = init_weight_group(self.engines, engine_ranks, self.master_address,
                                               backend or ("nccl" if self.on_gpu else "gloo"), self.headers)

    def update(self, weight_version) -> WeightPushResult:
        """Collective (the adapter is gathered on every rank); rank 0 sends. Returns what the push moved."""
        start = time.perf_counter()
        adapter = self.adapter_weights()
        num_bytes, unreachable = 0, set()
        if self.rank == 0 and self.engine_urls:
            parts = (split_by_adapter(adapter, self.adapter_names) if self.adapter_names
                     else {SERVED_ADAPTER_NAME: adapter})
            for adapter_name, part in parts.items():
                sent = self._to_send(part)
                num_bytes += sum(t.numel() * t.element_size() for t in sent.values())
                unreachable.update(self._load_everywhere(adapter_name, sent, str(weight_version), self.config_of(part)))
        if dist.is_initialized():
            dist.barrier()
        # Which route the push took shows in the run's metrics: the bytes broadcast over the weight-update group.
        metrics = {"perf/lora_push_broadcast_gb": num_bytes / 1e9} if self.transport == "distributed" else {}
        return WeightPushResult(seconds=time.perf_counter() - start, bytes=num_bytes,
                                num_buckets=len(self.adapter_names or [None]), unreachable_engines=sorted(unreachable),
                                metrics=metrics)

    def _to_send(self, adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """PEFT-named tensors in the engines' dtype (checked to be exact with --check-lora-weight-equal)."""
        dtype = self.engines_dtype or next(iter(adapter.values())).dtype
        sent = {to_peft_name(name): tensor.to(dtype).contiguous() for name, tensor in adapter.items()}
        if self.check_weight_equal:
            for name, tensor in adapter.items():
                if not torch.equal(sent[to_peft_name(name)].to(tensor.dtype), tensor):
                    raise AdapterPushError(f"--check-lora-weight-equal: {to_peft_name(name)} changes when sent in "
                                           f"the engines' dtype {dtype} (the trainer's is {tensor.dtype})")
        return sent

    def _load_everywhere(self, trained_name: str, sent: dict[str, torch.Tensor], weight_version: str,
                         config: dict) -> list[str]:
        """Load `trained_name`'s version into every engine, verify, unload its stale versions; returns the engines
        that could not be reached (the others got the whole push; the engine watch restarts the lost one, which gets
        the version then)."""
        expected = checksums(sent)
        adapter_name = served_adapter_name(weight_version, trained_name)
        pushed = [name for name in self.pushed.get(trained_name, []) if name != adapter_name] + [adapter_name]
        self.pushed[trained_name] = pushed[-KEEP_VERSIONS:]
        keep = set(self.pushed[trained_name])
        folder, unreachable = None, []
        if self.transport == "distributed":
            replies = self._broadcast(adapter_name, sent, weight_version, config)
        elif self.transport == "disk":
            folder = save_peft_folder(Path(self.disk_dir) / f"lora_{adapter_name}", config,
                                      {name.removeprefix("base_model.model."): t for name, t in sent.items()})
        try:
            for url in self.engine_urls:
                try:
                    reply = (replies[url] if self.transport == "distributed"
                             else self._load_one(url, adapter_name, sent, weight_version, config, folder))
                    compare_checksums(url, adapter_name, expected, reply.get("checksums"))
                    # What the engine itself says it holds: a version it got before a reconnection (another
                    # engine's restart) or that a failed unload left behind is found and unloaded too.
                    for stale in sorted(set(reply.get("loaded_adapters") or {}) - keep):
                        if stale.startswith(served_adapter_name("", trained_name)):
                            _post(url, "/unload_lora_adapter", {"lora_name": stale}, self.headers)
                except httpx.TransportError:
                    unreachable.append(url)
        finally:
            if folder is not None and not self.keep_files:
                shutil.rmtree(folder, ignore_errors=True)
        return unreachable

    def _broadcast(self, adapter_name: str, sent: dict[str, torch.Tensor], weight_version: str,
                   config: dict) -> dict[str, dict]:
        """Every engine is asked at once (each of its ranks then waits in the broadcast) while rank 0 broadcasts the
        adapter's tensors: {url: its reply}. An engine that cannot be reached fails the push here, as the
        full-weight "distributed" push does: the group it belongs to cannot complete a broadcast without it."""
        payload = {"lora_name": adapter_name, "config": config, "weight_version": weight_version,
                   "group_name": WEIGHT_GROUP_NAME, "names": list(sent),
                   "dtypes": [str(t.dtype).removeprefix("torch.") for t in sent.values()],
                   "shapes": [list(t.shape) for t in sent.values()]}
        device = torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else torch.device("cpu")
        with ThreadPoolExecutor(max_workers=1) as pool:
            requests = pool.submit(_post_all, self.engine_urls, "/load_lora_adapter_from_distributed",
                                   lambda url: payload, self.headers)
            broadcast_named_tensors(self.group, [(name, t.to(device)) for name, t in sent.items()], src=0)
            return dict(zip(self.engine_urls, requests.result()))

    def _load_one(self, url: str, adapter_name: str, sent: dict[str, torch.Tensor], weight_version: str,
                  config: dict, folder: Path | None) -> dict:
        if folder is not None:
            return _post(url, "/load_lora_adapter", {"lora_name": adapter_name, "lora_path": str(folder)}, self.headers)
        return _post(url, "/load_lora_adapter_from_tensors", {
            "lora_name": adapter_name, "config": config, "weight_version": weight_version,
            "serialized_named_tensors": [serialize_named_tensors(list(sent.items()))]}, self.headers)
