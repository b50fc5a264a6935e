"""Awaiting blocking work without letting it hold the process: `run_in_daemon_thread` runs a function on a fresh
daemon thread and resolves an asyncio future with its result. Unlike `asyncio.to_thread` (the default executor,
whose threads the interpreter joins at exit), a call that never returns (a rendezvous waiting on a peer that never
comes, a user's tool stuck in a loop) costs only its caller's timeout. Not a thread pool: one thread per call."""

from __future__ import annotations

import asyncio
import threading


async def run_in_daemon_thread(function, *args, **kwargs):
    """`await` function(*args, **kwargs) run on a daemon thread named after the function."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run():
        try:
            result = function(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(_settle, future, None, error)
        else:
            loop.call_soon_threadsafe(_settle, future, result, None)

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
