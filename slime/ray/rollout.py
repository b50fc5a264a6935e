"""RolloutManager: the Ray actor that owns the data source, the engines, the sglang-router, the rollout and eval
functions, and turns each rollout's Samples into per-rank train data in the Ray object store.

What it is not: it never trains and never holds model weights; the trainer pushes weights to the engine URLs it
hands out. Engine and router failures are watched (and, under --use-fault-tolerance, recovered) by its
EngineSupervisor (engine_health.py); a rollout runs on a thread of its own, so a failure that ends the run ends it
at once instead of when the rollout's requests give up.
"""

from __future__ import annotations

import copy
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import ray

from slime.config.flags_lora import served_adapter_name, serves_adapter
from slime.ray.engine_actor import EngineActor
from slime.ray.engine_health import EngineSupervisor
from slime.ray.external_engines import connect_external_engines
from slime.ray.placement_group import ENGINE_ACTOR_FRACTION
from slime.ray.router import RouterProcess, list_workers, register_worker
from slime.ray.train_data import assign_rollout_ids, rollout_metrics, samples_to_train_data, split_train_data
from slime.rollout.base_types import call_rollout_fn
from slime.rollout.data_source import create_data_source
from slime.rollout.eval_metrics import eval_metrics
from slime.rollout.rm_hub.math_verify_pool import shutdown_pool as shutdown_reward_workers
from slime.utils.blocking_http import blocking_client
from slime.utils.daemon_threads import DaemonThreadPool
from slime.utils.debug_dump import BackgroundDumpWriter, dump_path, load_samples
from slime.utils.engine_access import engine_admin_headers, router_headers
from slime.utils.http_utils import run
from slime.utils.misc import load_function
from slime.utils.types import Sample


def _flatten(samples) -> list[Sample]:
    out = []
    for item in samples:
        out.extend(_flatten(item) if isinstance(item, (list, tuple)) else [item])
    return out



class RolloutManager:
    def __init__(self, args, placement):
        self.args = args
        self.data_source = create_data_source(args)
        self.generate_rollout = load_function(args.rollout_function_path, "--rollout-function-path")
        self.eval_rollout = load_function(args.eval_function_path or args.rollout_function_path,
                                          "--eval-function-path")
        self.state_before_rollout: dict[int, dict] = {}
        self.rollout_done = None  # (rollout id, samples, function metrics, seconds) from `rollout` to `train_data`
        self.router = None
        self.supervisor = None
        self.rollout_thread = DaemonThreadPool(max_workers=1, thread_name_prefix="slime-rollout-fn")
        self.debug_dump_writer = BackgroundDumpWriter()
        self.stream = None  # --fully-async: the GenerationStream (start_stream)
        if not args.debug_train_only:
            self._start_engines(placement)

    def _new_router(self) -> RouterProcess:
        args = self.args
        return RouterProcess(port=args.sglang_router_port, policy=args.router_policy, api_key=args.sglang_api_key,
                             log_path=str(Path(args.output_dir) / "router.log"), retries=not args.use_fault_tolerance,
                             request_timeout_secs=args.sglang_router_request_timeout_secs,
                             log_level=args.router_log_level, extra_flags=args.router_flags)

    def _start_engines(self, placement) -> None:
        args = self.args
        if args.use_external_router:
            router_url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}"
            try:
                list_workers(router_url, router_headers(args))
            except httpx.HTTPError as exc:
                raise RuntimeError(f"--sglang-router-ip/--sglang-router-port: no router answers at {router_url} "
                                   f"({exc}); start it or drop the flags to let slime start one") from None
        else:
            self.router = self._new_router()
            args.sglang_router_ip, args.sglang_router_port = self.router.host, self.router.port
            router_url = self.router.url
        engine_cls = ray.remote(EngineActor)

        per_engine = args.rollout_num_gpus_per_engine

        def new_actor(rank: int):
            """Engine `rank` on its N bundles (placement_group.py): the actor on the first, the server on all N."""
            first = placement.engine_positions(rank, per_engine)[0]
            return engine_cls.options(scheduling_strategy=placement.strategy(first),
                                      **placement.resources(ENGINE_ACTOR_FRACTION)).remote(
                args, rank, placement.engine_device_ids(rank, per_engine))

        if args.rollout_external:  # started outside the run: no actor owns them
            engine_urls = connect_external_engines(args)
            engines = [None] * len(engine_urls)
        else:
            engines = [new_actor(rank) for rank in range(args.rollout_num_engines)]
            engine_urls = ray.get([engine.start.remote() for engine in engines])
        for url in engine_urls:
            register_worker(router_url, url, api_key=args.sglang_api_key)
        self.supervisor = EngineSupervisor(args, engines, engine_urls, router_url, router=self.router,
                                           new_router=self._new_router, new_actor=new_actor)

    # ---- queries -------------------------------------------------------------------------------------------
    def get_engine_urls(self) -> dict[int, str]:
        """{engine index: URL} of every engine the trainer's weight push must reach (after any restart in progress
        has finished)."""
        return self.supervisor.urls_for_weight_push() if self.supervisor else {}

    def weights_pushed(self, weight_version: str, engine_urls: dict[int, str]) -> None:
        """The driver pushed `weight_version` to `engine_urls` (what `get_engine_urls()` answered). LoRA: from now on
        the rollout's requests ask for that version's adapter (`args.lora_path`, read by the /generate payloads)."""
        if serves_adapter(self.args) and self.args.lora_adapter_key:  # several adapters, each its own version
            self.args.lora_paths = {name: served_adapter_name(weight_version, name)
                                    for name in self.args.lora_adapter_names}
        elif serves_adapter(self.args):
            self.args.lora_path = served_adapter_name(weight_version)
        if self.supervisor:
            self.supervisor.weights_pushed(weight_version, engine_urls)

    def set_trainer(self, trainer) -> None:
        """The RayTrainGroup that gives an engine restarted during a rollout its weights."""
        if self.supervisor:
            self.supervisor.set_trainer(trainer)

    def get_router_address(self) -> tuple[str, int]:
        return self.args.sglang_router_ip, self.args.sglang_router_port

    def num_rollout(self) -> int:
        args = self.args
        if args.num_rollout is not None:
            return args.num_rollout
        if args.num_epoch is None:  # a replay without --num-rollout replays every saved rollout, from 0 on
            saved = (dump_path(args.load_debug_rollout_data, i) for i in itertools.count())
            return next(i for i, path in enumerate(saved) if not path.is_file())
        return args.num_epoch * len(self.data_source) // args.rollout_batch_size

    # ---- rollout -------------------------------------------------------------------------------------------
    def _watched(self, function, *function_args):
        """`function(*function_args)` on the rollout thread, while the supervisor watches the engines: an engine
        failure that ends the run raises here at once."""
        if self.supervisor is None:
            return function(*function_args)
        self.supervisor.check()
        if self.stream is not None:  # --fully-async: the stream's rollout never ends (an eval runs beside it)
            return self._watch(self.rollout_thread.submit(function, *function_args))
        self.supervisor.begin_rollout()
        try:
            return self._watch(self.rollout_thread.submit(function, *function_args))
        finally:
            self.supervisor.end_rollout()

    def _watch(self, future):
        while True:
            try:
                result = future.result(timeout=0.2)
                break
            except TimeoutError:
                self.supervisor.check()
        self.supervisor.poll_processes()  # an engine that failed as the rollout ended: nothing is trained on
        self.supervisor.check()
        return result

    def _rollout_samples(self, rollout_id: int) -> tuple[list[Sample], dict]:
        """The rollout's samples and the metrics its function returned with them."""
        args = self.args
        if args.load_debug_rollout_data:
            path = dump_path(args.load_debug_rollout_data, rollout_id)
            if not path.is_file():
                raise FileNotFoundError(f"--load-debug-rollout-data: {path} (rollout {rollout_id}) does not exist; "
                                        "save it with --save-debug-rollout-data, or lower --num-rollout")
            return load_samples(path, "--load-debug-rollout-data", args.load_debug_rollout_data_subsample), {}
        output = self._watched(lambda: call_rollout_fn(self.generate_rollout, args, rollout_id, self.data_source,
                                                       evaluation=False))
        result, function_metrics = output.samples, dict(output.metrics or {})
        samples = _flatten(result)
        samples.sort(key=lambda s: (s.index if s.index is not None else 0))
        return samples, function_metrics

    def generate(self, rollout_id: int) -> tuple[list, dict]:
        """Run one rollout; returns (one ObjectRef of train data per trainer rank, rollout metrics)."""
        self.rollout(rollout_id)
        return self.train_data(rollout_id)

    def rollout(self, rollout_id: int) -> None:
        """The first half of `generate`: the rollout's samples, kept for `train_data`. Returns once they are all
        back, so the colocated loop can start the memory hand-over (engine release, trainer onload) while this
        actor's `train_data` runs."""
        start = time.perf_counter()
        self.state_before_rollout = {rollout_id: copy.deepcopy(self.data_source.state_dict())}
        try:
            samples, function_metrics = self._rollout_samples(rollout_id)
        except BaseException:
            self.debug_dump_writer.flush()  # the last rollout's dump is on disk before this failure ends the run
            raise
        self.rollout_done = (rollout_id, samples, function_metrics, time.perf_counter() - start)

    def train_data(self, rollout_id: int) -> tuple[list, dict]:
        """The second half of `generate`: rollout `rollout_id`'s samples (the last `rollout` run) as train data, one
        ObjectRef per trainer rank, and the rollout's metrics."""
        if self.rollout_done is None or self.rollout_done[0] != rollout_id:
            raise RuntimeError(f"train_data({rollout_id}) without rollout({rollout_id}) before it")
        _, samples, function_metrics, rollout_time = self.rollout_done
        self.rollout_done = None
        start = time.perf_counter()
        if self.args.save_debug_rollout_data and not self.args.load_debug_rollout_data:  # written in the background
            self.debug_dump_writer.save(dump_path(self.args.save_debug_rollout_data, rollout_id), rollout_id, samples)
        assign_rollout_ids(samples)
        if self.args.rollout_data_postprocess_path:
            load_function(self.args.rollout_data_postprocess_path, "--rollout-data-postprocess-path")(self.args, samples)
        data = samples_to_train_data(self.args, samples)
        custom_log = self.args.custom_rollout_log_function_path
        skip_default = custom_log and load_function(custom_log, "--custom-rollout-log-function-path")(
            rollout_id, self.args, samples, function_metrics, rollout_time)
        metrics = {} if skip_default else rollout_metrics(self.args, samples, data["raw_reward"])
        metrics.update(function_metrics)
        metrics["perf/rollout_time"] = rollout_time
        num_tokens = sum(data["response_lengths"])
        metrics["perf/rollout_tokens_per_sec"] = num_tokens / max(rollout_time, 1e-9)
        if self.supervisor is not None:
            metrics.update(self.supervisor.pop_metrics())
            metrics["rollout/samples_resent"] = sum(bool(s.metadata.get("num_resends")) for s in samples)
        if self.args.debug_rollout_only:
            return [], metrics
        per_rank, num_dropped = split_train_data(self.args, data, rollout_id)
        metrics["rollout/dropped_for_even_split"] = num_dropped
        refs = [ray.put(d) for d in per_rank]
        # after the samples are back: train data, metrics, the debug dump's copy, the hand-off to the object store
        metrics["perf/rollout_postprocess_time"] = time.perf_counter() - start
        return refs, metrics

    def eval(self, rollout_id: int) -> dict:
        if not self.args.eval_datasets:
            return {}
        start = time.perf_counter()
        output = self._watched(lambda: call_rollout_fn(self.eval_rollout, self.args, rollout_id, self.data_source,
                                                       evaluation=True))
        results, metrics = output.data, dict(output.metrics or {})
        custom_log = self.args.custom_eval_rollout_log_function_path
        skip_default = custom_log and load_function(custom_log, "--custom-eval-rollout-log-function-path")(
            rollout_id, self.args, results, metrics)
        samples_per_prompt = {d.name: d.n_samples_per_eval_prompt or 1 for d in self.args.eval_datasets}
        for name, result in ({} if skip_default else results).items():
            metrics.update(eval_metrics(name, result.get("samples", []), result["rewards"],
                                        samples_per_prompt.get(name, self.args.n_samples_per_eval_prompt)))
        metrics["perf/eval_time"] = time.perf_counter() - start
        return metrics

    # ---- fully async (train_async.py --fully-async) ---------------------------------------------------------
    def start_stream(self, version: int, state: dict | None) -> None:
        """Start generating continuously under the engines' weights of `version` (restoring a checkpoint's
        `stream_state` when given)."""
        from slime.rollout.fully_async.stream import GenerationStream

        self.stream = GenerationStream(self.args, self.data_source, version)
        if state is not None:
            self.stream.load_state_dict(state)
        if self.supervisor is not None:
            self.supervisor.begin_rollout()  # always generating: a restarted engine gets the weights at once
        run(self.stream.start())

    def stream_batch(self, rollout_id: int) -> tuple[list, dict]:
        """The next batch from the stream as train data (what `generate` returns), once the ledger lets the trainer
        take one; engine failures that end the run raise here while it waits."""
        start = time.perf_counter()
        while True:
            if self.supervisor is not None:
                self.supervisor.check()
            batch = run(self.stream.next_batch(rollout_id, timeout=0.2))
            if batch is not None:
                break
        groups, metrics = batch
        if self.args.rollout_sample_filter_path:  # marks Sample.remove_sample on what not to train on
            load_function(self.args.rollout_sample_filter_path, "--rollout-sample-filter-path")(self.args, groups)
        samples = sorted(_flatten(groups), key=lambda s: (s.index if s.index is not None else 0))
        self.rollout_done = (rollout_id, samples, metrics, time.perf_counter() - start)
        return self.train_data(rollout_id)

    def pause_generation(self) -> None:
        """Before a weight push: the stream holds its groups and every engine stops between two steps, handing
        back its in-flight requests with the tokens sampled so far (they continue under the new weights)."""
        run(self.stream.pause())
        self._post_all("/pause_generation", {"mode": "abort"})

    def continue_generation(self, version: int) -> None:
        """After the push of `version` succeeded on every engine."""
        self._post_all("/continue_generation", {})
        run(self.stream.resume(version))

    def stream_state(self) -> dict:
        """The run state a checkpoint saves: the data source's, the stream's buffer, in-flight prompts and version."""
        stream_state, data_source_state = run(self.stream.snapshot())
        return {"data_source": data_source_state, "stream": stream_state}

    def stop_stream(self) -> int:
        """Stop generating; returns how many groups were generated or generating but never trained."""
        if self.stream is None:
            return 0
        run(self.stream.stop())
        if self.supervisor is not None:
            self.supervisor.end_rollout()
            self._post_all("/abort_request", {"abort_all": True})
        unused, self.stream = self.stream.unused_groups(), None
        return unused

    # ---- memory and state ----------------------------------------------------------------------------------
    def _post_all(self, path: str, payload: dict) -> None:
        """POST to every live engine at once (a release or resume of one engine does not wait for another's)."""
        urls = self.supervisor.live_urls() if self.supervisor else []
        headers = engine_admin_headers(self.args)

        def post(url: str) -> None:
            response = blocking_client().post(f"{url}{path}", json=payload, headers=headers, timeout=300.0)
            if response.status_code != 200:
                raise RuntimeError(f"{url}{path} failed: {response.status_code} {response.text}")

        with ThreadPoolExecutor(max_workers=max(1, len(urls))) as pool:
            list(pool.map(post, urls))

    def offload(self, discard_weights: bool = False) -> float:
        """Every engine releases its memory. `discard_weights`: the caller pushes every weight before the engines
        generate again (train.py's colocated loop: a full push follows each release), so they drop their weights
        instead of copying them to the host, and their resume of the weights is an allocation. Only the built-in
        engines started by this run take that field (SGLang's payload has none); they also keep their CUDA graphs'
        own memory (tens of MB of activations: no `cuda_graph` tag), so the graphs are not captured again: their
        weights and KV cache come back at the same addresses (engine/device_arena.py). Returns its seconds."""
        start = time.perf_counter()
        ours = self.args.rollout_backend == "slime" and not self.args.rollout_external
        tags = ["weights", "kv_cache"] + ([] if ours else ["cuda_graph"])
        if self.supervisor:
            self.supervisor.memory_released(tags)  # first: no heartbeat reaches an engine in the middle
        discard = {"discard_weights": True} if discard_weights and ours else {}
        self._post_all("/release_memory_occupation", {"tags": tags, **discard})
        return time.perf_counter() - start

    def onload(self, tags: list[str]) -> None:
        self._post_all("/resume_memory_occupation", {"tags": tags})
        if self.supervisor:
            self.supervisor.memory_resumed(tags)

    def flush_debug_dump(self) -> None:
        """Wait for the --save-debug-rollout-data write in flight (raises its error)."""
        self.debug_dump_writer.flush()

    def data_source_state(self, next_rollout_id: int) -> dict:
        """The state from which a resumed run regenerates exactly the data of `next_rollout_id` onwards (the
        async driver may already have drawn that rollout's prompts)."""
        return self.state_before_rollout.get(next_rollout_id) or self.data_source.state_dict()

    def load_data_source_state(self, state: dict) -> None:
        self.data_source.load_state_dict(state)

    def dispose(self) -> None:
        try:
            self.stop_stream()
            self.debug_dump_writer.flush()
        finally:
            shutdown_reward_workers()
            if self.supervisor is not None:
                self.supervisor.shutdown()
                ray.get([slot.actor.shutdown.remote() for slot in self.supervisor.slots
                         if slot.actor is not None and not slot.actor_dead])
            router = self.supervisor.router if self.supervisor is not None else self.router
            if router is not None:
                router.shutdown()
