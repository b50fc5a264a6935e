"""Awaiting blocking work without letting it hold the process: `run_in_daemon_thread` runs a function on a fresh
daemon thread and resolves an asyncio future with its result. Unlike `asyncio.to_thread` (the default executor,
whose threads the interpreter joins at exit), a call that never returns (a rendezvous waiting on a peer that never
comes, a user's tool stuck in a loop) costs only its caller's timeout; one thread per call.

`DaemonThreadPool` is the pooled form for plain (non-async) callers: `concurrent.futures.ThreadPoolExecutor` joins
its threads when the interpreter exits, so one call that never returns (a hung reward function) kept the rollout
manager's process alive after the run; these threads are daemons and the process exits with them still blocked.
Neither is a way to stop a hung call: its thread stays busy until the call returns or the process ends."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading


async def run_in_daemon_thread(function, *args, **kwargs):
    """`await` function(*args, **kwargs) run on a daemon thread named after the function."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run():
        try:
            result, error = function(*args, **kwargs), None
        except BaseException as raised:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, raised
        try:
            loop.call_soon_threadsafe(_settle, future, result, error)
        except RuntimeError:  # the loop closed while the call ran (its caller gave up, the process is ending)
            pass

    name = f"slime-{getattr(function, '__name__', 'call')}"
    threading.Thread(target=run, name=name, daemon=True).start()
    return await future


def _settle(future, result, error) -> None:
    if future.done():  # cancelled by a timeout
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class DaemonThreadPool(concurrent.futures.Executor):
    """At most `max_workers` daemon threads run the submitted calls, first come first served."""

    def __init__(self, max_workers: int, thread_name_prefix: str):
        self.max_workers = max_workers
        self.thread_name_prefix = thread_name_prefix
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._num_threads = 0
        self._lock = threading.Lock()

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        self._calls.put((future, fn, args, kwargs))
        with self._lock:
            if self._num_threads < self.max_workers:
                name = f"{self.thread_name_prefix}_{self._num_threads}"
                threading.Thread(target=self._work, name=name, daemon=True).start()
                self._num_threads += 1
        return future

    def _work(self) -> None:
        while True:
            future, fn, args, kwargs = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - the caller gets every error through the future
                future.set_exception(exc)
