"""Async HTTP for rollouts (slime's `slime.utils.http_utils`): one background event loop, one shared aiohttp
session, JSON requests with retries, router helpers, and slime's `post` / `get` for generate functions.

Rollout code is asyncio; its callers (Ray actor methods, train.py) are synchronous. `run(coro)` executes a
coroutine on a single daemon event-loop thread and blocks for the result, so every request of every rollout
shares one loop and one connection pool. Not a general HTTP library: only what talking to an sglang-router and
SGLang-compatible engines needs (POST/GET JSON with retries on connection errors, abort every worker). aiohttp
for the async paths (httpx serves the blocking calls elsewhere): on a 2-core machine 256 concurrent /generate round
trips took 0.18-0.31 s with aiohttp and 0.9-1.3 s through httpx's connection pool. Bodies are encoded and decoded
by orjson: decoding a /generate result of 256 tokens with log-probs takes ~3x less than `json.loads`
(benchmarks/bench_rollout_io.py).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
from typing import Any

import aiohttp
import orjson

logger = logging.getLogger(__name__)

DEFAULT_NUM_RETRIES = 5
RETRY_BACKOFF_BASE_S = 0.2
RETRY_BACKOFF_MAX_S = 4.0
# Gateway statuses mean "no healthy worker right now" (e.g. an engine restarting), so the request is retried.
RETRYABLE_STATUS_CODES = (502, 503, 504)
ABORT_TIMEOUT_S = 10.0
JSON_CONTENT_TYPE = {"Content-Type": "application/json"}


class EndpointUnreachableError(ConnectionError):
    """Raised when an HTTP endpoint (router or engine) cannot be reached after all retries."""


class HTTPRequestError(RuntimeError):
    """The endpoint answered with an error status that retrying cannot fix (a bad request or an engine bug)."""

    def __init__(self, message: str, status: int | None = None, body: str = ""):
        super().__init__(message)
        self.status = status
        self.body = body


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()
_session: aiohttp.ClientSession | None = None  # shared by the requests on the background loop


def get_event_loop() -> asyncio.AbstractEventLoop:
    """The background event loop, started on first use (a daemon thread, lives as long as the process)."""
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="slime-rollout-loop", daemon=True)
            thread.start()
            _loop = loop
    return _loop


def run(coro):
    """Run `coro` on the background event loop and block until it returns (or raises)."""
    loop = get_event_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        coro.close()
        raise RuntimeError("run() was called from the rollout event loop itself; await the coroutine instead")
    return asyncio.run_coroutine_threadsafe(coro, loop).result()


def _new_session() -> aiohttp.ClientSession:
    # limit=0: no connection cap (the rollout's semaphore bounds concurrency). trust_env=False: an http_proxy set
    # for downloads must not capture traffic to local engines.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None),
                                 trust_env=False)


def _shared_session() -> aiohttp.ClientSession:
    """The session every request on the background loop shares (its connections are bound to that loop)."""
    global _session
    if _session is None or _session.closed:
        _session = _new_session()
    return _session


@atexit.register
def _close_shared_session() -> None:
    loop, session = _loop, _session
    if session is not None and not session.closed and loop is not None and loop.is_running():
        asyncio.run_coroutine_threadsafe(session.close(), loop).result(timeout=5)


async def request_json(
    method: str,
    url: str,
    payload: dict | None = None,
    *,
    timeout: float | None = None,
    num_retries: int | None = None,
    headers: dict | None = None,
) -> Any:
    """Send one JSON request (with `headers`, e.g. the bearer key of `slime.utils.engine_access`), retrying with
    exponential backoff on connection errors and 502/503/504.

    Raises EndpointUnreachableError (naming the URL) once the retries are spent, and HTTPRequestError with the
    answer's body for other error statuses (a 4xx/500 is a bug in the request or the engine; retrying would not help).
    """
    if num_retries is None:
        num_retries = DEFAULT_NUM_RETRIES
    on_background_loop = asyncio.get_running_loop() is _loop
    client = _shared_session() if on_background_loop else _new_session()  # other loops: one session per call
    try:
        return await _request_with_retries(client, method, url, payload, timeout, num_retries, headers)
    finally:
        if not on_background_loop:
            await client.close()


async def _request_with_retries(client: aiohttp.ClientSession, method: str, url: str, payload: dict | None,
                                timeout: float | None, num_retries: int, headers: dict | None) -> Any:
    last_error: Exception | None = None
    for attempt in range(num_retries + 1):
        if attempt:
            await asyncio.sleep(min(RETRY_BACKOFF_BASE_S * 2 ** (attempt - 1), RETRY_BACKOFF_MAX_S))
        try:
            async with client.request(method, url, data=None if payload is None else _encode(payload),
                                      headers={**JSON_CONTENT_TYPE, **(headers or {})},
                                      timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                status, body = response.status, await response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # connection refused / reset, timeouts
            last_error = exc
            continue
        text = body.decode("utf-8", errors="replace")
        if status in RETRYABLE_STATUS_CODES:
            last_error = HTTPRequestError(f"{status}: {text[:200]}", status, text)
            continue
        if status >= 400:
            raise HTTPRequestError(f"{method} {url} answered {status}: {text[:1000]}", status, text)
        return orjson.loads(body) if body else None
    raise EndpointUnreachableError(
        f"could not reach {url} after {num_retries + 1} attempts "
        f"(last error: {type(last_error).__name__}: {last_error}). Is the sglang router/engine running at that "
        f"address? Check --sglang-router-ip / --sglang-router-port."
    ) from last_error


def _encode(payload) -> bytes:
    """JSON bytes as `json.dumps` would give them for what callers send (int dict keys become strings, numpy
    scalars and arrays numbers and lists), except that a non-finite float becomes null instead of invalid JSON."""
    return orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)


def router_url(args) -> str:
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}"


def worker_urls_from_listing(listing: Any) -> list[str]:
    """The worker URLs in a router's `GET /workers` answer (sglang-router >= 0.2: {"workers": [{"url": ...}]};
    older routers: {"urls": [...]})."""
    if isinstance(listing, dict):
        if "workers" in listing:
            return [w["url"] if isinstance(w, dict) else str(w) for w in listing["workers"]]
        if "urls" in listing:
            return list(listing["urls"])
    if isinstance(listing, list):
        return [w["url"] if isinstance(w, dict) else str(w) for w in listing]
    raise ValueError(f"unexpected GET /workers answer from the router: {listing!r}")


async def list_worker_urls(base_url: str, headers: dict | None = None) -> list[str]:
    return worker_urls_from_listing(await request_json("GET", f"{base_url}/workers", headers=headers))


async def abort_all_requests(base_url: str, router_headers: dict | None = None,
                             engine_headers: dict | None = None) -> list[str]:
    """Ask every worker behind the router at `base_url` to abort all its requests; returns the worker URLs.
    `router_headers` authenticate to the router, `engine_headers` (the admin key) to the workers.

    Aborted requests answer their pending /generate with finish_reason "abort" and the tokens produced so far. A
    worker that cannot be reached in time (a failed engine, not yet out of the router) is skipped with a warning:
    the engine watch deals with it, and a request it held fails on its own. A 401 / 403 (the admin key) raises.
    """
    worker_urls = await list_worker_urls(base_url, router_headers)
    answers = await asyncio.gather(*(
        request_json("POST", f"{url.rstrip('/')}/abort_request", {"abort_all": True}, headers=engine_headers,
                     timeout=ABORT_TIMEOUT_S, num_retries=1)
        for url in worker_urls
    ), return_exceptions=True)
    for url, answer in zip(worker_urls, answers):
        if isinstance(answer, HTTPRequestError) and answer.status in (401, 403):
            raise answer  # a wrong or missing admin key is the run's configuration, not a failed engine
        if isinstance(answer, (EndpointUnreachableError, HTTPRequestError)):
            logger.warning("could not abort the requests of %s: %s", url, answer)
        elif isinstance(answer, BaseException):
            raise answer
    return worker_urls


async def post(url: str, payload: dict | None, max_retries: int = 60, headers: dict | None = None) -> Any:
    """slime's `http_utils.post`: POST JSON, retried (connection errors, 502/503/504) up to `max_retries` times,
    returning the decoded answer. Generate functions call it on the rollout's loop."""
    return await request_json("POST", url, payload or {}, num_retries=max_retries, headers=headers)


async def get(url: str) -> Any:
    """slime's `http_utils.get`: GET and decode the JSON answer."""
    return await request_json("GET", url)
