"""Request/response plumbing shared by the native and OpenAI routes: strict JSON bodies, SSE lines, and cancelling
work whose client went away. No endpoint logic here."""

from __future__ import annotations

import asyncio
import contextlib
import json

from fastapi import Request

from slime.engine.http_protocol import RequestError

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
            return await asyncio.to_thread(json.loads, raw)
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"request body is not valid JSON: {error}") from error
    except RecursionError:
        raise RequestError("request body is nested too deeply to be a request of this API") from None


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
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()
