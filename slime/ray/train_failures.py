"""A trainer process that dies stops the run with an error naming its rank and the checkpoint to resume from.

The ranks of a train group run collectives together, so when one dies the others wait for it, or fail their
collective first ("connection reset by peer"): the driver takes the ranks' results as they come (`get_from_ranks`),
and at the first error looks for the rank that died behind it, raising `TrainActorDiedError` naming it instead of
Ray's `ActorDiedError` (whose text suggests the OOM killer), a gloo error, or a hang. There is no
restart of trainer processes: a run resumes from its last checkpoint with `--load`.
"""

from __future__ import annotations

import time

import ray

from slime.utils.checkpoint_state import latest_checkpoint


class TrainActorDiedError(RuntimeError):
    """A train actor's process ended during the run."""


def resume_hint(save: str | None) -> str:
    """Which checkpoint to --load to continue the run."""
    folder = latest_checkpoint(save) if save else None
    if folder is not None:
        return f"resume with --load {save} (its latest complete checkpoint is {folder})"
    if save:
        return f"no checkpoint was completed under --save {save} yet; restart the run from the beginning"
    return "the run saved no checkpoint (no --save); pass --save and --save-interval to be able to resume"


PEER_DEATH_WAIT_S = 30.0  # how long a rank's error waits for Ray to report a peer's death behind it


def _dead_rank(refs: list, actors: list, timeout: float) -> tuple[int, Exception] | None:
    """(rank, error) of a rank whose actor died, among `refs`, waiting up to `timeout` for Ray to notice."""
    deadline = time.monotonic() + timeout
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            return None
        try:
            ray.get(ready[0])
        except ray.exceptions.RayActorError as exc:
            ids = [i for i, actor in enumerate(actors) if actor._actor_id.hex() == getattr(exc, "actor_id", None)]
            return (ids[0] if ids else refs.index(ready[0])), exc
        except Exception:  # noqa: BLE001 - a survivor's own error (e.g. its collective with the dead peer)
            continue
    return None


def get_from_ranks(refs: list, actors: list, role: str, save: str | None) -> list:
    """ray.get of one ObjectRef per rank (`actors[i]` computes `refs[i]`), in rank order. A rank whose actor died
    raises TrainActorDiedError naming it, at once, even when a survivor's collective failed first because of it."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(ready[0])
        except Exception as exc:
            dead = _dead_rank(refs, actors, timeout=0 if isinstance(exc, ray.exceptions.RayActorError)
                              else PEER_DEATH_WAIT_S)
            if dead is None:
                raise
            rank, error = dead
            text = str(error).strip()
            first_line = text.splitlines()[0][:300] if text else type(error).__name__
            raise TrainActorDiedError(
                f"train actor rank {rank} of the {role} group died ({first_line}); the run stops here: "
                f"{resume_hint(save)}") from None
    return ray.get(list(refs))
