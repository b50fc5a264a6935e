"""The engine's driver thread: one background thread owns the Engine, runs `engine.step()` while requests are
pending (continuous batching across all HTTP requests) and hands each request's outputs to its asyncio waiter.

Every engine mutation (add, abort, weight update, cache flush, memory release) is a command queued to this thread
and run between two steps, so the HTTP event loop never touches the engine while it steps. Pausing stops steps
(in-flight requests wait) but still runs commands. Not the HTTP layer (`app.py`) and not the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from types import SimpleNamespace
from typing import AsyncIterator, Callable

from slime.engine.memory_tags import EngineMemoryReleasedError, EngineWeightsMissingError
from slime.engine.server.busy_period import BusyPeriod
from slime.engine.server.protocol import RequestError
from slime.engine.stop_strings import decode_final_texts

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
MAX_EMPTY_STEPS_BEFORE_BACKOFF = 64


@dataclass
class _Stream:
    """One in-flight request as the driver sees it: where its outputs go and the latest one sent."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    prompt_token_ids: list[int]
    incremental: bool = True  # False: the consumer only wants the finished output
    return_routed_experts: bool = False
    lora_name: str | None = None  # the LoRA adapter it generates with (None: the base model)
    images: list | None = None  # the prompt's decoded images (a VL model)
    latest: object | None = None
    finished: bool = False


class EngineLoop:
    def __init__(self, engine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # touched by the driver thread only
        self._deferred: dict[str, object] = {}  # rid -> sampling params of requests not yet in the engine
        self._holds: set[str] = set()  # reasons not to step (e.g. "paused", "memory_released"); commands still run
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="slime-engine-loop", daemon=True)
        self.last_step_error: str | None = None
        runner = getattr(engine, "model_runner", None)
        self.busy = BusyPeriod(getattr(runner, "graph_capture_stats", None))

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def is_paused(self) -> bool:
        """True while any hold is set: in-flight requests wait, nothing is stepped."""
        return bool(self._holds)

    # ---- commands --------------------------------------------------------------------------------------------
    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        """Run `fn(*args)` on the driver thread between two steps; the future holds its result or exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, args, future))
        self._wake.set()
        return future

    async def call(self, fn: Callable, *args):
        """`submit` from a coroutine: await the command's result (its exception is raised here)."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    # ---- requests --------------------------------------------------------------------------------------------
    async def generate(
        self, prompt_token_ids: list[int], sampling_params, rid: str | None = None, incremental: bool = True,
        return_routed_experts: bool = False, lora_name: str | None = None, images: list | None = None,
    ) -> AsyncIterator:
        """Add a request and yield its RequestOutputs (cumulative) until the finished one; with incremental=False
        only the finished one (a non-streaming consumer then costs one hand-over, not one per token).

        If the consumer stops early (client gone, task cancelled), the request is aborted in the engine.
        """
        rid = rid or uuid.uuid4().hex
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), list(prompt_token_ids), incremental,
                         return_routed_experts=return_routed_experts, lora_name=lora_name, images=images)
        try:
            await self.call(self._add, rid, stream, sampling_params)
        except ValueError as error:  # the engine rejected the request (e.g. a rid already in flight)
            raise RequestError(str(error)) from error
        try:
            while True:
                output = await stream.outputs.get()
                if isinstance(output, BaseException):
                    raise output
                yield output
                if output.finished:
                    return
        finally:
            if not stream.finished:
                self.submit(self._abort_one, rid)

    def _add(self, rid: str, stream: _Stream, sampling_params) -> None:
        if rid in self._streams:
            raise ValueError(f"rid {rid!r} is already in flight; rids must be unique")
        try:
            self.engine.add_request(stream.prompt_token_ids, sampling_params, rid=rid,
                                    return_routed_experts=stream.return_routed_experts, incremental=stream.incremental,
                                    lora_name=stream.lora_name, images=stream.images)
        except EngineMemoryReleasedError:
            # Released memory refuses new requests; they wait here and enter the engine after the resume.
            self._deferred[rid] = sampling_params
        self._streams[rid] = stream

    def _add_deferred(self) -> None:
        for rid, sampling_params in list(self._deferred.items()):
            try:
                stream = self._streams[rid]
                self.engine.add_request(stream.prompt_token_ids, sampling_params, rid=rid,
                                        return_routed_experts=stream.return_routed_experts,
                                        incremental=stream.incremental, lora_name=stream.lora_name,
                                        images=stream.images)
            except EngineMemoryReleasedError:
                return
            except (EngineWeightsMissingError, ValueError) as error:
                # resumed without every weight pushed, or its LoRA adapter was unloaded meanwhile: waiting cannot help
                stream = self._streams.pop(rid)
                stream.finished = True
                failure = error if isinstance(error, EngineWeightsMissingError) else RequestError(str(error))
                stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, failure)
            del self._deferred[rid]

    def abort(self, rid: str) -> concurrent.futures.Future:
        return self.submit(self._abort_one, rid)

    def abort_all(self) -> concurrent.futures.Future:
        return self.submit(self._abort_all)

    def _abort_one(self, rid: str) -> bool:
        """Abort `rid` if it is in flight; its waiter gets a finished output with finish_reason abort."""
        if rid not in self._streams:
            return False
        self._deferred.pop(rid, None)
        self._dispatch(_as_outputs(self.engine.abort_request(rid)))
        self._finish_aborted(rid)
        return True

    def _abort_all(self) -> int:
        rids = list(self._streams)
        self._deferred.clear()
        self._dispatch(_as_outputs(self.engine.abort_all()))
        for rid in rids:
            self._finish_aborted(rid)
        return len(rids)

    def _finish_aborted(self, rid: str) -> None:
        """If the engine reported no final output for an aborted rid, send one built from the latest output (the
        tokens and log-probs generated so far)."""
        stream = self._streams.pop(rid, None)
        if stream is None:
            return
        latest = stream.latest
        output = SimpleNamespace(
            rid=rid,
            prompt_token_ids=stream.prompt_token_ids,
            output_token_ids=list(latest.output_token_ids) if latest else [],
            output_log_probs=list(latest.output_log_probs) if latest else [],
            text=latest.text if latest else "",
            finished=True,
            finish_reason={"type": "abort", "message": "aborted by request"},
            num_cached_tokens=latest.num_cached_tokens if latest else 0,
            weight_version=latest.weight_version if latest else self.engine.weight_version,
        )
        self._send(stream, output)

    # ---- pause -----------------------------------------------------------------------------------------------
    def set_hold(self, reason: str, held: bool) -> concurrent.futures.Future:
        """Stop (held=True) or allow stepping for `reason`; the engine steps only when no reason holds it."""
        return self.submit(self._set_hold, reason, held)

    def _set_hold(self, reason: str, held: bool) -> None:
        if held:
            self._holds.add(reason)
        else:
            self._holds.discard(reason)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- driver thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        num_empty_steps = 0
        while not self._stopped:
            self._wake.clear()
            started = time.perf_counter()
            self._run_commands()
            self.busy.add_commands(time.perf_counter() - started)
            if self._deferred and not self._holds:
                self._add_deferred()
            if not self._holds and self.engine.has_unfinished_requests():
                num_launched_before = self.engine.num_launched_steps
                self.busy.begin()
                started = time.perf_counter()
                try:
                    outputs = self.engine.step()
                # a failed step must not kill the server: fail its requests instead
                except Exception as error:  # noqa: BLE001
                    self._fail_all(error)
                    if getattr(self.engine, "ranks", None) is not None:
                        self.engine.ranks.stop_engine(f"a step of this sharded engine failed ({error})")
                    continue
                self.busy.add_step(time.perf_counter() - started)
                self._dispatch(outputs)
                # Steps of requests that only report their end return nothing while they run; a long run of steps
                # that neither report nor launch a batch means the engine cannot progress right now, so back off
                # instead of spinning a core.
                progressed = outputs or self.engine.num_launched_steps != num_launched_before
                num_empty_steps = 0 if progressed else num_empty_steps + 1
                if num_empty_steps >= MAX_EMPTY_STEPS_BEFORE_BACKOFF:
                    self._wake.wait(IDLE_WAIT_S)
            else:
                self.busy.end()
                self._wake.wait(IDLE_WAIT_S)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, args, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # noqa: BLE001
                future.set_exception(error)

    def _dispatch(self, outputs) -> None:
        """Hand a step's outputs to their waiters: one wake-up per event loop and step, not one per output."""
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            stream = self._streams.get(output.rid)
            if stream is None:
                continue
            stream.latest = output
            if output.finished:
                del self._streams[output.rid]
                stream.finished = True
                self.busy.add_finished(len(output.output_token_ids))
            elif not stream.incremental:
                continue
            deliveries.setdefault(stream.loop, []).append((stream.outputs, output))
        for loop, items in deliveries.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _send(self, stream: _Stream, output) -> None:
        stream.latest = output
        stream.finished = bool(getattr(output, "finished", True))
        stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, output)

    def _fail_all(self, error: Exception) -> None:
        self.last_step_error = "".join(traceback.format_exception(error))
        logger.error(
            "engine step failed; failing %d in-flight request(s):\n%s", len(self._streams), self.last_step_error
        )
        try:
            self.engine.abort_all()
        except Exception:
            logger.exception("abort_all after a failed step also failed")
        streams, self._streams = self._streams, {}
        self._deferred.clear()
        for stream in streams.values():
            stream.finished = True
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, RuntimeError(f"engine step failed: {error}"))


def _put_all(items: list) -> None:
    """On the event loop's thread: a step's finished requests' texts, decoded in one batch, off the engine's."""
    try:
        decode_final_texts([output for _, output in items])
    except Exception:  # the outputs must still reach their waiters: each text is then decoded when read
        logger.exception("decoding a step's finished texts in one batch failed")
    for outputs, output in items:
        outputs.put_nowait(output)


def _as_outputs(result) -> list:
    """Engine abort calls may return nothing, one RequestOutput or a list of them."""
    if result is None or isinstance(result, bool):
        return []
    if isinstance(result, (list, tuple)):
        return [r for r in result if hasattr(r, "rid")]
    return [result] if hasattr(result, "rid") else []
