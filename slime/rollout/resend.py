"""Re-sending a /generate request whose engine failed (`--use-fault-tolerance`).

A /generate answers all its tokens or none: when the engine serving it dies or is killed as hung, the router
answers 500 `call_upstream_request_error` (it does not retry under fault tolerance, see slime/ray/router.py), 500
`read_response_body_failed` when the engine went down in the middle of its answer (an engine of several ranks whose
rank died exits as it answers), or 503 / a refused connection while no engine or no router is up. Such a request is sent again, from the same tokens,
until an engine answers (the supervisor restarts engines and the router meanwhile), so nothing of the failed
engine's partial output is kept and the sample is generated exactly once. Each re-send is counted in
`sample.metadata["num_resends"]` (the rollout's `rollout/samples_resent` metric). Without fault tolerance the
request is sent once with the usual retries, and an engine failure ends the run (slime/ray/engine_health.py).

What it is not: a retry of requests that are wrong (4xx) or of errors the engine itself reports (other 500s).
"""

from __future__ import annotations

import asyncio
import logging
import time

from slime.utils.http_utils import EndpointUnreachableError, HTTPRequestError, request_json
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

# How long a request keeps being re-sent: past an engine's restart (start-up and weight push) and the router's;
# a failure the supervisor cannot recover from ends the run before.
RESEND_WINDOW_S = 3600.0
RESEND_DELAY_S = 0.5
# The router's error codes for an engine that did not answer (the request itself was never refused).
ROUTER_UPSTREAM_ERRORS = ("call_upstream_request_error", "read_response_body_failed")


def is_engine_failure(error: Exception) -> bool:
    """Whether `error` means the request's engine (or the router) is gone, not that the request is wrong."""
    if isinstance(error, EndpointUnreachableError):
        return True
    return (isinstance(error, HTTPRequestError) and error.status == 500
            and any(code in error.body for code in ROUTER_UPSTREAM_ERRORS))


async def post_generate(args, url: str, payload: dict, sample: Sample, *, timeout: float, headers: dict) -> dict:
    """POST `payload` to the router's /generate at `url`; under --use-fault-tolerance re-send it (counted on
    `sample`) while its engine or the router is being recovered."""
    if not args.use_fault_tolerance:
        return await request_json("POST", url, payload, timeout=timeout, headers=headers)
    deadline = time.monotonic() + RESEND_WINDOW_S
    while True:
        try:
            return await request_json("POST", url, payload, timeout=timeout, headers=headers)
        except (EndpointUnreachableError, HTTPRequestError) as error:
            if not is_engine_failure(error) or time.monotonic() > deadline:
                raise
            sample.metadata["num_resends"] = sample.metadata.get("num_resends", 0) + 1
            if sample.metadata["num_resends"] == 1:  # once per sample: all engines down would repeat it for each
                logger.warning("fault tolerance: re-sending sample %s (its engine failed: %s)", sample.index,
                               str(error)[:200])
            await asyncio.sleep(RESEND_DELAY_S)
