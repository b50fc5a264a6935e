"""A thread pool for plain (non-async) reward functions whose threads never keep the process alive.

`concurrent.futures.ThreadPoolExecutor` joins its threads when the interpreter exits, so one reward call that
never returns (bounded by --reward-timeout for the rollout, but still running) kept the rollout manager's process
alive after the run. These threads are daemons: the process exits with them still blocked. What it is not: a way
to stop a hung call; the thread stays busy until the call returns or the process ends.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading


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
