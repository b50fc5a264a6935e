"""Engines started outside the run (`--rollout-external-engine-addrs`, e.g. `python -m slime.engine.server ...` or
an SGLang server): the RolloutManager checks that each answers, registers it with the router and the trainer pushes
weights to it like to its own engines; the engine watch (engine_health.py) checks it with GET /health, and a failed
one ends the run. The run never starts, kills or restarts them.
"""

from __future__ import annotations

import time

import httpx

from slime.ray.engine_failures import EngineFailureError
from slime.utils.engine_access import engine_admin_headers

HEALTH_TIMEOUT_S = 10.0
CONNECT_WAIT_S = 60.0  # an engine still loading its model at the run's start gets this long


def health_problem(url: str, headers: dict | None = None, timeout: float = HEALTH_TIMEOUT_S) -> str | None:
    """None when `url` answers GET /health with 200; otherwise what went wrong."""
    try:
        response = httpx.get(f"{url}/health", headers=headers, timeout=timeout, trust_env=False)
    except httpx.HTTPError as exc:
        return f"GET /health failed ({type(exc).__name__}: {exc})"
    return None if response.status_code == 200 else f"GET /health answered {response.status_code}"


def connect_external_engines(args) -> list[str]:
    """The external engines' URLs once every one answers GET /health (within CONNECT_WAIT_S)."""
    headers = engine_admin_headers(args)
    deadline = time.monotonic() + CONNECT_WAIT_S
    for url in args.rollout_external_engine_urls:
        while (problem := health_problem(url, headers)) is not None:
            if time.monotonic() > deadline:
                raise EngineFailureError(f"--rollout-external-engine-addrs: no engine answers at {url} ({problem}); "
                                         "start it first (e.g. python -m slime.engine.server --model-path ... "
                                         "--port ...)")
            time.sleep(1.0)
    return list(args.rollout_external_engine_urls)
