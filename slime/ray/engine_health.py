"""EngineSupervisor: watches the rollout engines and the router from inside the RolloutManager, and under
`--use-fault-tolerance` recovers them.

- Process watch (always, every 0.5 s): an engine whose server process is gone, or the router slime started, is a
  failure at once. Without `--use-fault-tolerance` a failure ends the run (`check()` raises an error naming the
  engine, how it ended and its log file).
- Heartbeats (`--use-fault-tolerance`): every `--rollout-health-check-interval` s each serving engine must answer
  GET /health_generate within `--rollout-health-check-timeout` s; paused while the engines' memory is released
  (offloaded), resumed `--rollout-health-check-first-wait` s after they get it back. A miss is a hang.
- Recovery (`--use-fault-tolerance`): the failed engine leaves the router at once and is SIGKILLed, so its requests
  fail and the rollout re-sends them (slime/rollout/resend.py) to the engines left; then it restarts (new process,
  new port), releases the memory the others have released, gets the trainer's current weights (a full push with
  the current weight version) and only then joins the router. During a rollout the push happens at once; between
  rollouts the driver's next weight push includes it. `--max-engine-restarts` bounds the restarts of a run. A dead
  router is restarted on the same port and given the serving engines again.

External engines (--rollout-external-engine-addrs; slot.actor is None): no process to watch, so the process watch
asks each for GET /health instead; a failed one always ends the run (the run did not start it and does not restart
it), and the run never kills one.

What it is not: it does not generate, and it never decides which sample goes where (the router does).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import ray

from slime.ray.engine_failures import (
    EngineFailureError,
    describe_exit,
    describe_hang,
    engine_died_error,
    external_engine_error,
    restart_budget_error,
    router_died_error,
)
from slime.ray.external_engines import health_problem
from slime.ray.router import RouterError, deregister_worker, register_worker
from slime.utils.blocking_http import blocking_client
from slime.utils.engine_access import engine_admin_headers

logger = logging.getLogger(__name__)

PROCESS_POLL_INTERVAL_S = 0.5
ACTOR_CALL_TIMEOUT_S = 30.0


@dataclass
class EngineSlot:
    """One engine (all its ranks; `rank` is the engine's index). state: serving (in the router), pending (started, waiting for weights), down (failed,
    waiting for its restart), starting. `actor` None: an external engine."""
    rank: int
    actor: object
    url: str
    log_path: str = ""
    state: str = "serving"
    failed_at: float | None = None
    actor_dead: bool = False


@dataclass
class RecoveryCounters:
    """What happened since the last `pop_metrics()` (one rollout's worth)."""
    engine_failures: int = 0
    engine_restarts: int = 0
    router_restarts: int = 0
    recovery_seconds: float = 0.0


class EngineSupervisor:
    def __init__(self, args, actors: list, urls: list[str], router_url: str, *, router=None, new_router=None,
                 new_actor=None):
        """`router`: the RouterProcess slime started (None for an external one); `new_router()` starts another
        on the same port; `new_actor(rank)` creates a replacement engine actor when an actor process itself died."""
        self.args = args
        self.router_url = router_url
        self.router = router
        self.new_router = new_router
        self.new_actor = new_actor
        self.fault_tolerant = bool(args.use_fault_tolerance)
        log_paths = [ray.get(actor.exit_status.remote())[1] if actor is not None else "" for actor in actors]
        self.slots = [EngineSlot(rank, actor, url, log_path=log)
                      for rank, (actor, url, log) in enumerate(zip(actors, urls, log_paths))]
        self.lock = threading.RLock()
        self.router_lock = threading.Lock()
        self.push_lock = threading.Lock()
        self.fatal: Exception | None = None
        self.trainer = None  # the RayTrainGroup that pushes weights to a restarted engine
        self.weight_version: str | None = None
        self.in_rollout = False
        self.released_tags: set[str] = set()
        self.heartbeat_resume_at = time.monotonic() + args.rollout_health_check_first_wait
        self.num_restarts = 0
        self.counters = RecoveryCounters()
        self.restarts: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        loops = [self._watch_processes] + ([self._heartbeats, self._recover] if self.fault_tolerant else [])
        self.threads = [threading.Thread(target=self._guarded, args=(loop,), name=f"slime-engine{loop.__name__}",
                                         daemon=True) for loop in loops]
        for thread in self.threads:
            thread.start()

    # ---- what the RolloutManager asks ------------------------------------------------------------------------
    def check(self) -> None:
        """Raise the error that ends the run, if there is one."""
        if self.fatal is not None:
            raise self.fatal

    def live_urls(self) -> list[str]:
        """Engines that hold their memory state like the others (serving, or started and waiting for weights)."""
        with self.lock:
            return [s.url for s in self.slots if s.state in ("serving", "pending")]

    def urls_for_weight_push(self, timeout_s: float = 900.0) -> dict[int, str]:
        """Wait for restarts in progress, then {engine index: URL} of every engine the driver's weight push must
        reach (the index places the engine's ranks on the trainer's devices)."""
        deadline = time.monotonic() + timeout_s
        while self._restart_in_progress() and time.monotonic() < deadline:
            self.check()
            time.sleep(0.2)
        self.check()
        with self.lock:
            return {s.rank: s.url for s in self.slots if s.state in ("serving", "pending")}

    def weights_pushed(self, version: str, engines: dict[int, str]) -> None:
        """The driver pushed `version` to `engines` ({engine index: URL}): the restarted engines among them may serve
        now (one restarted during the push gets its weights when the next rollout begins)."""
        with self.push_lock:
            with self.lock:
                self.weight_version = version
                pending = [s for s in self.slots if s.state == "pending" and engines.get(s.rank) == s.url]
            self._join_router(pending)

    def begin_rollout(self) -> None:
        self.in_rollout = True
        self._deliver_weights()

    def end_rollout(self) -> None:
        self.in_rollout = False

    def set_trainer(self, trainer) -> None:
        self.trainer = trainer

    def memory_released(self, tags: list[str]) -> None:
        self.released_tags |= set(tags)

    def memory_resumed(self, tags: list[str]) -> None:
        self.released_tags -= set(tags)
        if not self.released_tags:
            self.heartbeat_resume_at = time.monotonic() + self.args.rollout_health_check_first_wait

    def pop_metrics(self) -> dict:
        with self.lock:
            counters, self.counters = self.counters, RecoveryCounters()
        return {"rollout/engine_failures": counters.engine_failures,
                "rollout/engine_restarts": counters.engine_restarts,
                "rollout/router_restarts": counters.router_restarts,
                "rollout/engine_recovery_time": counters.recovery_seconds}

    def shutdown(self) -> None:
        self.stopping.set()

    # ---- detection -------------------------------------------------------------------------------------------
    def _guarded(self, loop) -> None:
        """Run a watch loop; if it breaks, the engines are no longer watched, which ends the run (with why)."""
        try:
            loop()
        except Exception as exc:  # noqa: BLE001 - any error here stops the watch: report it, do not lose it
            self._set_fatal(EngineFailureError(f"the engine watch ({loop.__name__}) failed: "
                                               f"{type(exc).__name__}: {exc}"))

    def _watch_processes(self) -> None:
        while not self.stopping.wait(PROCESS_POLL_INTERVAL_S):
            self.poll_processes()

    def poll_processes(self) -> None:
        """Check now that the router and every engine's server process still run (a failure is handled as the
        watch would: an error to raise, or a recovery)."""
        self._check_router()
        with self.lock:
            watched = [s for s in self.slots if s.state in ("serving", "pending")]
        for slot in watched:
            if slot.actor is None:
                problem = health_problem(slot.url, engine_admin_headers(self.args))
                if problem is not None:
                    self._fail(slot, problem)
                continue
            try:
                exit_code, _ = ray.get(slot.actor.exit_status.remote(), timeout=ACTOR_CALL_TIMEOUT_S)
            except ray.exceptions.RayActorError as exc:
                slot.actor_dead = True
                self._fail(slot, f"its engine actor process died ({type(exc).__name__})")
                continue
            except ray.exceptions.GetTimeoutError:
                continue
            if exit_code is not None:
                self._fail(slot, describe_exit(exit_code))

    def _heartbeats(self) -> None:
        interval, timeout = self.args.rollout_health_check_interval, self.args.rollout_health_check_timeout
        with ThreadPoolExecutor(max_workers=max(1, len(self.slots)), thread_name_prefix="slime-heartbeat") as pool:
            while not self.stopping.wait(interval):
                if self.released_tags or time.monotonic() < self.heartbeat_resume_at:
                    continue
                with self.lock:
                    serving = [(s, s.url) for s in self.slots if s.state == "serving"]
                answers = pool.map(lambda pair: self._heartbeat(pair[1], timeout), serving)
                for (slot, url), answer in zip(serving, answers):
                    # The same process still serving (not failed and replaced while its heartbeat was out).
                    if answer is not None and slot.state == "serving" and slot.url == url and not self.released_tags:
                        self._fail(slot, self._exit_reason(slot) or answer)

    def _exit_reason(self, slot: EngineSlot) -> str | None:
        """How the slot's server process ended, when it has (a refused heartbeat says less)."""
        if slot.actor is None:
            return None
        try:
            exit_code, _ = ray.get(slot.actor.exit_status.remote(), timeout=ACTOR_CALL_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return None
        return None if exit_code is None else describe_exit(exit_code)

    def _heartbeat(self, url: str, timeout: float) -> str | None:
        """None when the engine generated its heartbeat token in time; otherwise what went wrong."""
        try:
            response = httpx.get(f"{url}/health_generate", headers=engine_admin_headers(self.args), timeout=timeout,
                                 trust_env=False)
        except httpx.TimeoutException:
            return describe_hang(timeout)
        except httpx.HTTPError as exc:
            return f"GET /health_generate failed ({type(exc).__name__}: {exc})"
        return None if response.status_code == 200 else f"GET /health_generate answered {response.status_code}"

    def _check_router(self) -> None:
        with self.router_lock:  # two pollers must not both restart it
            self._check_router_locked()

    def _check_router_locked(self) -> None:
        if self.router is None or self.router.exit_code() is None:
            return
        exit_code = self.router.exit_code()
        if not self.fault_tolerant:
            self._set_fatal(router_died_error(exit_code, str(self.args.output_dir) + "/router.log"))
            return
        logger.warning("fault tolerance: the sglang-router %s; restarting it on the same port",
                       describe_exit(exit_code))
        self.router.shutdown()
        self.router = self.new_router()
        with self.lock:
            serving = [s for s in self.slots if s.state == "serving"]
            self.counters.router_restarts += 1
        for slot in serving:
            register_worker(self.router_url, slot.url, api_key=self.args.sglang_api_key)
        logger.warning("fault tolerance: router back at %s with %d engine(s)", self.router_url, len(serving))

    # ---- recovery --------------------------------------------------------------------------------------------
    def _set_fatal(self, error: Exception) -> None:
        if self.fatal is None:
            self.fatal = error
            logger.error("%s", error)

    def _fail(self, slot: EngineSlot, reason: str) -> None:
        with self.lock:
            if slot.state not in ("serving", "pending"):
                return  # already being handled
            if slot.actor is None:
                self._set_fatal(external_engine_error(slot.rank, slot.url, reason))
                return
            if not self.fault_tolerant:
                self._set_fatal(engine_died_error(slot.rank, slot.url, reason, slot.log_path))
                return
            slot.state, slot.failed_at = "down", time.monotonic()
            self.counters.engine_failures += 1
        logger.warning("fault tolerance: rollout engine %d (%s) failed: %s (log %s); taking it out of the router, "
                       "its requests go to the other engines", slot.rank, slot.url, reason, slot.log_path)
        try:
            deregister_worker(self.router_url, slot.url, api_key=self.args.sglang_api_key)
        except (httpx.HTTPError, RouterError):
            pass  # the router is down itself (its restart registers only the serving engines), or dropped it
        try:
            ray.get(slot.actor.kill.remote(), timeout=ACTOR_CALL_TIMEOUT_S)
        except ray.exceptions.RayActorError:
            slot.actor_dead = True
        self.restarts.put((slot, reason))

    def _restart_in_progress(self) -> bool:
        with self.lock:
            return any(s.state in ("down", "starting") for s in self.slots)

    def _recover(self) -> None:
        while not self.stopping.is_set():
            try:
                slot, reason = self.restarts.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                self._restart(slot, reason)
            except Exception as exc:  # noqa: BLE001 - any failure to recover ends the run, with its cause
                self._set_fatal(EngineFailureError(f"rollout engine {slot.rank} could not be restarted: "
                                                   f"{type(exc).__name__}: {exc}"))

    def _restart(self, slot: EngineSlot, reason: str) -> None:
        with self.lock:
            if self.num_restarts >= self.args.max_engine_restarts:
                self._set_fatal(restart_budget_error(slot.rank, slot.url, reason, slot.log_path,
                                                     self.args.max_engine_restarts))
                return
            self.num_restarts += 1
            slot.state = "starting"
        if slot.actor_dead:
            slot.actor, slot.actor_dead = self.new_actor(slot.rank), False
        slot.url = ray.get(slot.actor.start.remote())
        _, slot.log_path = ray.get(slot.actor.exit_status.remote())
        if self.released_tags:  # colocated: the others gave their memory to the trainer
            self._post(slot.url, "/release_memory_occupation", {"tags": sorted(self.released_tags)})
        with self.lock:
            slot.state = "pending"
            self.counters.engine_restarts += 1
        logger.warning("fault tolerance: rollout engine %d restarted at %s (restart %d of --max-engine-restarts %d)",
                       slot.rank, slot.url, self.num_restarts, self.args.max_engine_restarts)
        if self.in_rollout:
            self._deliver_weights()

    def _deliver_weights(self) -> None:
        """Push the trainer's current weights to the pending engines and let them serve (during a rollout, when
        the driver's next push is too far away)."""
        with self.push_lock:  # the recovery thread and a starting rollout may both get here
            with self.lock:
                pending = [s for s in self.slots if s.state == "pending"]
            if not pending:
                return
            if self.weight_version is not None:  # else nothing was pushed yet: all engines run the checkpoint's
                if self.trainer is None:
                    return  # the driver's next push reaches them (get_engine_urls)
                # an offloaded trainer comes back for the push and leaves again; one on the device stays
                self.trainer.update_weights({s.rank: s.url for s in pending}, weight_version=self.weight_version,
                                            resident=True)
            self._join_router(pending)

    def _join_router(self, slots: list[EngineSlot]) -> None:
        for slot in slots:
            register_worker(self.router_url, slot.url, api_key=self.args.sglang_api_key)
            with self.lock:
                slot.state = "serving"
                if slot.failed_at is not None:
                    self.counters.recovery_seconds += time.monotonic() - slot.failed_at
                    slot.failed_at = None
            logger.warning("fault tolerance: rollout engine %d serves again at %s (weight version %s)",
                           slot.rank, slot.url, self.weight_version)

    def _post(self, url: str, path: str, payload: dict) -> None:
        response = blocking_client().post(f"{url}{path}", json=payload, headers=engine_admin_headers(self.args),
                                          timeout=300.0)
        if response.status_code != 200:
            raise EngineFailureError(f"{url}{path} failed: {response.status_code} {response.text}")
