"""An aiohttp application served from its own event loop on a daemon thread, with slime's names
(`slime.agent.aiohttp_threaded`): `run_app_in_thread`, `AppHandle`, `FilteredAccessLogger`. A rollout's generate
function, which runs on another loop, keeps an adapter app up this way for the agent CLIs to call.

Not the adapters themselves (`slime.agent.adapters`).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_log import AccessLogger


class FilteredAccessLogger(AccessLogger):
    """Logs only what is worth reading in a long rollout: errors and slow requests (HEAD probes never)."""

    SLOW_THRESHOLD_SEC = 120.0

    def log(self, request, response, time: float) -> None:
        if request.method == "HEAD" or (response.status == 200 and time <= self.SLOW_THRESHOLD_SEC):
            return
        super().log(request, response, time)


@dataclass
class AppHandle:
    """A running app: where it listens, and `stop()` to clean it up and end its thread."""

    host: str
    port: int
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop
    runner: web.AppRunner

    def stop(self) -> None:
        if not self.loop.is_closed() and self.loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=10)
            except FutureTimeout:
                pass  # the loop is stopped below all the same
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


def run_app_in_thread(
    app: web.Application,
    *,
    host: str = "0.0.0.0",
    port: int = 0,
    thread_name: str = "aiohttp-app",
    start_timeout_sec: float = 15.0,
    runner_kwargs: dict[str, Any] | None = None,
) -> AppHandle:
    """Serve `app` on `host:port` (0: a free port, the real one is `handle.port`) from a new event loop on a
    daemon thread; return once it listens. `runner_kwargs` go to `web.AppRunner` (e.g. `handler_cancellation=True`,
    so a client that disconnects cancels its handler). A failure to start is raised here."""
    started = threading.Event()
    state: dict[str, Any] = {}

    def serve() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            runner = web.AppRunner(app, **(runner_kwargs or {}))
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, host, port)
            loop.run_until_complete(site.start())
            state.update(loop=loop, runner=runner, port=runner.addresses[0][1])
        except BaseException as error:  # noqa: BLE001 - handed to the starting thread, which raises it
            state["error"] = error
            loop.close()
            return
        finally:
            started.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    thread = threading.Thread(target=serve, name=thread_name, daemon=True)
    thread.start()
    if not started.wait(timeout=start_timeout_sec):
        raise TimeoutError(f"{thread_name}: the app did not start listening on {host}:{port} within "
                           f"{start_timeout_sec}s")
    if "error" in state:
        raise state["error"]
    return AppHandle(host=host, port=int(state["port"]), thread=thread, loop=state["loop"], runner=state["runner"])
