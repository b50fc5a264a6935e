"""`--rm-type remote_rm`: POST {"prompt", "response", "label"} to `--rm-url`; the JSON answer is the reward.

One aiohttp session per event loop (connection reuse). Connection errors, timeouts, 429 and 5xx are retried with
exponential backoff; other 4xx mean the request itself is wrong and raise at once. Everything happens within the
`budget_s` the caller gives (`--reward-timeout`): one attempt may take at most half of the time left, so a reward
server that hangs on one request (or restarts) still gets retried before the budget is spent.
"""

from __future__ import annotations

import asyncio
import time
import weakref

import aiohttp

MAX_ATTEMPTS = 10
BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 8.0
MIN_ATTEMPT_TIMEOUT_S = 1.0  # a short budget's attempts still get this long (within the budget)

_sessions: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession]" = weakref.WeakKeyDictionary()


class RemoteRewardError(RuntimeError):
    """The reward server answered with an error or something that is not a reward."""


def _session() -> aiohttp.ClientSession:
    loop = asyncio.get_running_loop()
    session = _sessions.get(loop)
    if session is None or session.closed:
        session = aiohttp.ClientSession(trust_env=False)
        _sessions[loop] = session
    return session


async def close_remote_rm_session() -> None:
    """Close this event loop's shared session (call before the loop ends to avoid 'unclosed session' warnings)."""
    session = _sessions.pop(asyncio.get_running_loop(), None)
    if session is not None:
        await session.close()


async def request_remote_reward(url: str, payload: dict, budget_s: float, max_attempts: int = MAX_ATTEMPTS):
    """POST `payload` to `url`, retrying transient failures within `budget_s` seconds; returns the decoded JSON
    (a number or a dict)."""
    deadline = time.monotonic() + budget_s
    attempt = 0
    while True:
        left = max(deadline - time.monotonic(), 0.001)
        try:
            timeout = aiohttp.ClientTimeout(total=max(min(left, MIN_ATTEMPT_TIMEOUT_S), left / 2))
            async with _session().post(url, json=payload, timeout=timeout) as response:
                if response.status == 429 or response.status >= 500:
                    raise aiohttp.ClientResponseError(
                        response.request_info, response.history, status=response.status, message=response.reason or ""
                    )
                if response.status >= 400:
                    body = (await response.text())[:200]
                    raise RemoteRewardError(f"reward server {url} answered {response.status}: {body}")
                reward = await response.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            attempt += 1
            backoff = min(BACKOFF_BASE_S * 2 ** (attempt - 1), BACKOFF_MAX_S)
            if attempt >= max_attempts or time.monotonic() + backoff >= deadline:
                raise
            await asyncio.sleep(backoff)
            continue
        if isinstance(reward, bool) or not isinstance(reward, (int, float, dict)):
            raise RemoteRewardError(f"reward server {url} returned {reward!r}; expected a number or a JSON object")
        return reward
