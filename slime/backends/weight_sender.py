"""Push the trainer's weights into running engines (SGLang-compatible HTTP API).

Backend-neutral: the backend yields (HF name, full tensor) pairs (every rank takes part in its gathers: FSDP's
`DTensor.full_tensor()`, Megatron's tensor / pipeline / expert parallel gathers); rank 0 groups them into buckets
of about --update-weight-buffer-size bytes and sends each bucket to every engine. An engine may span N ranks
(--rollout-num-gpus-per-engine; slime/backends/engine_ranks.py has the arithmetic): every rank gets the full tensors
and keeps its own shard.
- "tensor" mode (same host): POST /update_weights_from_tensor with `serialized_named_tensors` a list of N entries,
  entry i for the engine's rank i, each the bucket packed into one buffer and serialized by handle (one
  shared-memory segment on CPU, one CUDA IPC handle on GPU). Colocated, with a backend whose every rank holds the
  full tensors (FSDP), trainer rank r builds engine r // N's entry r % N on its own device and the engine's N
  trainer ranks gather their entries (gloo) to the first of them, which POSTs (slime's layout); every other engine
  gets N handles of rank 0's buffer. Pipelined: bucket k's POST is in flight while bucket k+1 is gathered and
  packed; k+1 is sent once k is answered (the engine has copied it), so buckets arrive in order, the last one last,
  and each stays alive until its engine is done with it;
- "distributed" mode: a one-time process group of rank 0 and every engine rank (POST /init_weights_update_group,
  engine i's ranks at offset 1 + the ranks of the engines before it), then per bucket
  POST /update_weights_from_distributed {names, dtypes, shapes} while rank 0 broadcasts the tensors. The group's
  setup (`init_weight_group`, `destroy_weight_group`) is shared with the LoRA adapter pusher (lora_push.py).
  Every bucket but the last sends flush_cache false; the last sends flush_cache true and the weight version.
- "disk" mode (--update-weight-transport disk): rank 0 writes the buckets as version folder `weight_v{N:06d}` (full or
  delta: slime.backends.weight_disk), runs --custom-update-weight-post-write-path, then with
  --update-weight-local-checkpoint-dir has each engine bring its local checkpoint up to it (POST /pull_weights; when
  an engine cannot apply a delta, e.g. a checksum mismatch, the version is written again as a full one and pulled
  again), and each engine loads it (POST /update_weights_from_disk {model_path, weight_version}). The folder is
  removed afterwards unless --update-weight-disk-keep-files.
In tensor and disk mode an engine that cannot be reached (its process died) is skipped for the rest of the push and
named in the result (`unreachable_engines`); the engine watch restarts it (docs/guides/fault-tolerance.md). Every
weight-update answer's per-rank reports ("ranks") are checked: a rank missing, or at another weight version after
the push, is an error naming the engine's URL and the rank (raised once every trainer rank is done).

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

from slime.backends.colocated_feeders import ColocatedFeeders
from slime.backends.engine_ranks import (
    EngineRankError,
    as_engine_map,
    broadcast_layout,
    check_rank_reports,
)
from slime.backends.engine_server_info import engines_dtype, server_infos
from slime.backends.push_pipeline import OneInFlight, iter_buckets
from slime.backends.weight_disk import DiskSync, disk_sync_from_args
from slime.backends.weight_push_result import WeightPushResult
from slime.utils.blocking_http import blocking_client
from slime.utils.engine_access import engine_admin_headers
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


def _post(url: str, path: str, payload: dict, headers: dict | None = None) -> dict:
    response = blocking_client().post(url.rstrip("/") + path, json=payload, headers=headers, timeout=HTTP_TIMEOUT_S)
    if response.status_code != 200:
        raise RuntimeError(f"POST {url}{path} failed with {response.status_code}: {response.text[:500]}")
    return response.json() if response.content else {}


def _post_all(urls: list[str], path: str, payload_for_url, headers: dict | None = None) -> list:
    with ThreadPoolExecutor(max_workers=max(1, len(urls))) as pool:
        return list(pool.map(lambda url: _post(url, path, payload_for_url(url), headers), urls))


def _post_each_reachable(urls: list[str], path: str, payload_for_url,
                         headers: dict | None = None) -> tuple[list[str], dict[str, dict]]:
    """Like _post_all, but an engine that cannot be reached (its process is gone) is skipped, not an error: the
    others still get the whole push, and the engine watch restarts the lost one (docs/guides/fault-tolerance.md).
    Returns (the URLs that could not be reached, {url: answer} of the others)."""
    import httpx

    def post(url: str) -> dict | None:
        try:
            return _post(url, path, payload_for_url(url), headers)
        except httpx.TransportError:
            return None

    with ThreadPoolExecutor(max_workers=max(1, len(urls))) as pool:
        answers = dict(zip(urls, pool.map(post, urls)))
    return [url for url, answer in answers.items() if answer is None], {
        url: answer for url, answer in answers.items() if answer is not None}


def init_weight_group(engines: dict[int, str], engine_ranks: dict[int, int], master_address: str, backend: str,
                      headers: dict | None = None):
    """The trainer's rank 0 (rank 0 of the group) and every rank of every engine (engine i's ranks at offset 1 + the
    ranks of the engines before it) in one broadcast group named WEIGHT_GROUP_NAME; returns rank 0's group. Used by
    the full-weight sender and the LoRA adapter pusher (slime/backends/lora_push.py) alike."""
    from slime.utils.misc import find_free_port

    port = find_free_port(master_address)
    world_size, offsets = broadcast_layout(engine_ranks)
    urls = list(engines.values())
    index = {url: engine for engine, url in engines.items()}
    with ThreadPoolExecutor(max_workers=1) as pool:
        requests = pool.submit(_post_all, urls, "/init_weights_update_group", lambda url: {
            "master_address": master_address, "master_port": port,
            "rank_offset": offsets[index[url]], "world_size": world_size,
            "group_name": WEIGHT_GROUP_NAME, "backend": backend,
        }, headers)
        group = init_custom_process_group(backend, f"tcp://{master_address}:{port}", world_size, 0, WEIGHT_GROUP_NAME)
        requests.result()
    return group


def destroy_weight_group(group, engine_urls: list[str], headers: dict | None = None) -> None:
    """Undo `init_weight_group`: every engine that still answers leaves the group, then rank 0 does."""
    import httpx

    for url in engine_urls:
        try:
            _post(url, "/destroy_weights_update_group", {"group_name": WEIGHT_GROUP_NAME}, headers)
        except (RuntimeError, httpx.HTTPError):
            pass  # an engine that failed (and was restarted elsewhere) has no group left to destroy
    dist.destroy_process_group(group)


class WeightSender:
    """The trainer side of a weight update (the engine side is `slime.engine.server.weights.EngineWeightReceiver`):
    sends the tensors `named_tensors(dtype)` yields to the connected engines; every rank calls `update`, rank 0
    talks HTTP with `headers` (the engines' admin key), and so do, colocated, the first trainer rank of each engine's
    group. `on_gpu`: where the weights live (the broadcast group's backend follows it). `disk_sync`: the settings of
    "disk" mode (None: that mode is not available). `ranks_per_engine`: the engines' ranks (None: each engine's
    `tp_size` in GET /get_server_info). `colocated`: trainer rank r shares its device with rank r % N of engine r // N
    and holds the full tensors (ColocatedFeeders). `expect_rank_reports`: every weight-update answer must carry the
    per-rank reports (the built-in engine's "ranks"; SGLang's answers have none)."""

    def __init__(self, named_tensors: Callable[[torch.dtype | None], Iterator[tuple[str, torch.Tensor]]],
                 on_gpu: bool, rank: int, bucket_bytes: int, dtype: torch.dtype | None,
                 master_address: str = "127.0.0.1", headers: dict | None = None, disk_sync: DiskSync | None = None,
                 ranks_per_engine: int | None = None, colocated: bool = False, expect_rank_reports: bool = False):
        self.named_tensors, self.on_gpu, self.disk_sync = named_tensors, on_gpu, disk_sync
        self.rank, self.bucket_bytes, self.dtype = rank, bucket_bytes, dtype
        self.headers = dict(headers or {})
        self.engines_dtype: torch.dtype | None = None  # what the connected engines report; None: unknown
        self.master_address = master_address
        self.ranks_per_engine, self.expect_rank_reports = ranks_per_engine, expect_rank_reports
        self.colocated = colocated and ranks_per_engine is not None
        self.engines: dict[int, str] = {}  # engine index -> URL
        self.engine_ranks: dict[int, int] = {}  # engine index -> its number of ranks
        self.unreachable_urls: list[str] = []  # of the current push (tensor and disk mode)
        self.rank_errors: list[str] = []  # of the current push: engine ranks that did not report it
        self.feeders: ColocatedFeeders | None = None
        self.mode = "tensor"
        self.group = None

    @property
    def engine_urls(self) -> list[str]:
        return list(self.engines.values())

    def connect(self, engine_urls: list[str] | dict[int, str], mode: str = "tensor",
                backend: str | None = None) -> None:
        """Connect to `engine_urls` ({engine index: URL}; a list is engines 0, 1, ...): every rank calls it."""
        if mode not in UPDATE_MODES:
            raise ValueError(f"unknown weight update mode {mode!r}; choose {', '.join(UPDATE_MODES)}")
        if mode == "disk" and self.disk_sync is None:
            raise ValueError("weight update mode 'disk' needs --update-weight-transport disk settings")
        if self.group is not None and self.rank == 0:
            destroy_weight_group(self.group, self.engine_urls, self.headers)
            self.group = None
        self.engines, self.mode = as_engine_map(engine_urls), mode
        if self.disk_sync is not None:
            self.disk_sync.writer.reset()  # other engines: their local checkpoints start from a full version
        infos = server_infos(self.engine_urls, self.headers) if self.rank == 0 else {}
        if self.rank == 0:
            self.engines_dtype = engines_dtype(self.engine_urls, self.headers, infos)
        self.engine_ranks = {engine: self.ranks_per_engine or int((infos.get(url) or {}).get("tp_size") or 1)
                             for engine, url in self.engines.items()}
        if mode == "tensor" and self.colocated:
            world_size = dist.get_world_size() if dist.is_initialized() else 1
            if self.feeders is None:
                self.feeders = ColocatedFeeders(self.rank, world_size, self.ranks_per_engine)
            self.feeders.ensure_groups()
        if mode == "distributed" and self.rank == 0:
            # The group's backend follows where the trainer's weights live, not whether the host has a GPU.
            self.group = init_weight_group(self.engines, self.engine_ranks, self.master_address,
                                           backend or ("nccl" if self.on_gpu else "gloo"), self.headers)

    @property
    def push_dtype(self) -> torch.dtype | None:
        """The dtype tensors travel in: the one asked for, else the engines', else (None) the parameters' own."""
        return self.dtype or self.engines_dtype

    def update(self, weight_version) -> WeightPushResult:
        """Send every parameter (metrics: disk mode's perf/update_weights_density and perf/update_weights_wire_bytes,
        as slime logs)."""
        start = time.perf_counter()
        num_bytes, num_buckets = 0, 0
        self.unreachable_urls, self.rank_errors = [], []
        metrics = {}
        sending = (self.rank == 0 and bool(self.engines)) or self._own_engine() is not None
        version = parse_version(weight_version) if self.mode == "disk" else None  # on every rank: all stop, or none
        if sending and self.mode == "disk":
            self.disk_sync.writer.begin(version)
        params = self.named_tensors(self.push_dtype)
        # Leaving the pool's block waits for the POST in flight, even when gathering a bucket failed.
        with ThreadPoolExecutor(max_workers=1) as pool:
            in_flight = OneInFlight(pool)
            for bucket, is_last in iter_buckets(params, self.bucket_bytes):
                num_buckets += 1
                num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
                if sending:
                    self._send(bucket, is_last, weight_version, in_flight)
            in_flight.wait()
        if sending and self.mode == "disk":  # rank 0 alone
            self._load_from_disk(weight_version)
            stats = self.disk_sync.writer.stats
            metrics = {"perf/update_weights_density": stats["changed_bytes"] / max(stats["total_bytes"], 1),
                       "perf/update_weights_wire_bytes": stats["wire_bytes"]}
        if self.feeders is not None and self.mode == "tensor":
            self.unreachable_urls = self.feeders.merge_to_rank0(self.unreachable_urls)
        if dist.is_initialized():
            dist.barrier()
        if self.feeders is not None:
            self.feeders.held = None  # every POST is answered: the engines copied what they read from it
        if self.rank_errors:  # after the barrier: every rank is through the push, whichever rank raises
            raise EngineRankError("weight version %s did not reach every engine rank: %s"
                                  % (weight_version, "; ".join(self.rank_errors)))
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
        unreachable, answers = _post_each_reachable(
            reachable, "/update_weights_from_disk",
            lambda url: {"model_path": model_path, "weight_version": str(weight_version), "flush_cache": True},
            self.headers)
        self.unreachable_urls += unreachable
        self._check_answers(answers, str(weight_version))
        if not sync.keep_files:
            shutil.rmtree(folder, ignore_errors=True)

    def _post_tensor_bucket(self, urls: list[str], payloads: dict[str, dict], packed) -> None:
        """`packed` (the tensors behind the handles) is held here until every engine has answered: copied."""
        unreachable, answers = _post_each_reachable(urls, "/update_weights_from_tensor", payloads.__getitem__,
                                                    self.headers)
        self.unreachable_urls += unreachable
        self._check_answers(answers, next(iter(payloads.values()), {}).get("weight_version"))

    def _check_answers(self, answers: dict[str, dict], weight_version: str | None) -> None:
        """Record every engine rank that did not report this update (at `weight_version`, when it carried one)."""
        index = {url: engine for engine, url in self.engines.items()}
        for url, answer in answers.items():
            try:
                check_rank_reports(url, answer, self.engine_ranks[index[url]], weight_version,
                                   self.expect_rank_reports)
            except EngineRankError as error:
                if not any(message.startswith(f"engine {url}") for message in self.rank_errors):
                    self.rank_errors.append(str(error))  # an engine's first miss names it

    def _own_engine(self) -> int | None:
        """The engine this rank's colocated group feeds in the current push, if any (tensor mode)."""
        feeders = self.feeders
        if self.mode != "tensor" or feeders is None or feeders.engine not in self.engines:
            return None
        return feeders.engine

    def _rank0_engines(self) -> list[int]:
        """The engines rank 0 feeds from its own buffer: all but those of the colocated groups."""
        colocated = self.feeders.engines if self.mode == "tensor" and self.feeders is not None else set()
        return [engine for engine in self.engines if engine not in colocated] if self.rank == 0 else []

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

    def _send(self, bucket, is_last: bool, weight_version, in_flight: OneInFlight) -> None:
        if self.mode == "disk":
            self.disk_sync.writer.add(bucket)
            return
        flush = {"flush_cache": is_last}
        if is_last and weight_version is not None:
            flush["weight_version"] = str(weight_version)
        if self.mode == "tensor":
            self._send_tensors(bucket, flush, in_flight)
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
            answers = requests.result()
        self._check_answers(dict(zip(self.engine_urls, answers)), flush.get("weight_version"))

    def _send_tensors(self, bucket, flush: dict, in_flight: OneInFlight) -> None:
        """One bucket by handle: this rank's colocated engine gets its group's N entries (gathered to the group's
        first rank, which POSTs), rank 0's other engines N handles of rank 0's buffer each. Serialized here, on the
        thread (and CUDA stream) that packed it; each serialized handle is opened exactly once, by one engine rank."""
        own, others = self._own_engine(), self._rank0_engines()
        if own is None and not others:
            return  # rank 0 when only other groups' engines take this push
        packed = pack_named_tensors(bucket)
        own_entry = serialize_named_tensors(packed) if own is not None else None
        posts = others or (own is not None and self.feeders.is_first)
        if posts:
            # The engines are answered for the previous bucket: who is reachable is known, and (colocated) the
            # group's other ranks may free their previous buffers once this bucket's gather returns.
            in_flight.wait()
        entries = self.feeders.gather(own_entry) if own is not None else None
        if not posts:
            self.feeders.held = packed  # the first rank POSTs it; freed after the next gather (or the push's end)
            return
        payloads = {}
        for engine in others:
            url = self.engines[engine]
            if url not in self.unreachable_urls:
                handles = [serialize_named_tensors(packed) for _ in range(self.engine_ranks[engine])]
                payloads[url] = {"serialized_named_tensors": handles, **flush}
        if own is not None and self.engines[own] not in self.unreachable_urls:
            payloads[self.engines[own]] = {"serialized_named_tensors": entries, **flush}
        in_flight.submit(self._post_tensor_bucket, list(payloads), payloads, packed)


def weight_sender_from_args(args, backend, rank: int, master_address: str) -> WeightSender:
    """The WeightSender of trainer rank `rank` of a run: the built-in engines this run starts span
    --rollout-num-gpus-per-engine ranks and report each of them; colocated, a backend whose every rank holds the full
    tensors feeds them rank by rank."""
    ours = args.rollout_backend == "slime" and not args.rollout_external
    return WeightSender(backend.hf_weights, backend.device.type == "cuda", rank, args.update_weight_buffer_size,
                        dtype=None, master_address=master_address, headers=engine_admin_headers(args),
                        disk_sync=disk_sync_from_args(args),
                        ranks_per_engine=args.rollout_num_gpus_per_engine if ours else None,
                        colocated=ours and args.colocate and backend.hf_weights_on_every_rank,
                        expect_rank_reports=ours)
