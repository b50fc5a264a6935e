"""Push the trainer's weights into running engines (SGLang-compatible HTTP API).

Backend-neutral: the backend yields (HF name, full tensor) pairs (every rank takes part in its gathers: FSDP's
`DTensor.full_tensor()`, Megatron's tensor / pipeline / expert parallel gathers); rank 0 groups them into buckets
of about --update-weight-buffer-size bytes and sends each bucket to every engine:
- "tensor" mode (same host): POST /update_weights_from_tensor with the bucket packed into one buffer and serialized
  by handle (one shared-memory segment on CPU, one CUDA IPC handle on GPU). Pipelined: bucket k's POST is in flight
  while bucket k+1 is gathered and packed; k+1 is sent once k is answered (the engine has copied it), so buckets
  arrive in order, the last one last, and each stays alive until its engine is done with it;
- "distributed" mode: a one-time process group with the engines (POST /init_weights_update_group), then per bucket
  POST /update_weights_from_distributed {names, dtypes, shapes} while rank 0 broadcasts the tensors.
  Every bucket but the last sends flush_cache false; the last sends flush_cache true and the weight version.
- "disk" mode (--update-weight-transport disk): rank 0 writes the buckets as version folder `weight_v{N:06d}` (full or
  delta: slime.backends.weight_disk), runs --custom-update-weight-post-write-path, then with
  --update-weight-local-checkpoint-dir has each engine bring its local checkpoint up to it (POST /pull_weights; when
  an engine cannot apply a delta, e.g. a checksum mismatch, the version is written again as a full one and pulled
  again), and each engine loads it (POST /update_weights_from_disk {model_path, weight_version}). The folder is
  removed afterwards unless --update-weight-disk-keep-files.
In tensor and disk mode an engine that cannot be reached (its process died) is skipped for the rest of the push and
named in the result (`unreachable_engines`); the engine watch restarts it (docs/guides/fault-tolerance.md).

Tensors travel in the engines' dtype when every engine reports the same one in GET /get_server_info (bf16 engines
get half the bytes of the fp32 master weights, rounded as the engine would round them itself); otherwise in the
trainer's.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from slime.backends.weight_disk import DiskSync
from slime.backends.weight_push_result import WeightPushResult
from slime.utils.blocking_http import blocking_client
from slime.utils.weight_delta import parse_version
from slime.utils.weight_transport import (
    broadcast_named_tensors,
    init_custom_process_group,
    pack_named_tensors,
    serialize_named_tensors,
)

logger = logging.getLogger(__name__)

UPDATE_MODES = ("tensor", "distributed", "disk")
HTTP_TIMEOUT_S = 600.0
WEIGHT_GROUP_NAME = "slime_weight_update"


# SGLang's DeepSeek loader fuses q_a_proj and kv_a_proj_with_mqa into one matrix only when both arrive in one
# load_weights call (one bucket): the first opens a bucket boundary that only the second closes.
PAIRED_IN_ONE_BUCKET = (("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),)


def _bucket_partner(name: str) -> str | None:
    """The name that must travel in the same bucket as `name`, when `name` opens such a pair."""
    for first, second in PAIRED_IN_ONE_BUCKET:
        if name.endswith("." + first):
            return name[: -len(first)] + second
    return None


def iter_buckets(named_tensors, bucket_bytes: int) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """Group (name, tensor) pairs into lists of at most `bucket_bytes` (a larger tensor goes alone; a pair of
    PAIRED_IN_ONE_BUCKET and what lies between them share one bucket); yields (bucket, is_last)."""
    bucket, size, pending, waiting_for = [], 0, None, None
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes and waiting_for is None:
            if pending is not None:
                yield pending, False
            pending, bucket, size = bucket, [], 0
        bucket.append((name, tensor))
        size += nbytes
        waiting_for = None if name == waiting_for else (waiting_for or _bucket_partner(name))
    if pending is not None:
        yield pending, not bucket
    if bucket:
        yield bucket, True


def _post(url: str, path: str, payload: dict, headers: dict | None = None) -> dict:
    response = blocking_client().post(url.rstrip("/") + path, json=payload, headers=headers, timeout=HTTP_TIMEOUT_S)
    if response.status_code != 200:
        raise RuntimeError(f"POST {url}{path} failed with {response.status_code}: {response.text[:500]}")
    return response.json() if response.content else {}


def engines_dtype(urls: list[str], headers: dict | None = None) -> torch.dtype | None:
    """The floating dtype every engine reports in /get_server_info ("dtype"), or None when they differ, one does
    not say, or says "auto" (real SGLang reports its --dtype flag)."""
    import httpx

    names = set()
    for url in urls:
        try:
            response = blocking_client().get(url.rstrip("/") + "/get_server_info", headers=headers,
                                             timeout=HTTP_TIMEOUT_S)
        except httpx.TransportError:
            continue  # a lost engine has no say (and the push skips it)
        names.add(response.json().get("dtype") if response.status_code == 200 else None)
    (name,) = names if len(names) == 1 else (None,)
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def _post_all(urls: list[str], path: str, payload_for_url, headers: dict | None = None) -> list:
    with ThreadPoolExecutor(max_workers=max(1, len(urls))) as pool:
        return list(pool.map(lambda url: _post(url, path, payload_for_url(url), headers), urls))


def _post_each_reachable(urls: list[str], path: str, payload_for_url, headers: dict | None = None) -> list[str]:
    """Like _post_all, but an engine that cannot be reached (its process is gone) is skipped, not an error: the
    others still get the whole push, and the engine watch restarts the lost one (docs/guides/fault-tolerance.md).
    Returns the URLs that could not be reached."""
    import httpx

    def post(url: str) -> str | None:
        try:
            _post(url, path, payload_for_url(url), headers)
        except httpx.TransportError:
            return url
        return None

    with ThreadPoolExecutor(max_workers=max(1, len(urls))) as pool:
        return [url for url in pool.map(post, urls) if url is not None]


class _OneInFlight:
    """Runs calls one at a time in a background thread, in the order submitted: `submit` first waits for the call in
    flight (raising its error), so the caller prepares the next call while the last one runs."""

    def __init__(self, pool: ThreadPoolExecutor):
        self.pool = pool
        self.pending = None

    def submit(self, call, *args) -> None:
        self.wait()
        self.pending = self.pool.submit(call, *args)

    def wait(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()


class WeightSender:
    """The trainer side of a weight update (the engine side is `slime.engine.server.weights.EngineWeightReceiver`):
    sends the tensors `named_tensors(dtype)` yields to the connected engines; every rank calls `update`, rank 0
    talks HTTP with `headers` (the engines' admin key). `on_gpu`: where the weights live (the broadcast group's
    backend follows it). `disk_sync`: the settings of "disk" mode (None: that mode is not available)."""

    def __init__(self, named_tensors: Callable[[torch.dtype | None], Iterator[tuple[str, torch.Tensor]]],
                 on_gpu: bool, rank: int, bucket_bytes: int, dtype: torch.dtype | None,
                 master_address: str = "127.0.0.1", headers: dict | None = None, disk_sync: DiskSync | None = None):
        self.named_tensors, self.on_gpu, self.disk_sync = named_tensors, on_gpu, disk_sync
        self.rank, self.bucket_bytes, self.dtype = rank, bucket_bytes, dtype
        self.headers = dict(headers or {})
        self.engines_dtype: torch.dtype | None = None  # what the connected engines report; None: unknown
        self.master_address = master_address
        self.engine_urls: list[str] = []
        self.unreachable_urls: list[str] = []  # of the current push (tensor and disk mode)
        self.mode = "tensor"
        self.group = None

    def connect(self, engine_urls: list[str], mode: str = "tensor", backend: str | None = None) -> None:
        if mode not in UPDATE_MODES:
            raise ValueError(f"unknown weight update mode {mode!r}; choose {', '.join(UPDATE_MODES)}")
        if mode == "disk" and self.disk_sync is None:
            raise ValueError("weight update mode 'disk' needs --update-weight-transport disk settings")
        if self.group is not None and self.rank == 0:
            import httpx

            for url in self.engine_urls:
                try:
                    _post(url, "/destroy_weights_update_group", {"group_name": WEIGHT_GROUP_NAME}, self.headers)
                except (RuntimeError, httpx.HTTPError):
                    pass  # an engine that failed (and was restarted elsewhere) has no group left to destroy
            dist.destroy_process_group(self.group)
            self.group = None
        self.engine_urls, self.mode = list(engine_urls), mode
        if self.disk_sync is not None:
            self.disk_sync.writer.reset()  # other engines: their local checkpoints start from a full version
        if self.rank == 0:
            self.engines_dtype = engines_dtype(self.engine_urls, self.headers)
        if mode == "distributed" and self.rank == 0:
            # The group's backend follows where the trainer's weights live, not whether the host has a GPU.
            self._init_group(backend or ("nccl" if self.on_gpu else "gloo"))

    def _init_group(self, backend: str) -> None:
        from slime.utils.misc import find_free_port

        port = find_free_port(self.master_address)
        world_size = 1 + len(self.engine_urls)
        with ThreadPoolExecutor(max_workers=1) as pool:
            requests = pool.submit(_post_all, self.engine_urls, "/init_weights_update_group", lambda url: {
                "master_address": self.master_address, "master_port": port,
                "rank_offset": 1 + self.engine_urls.index(url), "world_size": world_size,
                "group_name": WEIGHT_GROUP_NAME, "backend": backend,
            }, self.headers)
            self.group = init_custom_process_group(backend, f"tcp://{self.master_address}:{port}", world_size, 0,
                                                   WEIGHT_GROUP_NAME)
            requests.result()

    @property
    def push_dtype(self) -> torch.dtype | None:
        """The dtype tensors travel in: the one asked for, else the engines', else (None) the parameters' own."""
        return self.dtype or self.engines_dtype

    def update(self, weight_version) -> WeightPushResult:
        """Send every parameter (metrics: disk mode's perf/update_weights_density and perf/update_weights_wire_bytes,
        as slime logs)."""
        start = time.perf_counter()
        num_bytes, num_buckets = 0, 0
        self.unreachable_urls = []
        metrics = {}
        sending = self.rank == 0 and bool(self.engine_urls)
        version = parse_version(weight_version) if self.mode == "disk" else None  # on every rank: all stop, or none
        if sending and self.mode == "disk":
            self.disk_sync.writer.begin(version)
        params = self.named_tensors(self.push_dtype)
        # Leaving the pool's block waits for the POST in flight, even when gathering a bucket failed.
        with ThreadPoolExecutor(max_workers=1) as pool:
            in_flight = _OneInFlight(pool)
            for bucket, is_last in iter_buckets(params, self.bucket_bytes):
                num_buckets += 1
                num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
                if sending:
                    self._send(bucket, is_last, weight_version, in_flight)
            in_flight.wait()
        if sending and self.mode == "disk":
            self._load_from_disk(weight_version)
            stats = self.disk_sync.writer.stats
            metrics = {"perf/update_weights_density": stats["changed_bytes"] / max(stats["total_bytes"], 1),
                       "perf/update_weights_wire_bytes": stats["wire_bytes"]}
        if dist.is_initialized():
            dist.barrier()
        return WeightPushResult(seconds=time.perf_counter() - start, bytes=num_bytes, num_buckets=num_buckets,
                                unreachable_engines=list(self.unreachable_urls), metrics=metrics)

    def _load_from_disk(self, weight_version) -> None:
        """Publish the written version and have every reachable engine load it."""
        sync = self.disk_sync
        folder = self._publish(sync.writer.finish())
        model_path = str(folder)
        if sync.local_checkpoint_dir:
            failures = self._pull(folder)
            if failures and sync.writer.is_delta:
                why = "; ".join(f"{url}: {message}" for url, message in failures.items())
                logger.error("delta weight sync: engine(s) could not apply version %s (%s); falling back to a full "
                             "sync of that version", weight_version, why)
                folder = self._publish(sync.writer.rewrite_full())
                failures = self._pull(folder)
            if failures:
                raise RuntimeError("POST /pull_weights failed: " + "; ".join(f"{u}: {m}" for u, m in failures.items()))
            model_path = sync.local_checkpoint_dir
        reachable = [url for url in self.engine_urls if url not in self.unreachable_urls]
        self.unreachable_urls += _post_each_reachable(
            reachable, "/update_weights_from_disk",
            lambda url: {"model_path": model_path, "weight_version": str(weight_version), "flush_cache": True},
            self.headers)
        if not sync.keep_files:
            shutil.rmtree(folder, ignore_errors=True)

    def _post_tensor_bucket(self, urls: list[str], payloads: dict[str, dict], packed) -> None:
        """`packed` (the tensors behind the handles) is held here until every engine has answered: copied."""
        self.unreachable_urls += _post_each_reachable(urls, "/update_weights_from_tensor", payloads.__getitem__,
                                                      self.headers)

    def _publish(self, folder):
        if self.disk_sync.post_write is not None:
            self.disk_sync.post_write(str(folder), list(self.engine_urls))
        return folder

    def _pull(self, folder) -> dict[str, str]:
        """POST /pull_weights on every reachable engine; {url: why} of those that failed."""
        import httpx

        payload = {"local_checkpoint_dir": self.disk_sync.local_checkpoint_dir, "source_dir": str(folder.parent),
                   "target_version": self.disk_sync.writer.version}

        def pull(url: str) -> str | None:
            try:
                _post(url, "/pull_weights", payload, self.headers)
            except httpx.TransportError:
                self.unreachable_urls.append(url)
            except RuntimeError as error:
                return str(error)
            return None

        reachable = [url for url in self.engine_urls if url not in self.unreachable_urls]
        with ThreadPoolExecutor(max_workers=max(1, len(reachable))) as pool:
            return {url: why for url, why in zip(reachable, pool.map(pull, reachable)) if why is not None}

    def _send(self, bucket, is_last: bool, weight_version, in_flight: _OneInFlight) -> None:
        if self.mode == "disk":
            self.disk_sync.writer.add(bucket)
            return
        flush = {"flush_cache": is_last}
        if is_last and weight_version is not None:
            flush["weight_version"] = str(weight_version)
        if self.mode == "tensor":
            packed = pack_named_tensors(bucket)
            in_flight.wait()  # the engines are answered for the previous bucket: who is reachable is known
            reachable = [url for url in self.engine_urls if url not in self.unreachable_urls]
            # Serialized here, on the thread (and CUDA stream) that packed it; per engine: each serialized handle
            # must be opened exactly once.
            payloads = {url: {"serialized_named_tensors": [serialize_named_tensors(packed)], **flush}
                        for url in reachable}
            in_flight.submit(self._post_tensor_bucket, reachable, payloads, packed)
            return
        payload = {
            "names": [name for name, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": WEIGHT_GROUP_NAME, **flush,
        }
        with ThreadPoolExecutor(max_workers=1) as pool:
            requests = pool.submit(_post_all, self.engine_urls, "/update_weights_from_distributed", lambda url: payload,
                                   self.headers)
            broadcast_named_tensors(self.group, bucket, src=0)
            requests.result()

