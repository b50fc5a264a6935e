"""The real sglang-router as a run starts it (slime/ray/router.py): like slime's, it never locks an engine out. A
worker that answers a burst of requests with errors keeps serving once it recovers (sglang-router's circuit breaker
would open after 10 failures and answer 503 "no_available_workers" for a minute), and the router runs no health
checks of its own. The worker here is a small HTTP server that fails its first requests on purpose: the router
under test is the real one."""

import asyncio
import threading

import httpx
import pytest
from aiohttp import web

from slime.ray.router import RouterProcess, register_worker
from slime.utils.misc import find_free_port

FAILING_REQUESTS = 12


@pytest.fixture
def flaky_worker():
    """A worker whose first FAILING_REQUESTS /generate calls answer 500."""
    seen = {"generate": 0}

    async def handle(request):
        if request.path != "/generate":
            return web.json_response({"model_path": "flaky", "is_generation": True})
        seen["generate"] += 1
        if seen["generate"] <= FAILING_REQUESTS:
            return web.json_response({"error": "injected failure"}, status=500)
        return web.json_response({"text": "ok", "meta_info": {"finish_reason": {"type": "stop"}}})

    port = find_free_port("127.0.0.1")
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)

    def serve():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", seen
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


@pytest.mark.parametrize("retries", [True, False], ids=["default", "fault-tolerance"])
def test_a_burst_of_engine_errors_does_not_lock_the_engine_out(flaky_worker, retries):
    url, seen = flaky_worker
    router = RouterProcess(policy="round_robin", retries=retries)
    try:
        register_worker(router.url, url, timeout=30)
        codes = [httpx.post(f"{router.url}/generate", json={"text": "hi", "sampling_params": {}}, timeout=30,
                            trust_env=False).status_code for _ in range(FAILING_REQUESTS + 4)]
    finally:
        router.shutdown()
    assert 503 not in codes, codes  # a 503 is the router refusing: its circuit breaker took the worker out
    assert seen["generate"] >= FAILING_REQUESTS + 4 and codes[-4:] == [200] * 4
    if not retries:  # fault tolerance: each failed request comes straight back to the rollout, which re-sends it
        assert codes == [500] * FAILING_REQUESTS + [200] * 4
