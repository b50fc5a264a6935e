"""run_app_in_thread: a real app on its own loop and thread answers this thread's HTTP client, reports its real port,
cancels a handler whose client went away (with handler_cancellation), raises a start failure here, and stops."""

import asyncio
import logging
import socket
import threading

import httpx
import pytest
from aiohttp import web

from slime.agent.aiohttp_threaded import FilteredAccessLogger, run_app_in_thread


def make_app(events: dict) -> web.Application:
    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"thread": threading.current_thread().name})

    async def slow(request: web.Request) -> web.Response:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            events["cancelled"].set()
            raise
        return web.Response(text="late")

    async def fail(request: web.Request) -> web.Response:
        return web.Response(status=418, text="teapot")

    app = web.Application()
    app.router.add_get("/hello", hello)
    app.router.add_get("/slow", slow)
    app.router.add_get("/fail", fail)
    return app


def test_serves_from_its_thread_and_stops():
    events = {"cancelled": threading.Event()}
    handle = run_app_in_thread(make_app(events), host="127.0.0.1", port=0, thread_name="adapter-app",
                               runner_kwargs={"handler_cancellation": True})
    try:
        assert handle.port > 0 and handle.thread.is_alive()
        base = f"http://127.0.0.1:{handle.port}"
        assert httpx.get(f"{base}/hello", trust_env=False).json() == {"thread": "adapter-app"}
        with pytest.raises(httpx.ReadTimeout):
            httpx.get(f"{base}/slow", timeout=0.5, trust_env=False)
        assert events["cancelled"].wait(10), "the handler of a client that left was not cancelled"
    finally:
        handle.stop()
    assert not handle.thread.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{handle.port}/hello", trust_env=False)


def test_a_start_failure_is_raised_here():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            run_app_in_thread(web.Application(), host="127.0.0.1", port=taken.getsockname()[1])


def test_access_log_keeps_errors_and_slow_requests_only(caplog):
    handle = run_app_in_thread(make_app({"cancelled": threading.Event()}), host="127.0.0.1",
                               runner_kwargs={"access_log_class": FilteredAccessLogger})
    try:
        with caplog.at_level(logging.INFO, logger="aiohttp.access"):
            base = f"http://127.0.0.1:{handle.port}"
            httpx.get(f"{base}/hello", trust_env=False)
            httpx.head(f"{base}/fail", trust_env=False)
            httpx.get(f"{base}/fail", trust_env=False)
            handle.stop()
    finally:
        handle.stop()
    logged = [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]
    assert len(logged) == 1 and '"GET /fail' in logged[0] and " 418 " in logged[0]
