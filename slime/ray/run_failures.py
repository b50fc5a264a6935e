"""The failures that end a run with one clear message instead of a traceback: an engine or router failure
(engine_failures.py) and a dead train actor (train_failures.py). Ray hands the driver a remote error wrapped in a
RayTaskError whose text repeats the remote traceback; the message is the cause's own."""

from __future__ import annotations

import ray

from slime.ray.engine_failures import EngineFailureError
from slime.ray.train_failures import TrainActorDiedError

RUN_FAILURES = (EngineFailureError, TrainActorDiedError)


def failure_message(error: BaseException) -> str:
    cause = error.cause if isinstance(error, ray.exceptions.RayTaskError) else error
    return str(cause)
