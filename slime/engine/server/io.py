"""Request/response plumbing shared by the native and OpenAI routes: strict JSON bodies, JSON responses, SSE lines,
and cancelling work whose client went away. No endpoint logic here.

JSON goes through orjson both ways. A route that returns a dict would have FastAPI walk it with `jsonable_encoder`
and then `json.dumps` it: 1.6-4.8 ms per /generate result of 256 tokens with log-probs on a 2-core CPU
(benchmarks/bench_rollout_io.py), on the thread that shares the GIL with the engine's driver thread; `json_response`
encodes the same bytes in ~20 us."""

from __future__ import annotations

import asyncio
import contextlib

import orjson
from fastapi import Request
from fastapi.responses import Response

from slime.engine.server.protocol import RequestError

DISCONNECT_POLL_S = 0.5


# Bodies above this are decoded on a worker thread, so a large request does not stall /health and other requests.
LARGE_BODY_BYTES = 256 * 1024


async def read_json(request: Request, allow_empty: bool = False):
    """The request's JSON body; `{}` for an empty body when allowed. Malformed or too deeply nested JSON ->
    RequestError. (The body's size is bounded before this by `http_guard`.)"""
    raw = await request.body()
    if not raw.strip():
        if allow_empty:
            return {}
        raise RequestError("request body is empty; expected a JSON object")
    try:
        if len(raw) > LARGE_BODY_BYTES:
            return await asyncio.to_thread(orjson.loads, raw)
        return orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        message = str(error).lower()
        if "depth limit" in message or "recursion limit" in message:  # orjson 3.13's wording, and older releases'
            raise RequestError("request body is nested too deeply to be a request of this API") from None
        raise RequestError(f"request body is not valid JSON: {error}") from error


def json_response(payload, status_code: int = 200) -> Response:
    """`payload` (dicts, lists, str, int, float, bool, None) as an application/json response, encoded by orjson
    (a non-finite float becomes null)."""
    return Response(orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS), status_code=status_code,
                    media_type="application/json")


async def unless_disconnected(request: Request, coroutine):
    """Await `coroutine`, cancelling it (which aborts its engine requests) if the client goes away first, as SGLang
    does; returns None in that case (nobody is left to read the response)."""
    task = asyncio.ensure_future(coroutine)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None


def sse_line(payload) -> bytes:
    data = payload.encode() if isinstance(payload, str) else orjson.dumps(payload)
    return b"data: " + data + b"\n\n"
