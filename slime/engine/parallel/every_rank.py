"""`@every_rank`: a ModelRunner method that changes per-rank state (KV cache, weights' storage, CUDA graphs, kernel
choices) runs on every rank of a sharded engine, in the same order relative to the step plans.

On rank 0 (a runner with a `plan`, the EngineRanks) the call is first sent to the other ranks, then run here, then
their replies are awaited, so methods with collectives inside (a CUDA-graph capture runs the model) run in lockstep.
On the other ranks, and in a one-device engine, the method simply runs.
"""

from __future__ import annotations

import functools


def every_rank(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        plan = getattr(self, "plan", None)
        if plan is None:
            return method(self, *args, **kwargs)
        with plan.calling(method.__name__, *args, **kwargs):
            return method(self, *args, **kwargs)

    return wrapper
