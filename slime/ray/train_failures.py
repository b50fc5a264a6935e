"""A trainer process that dies stops the run with an error naming its rank and the checkpoint to resume from.

The ranks of a train group run collectives together, so when one dies the others wait for it forever: the driver
waits for the ranks' results one at a time as they come (`get_from_ranks`) and raises `TrainActorDiedError` at the
first dead one, instead of Ray's `ActorDiedError` (whose text suggests the OOM killer) or a hang. There is no
restart of trainer processes: a run resumes from its last checkpoint with `--load`.
"""

from __future__ import annotations

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


def get_from_ranks(refs: list, actors: list, role: str, save: str | None) -> list:
    """ray.get of one ObjectRef per rank (`actors[i]` computes `refs[i]`), in rank order; a rank whose actor died
    raises TrainActorDiedError at once, naming it."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(ready[0])
        except ray.exceptions.RayActorError as exc:
            rank = refs.index(ready[0])
            dead = [i for i, actor in enumerate(actors) if actor._actor_id.hex() == getattr(exc, "actor_id", None)]
            rank = dead[0] if dead else rank
            first_line = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            raise TrainActorDiedError(
                f"train actor rank {rank} of the {role} group died ({first_line}); the run stops here: "
                f"{resume_hint(save)}") from None
    return ray.get(list(refs))
