"""Rewards of finished samples through rm_hub (one by one, or per group with `--group-rm`)."""

from __future__ import annotations

import asyncio

from slime.rollout.rm_hub import async_rm, batched_async_rm
from slime.utils.types import Sample


def is_scorable(samples: list[Sample]) -> bool:
    """A group is scored and trained unless the engine aborted one of its samples (the group is generated again).
    A sample its generate function gave up on and marked `remove_sample` (a coding agent whose sandbox or harness
    failed) does not hold its group back: it stays out of the group's statistics and of training
    (slime.ray.train_data). A group with nothing but such samples is not scorable."""
    aborted = [s for s in samples if s.status == Sample.Status.ABORTED]
    return all(s.remove_sample for s in aborted) and len(aborted) < len(samples)


async def score_samples(args, samples: list[Sample], state, batched: bool) -> None:
    """Fill missing rewards via rm_hub; a sample whose reward function failed counts in the rollout's GenerateState
    `state.num_reward_failures`."""
    todo = [s for s in samples if s.reward is None]
    if not todo:
        return
    if batched:
        rewards = await batched_async_rm(args, todo)
    else:
        rewards = await asyncio.gather(*(async_rm(args, s) for s in todo))
    for sample, reward in zip(todo, rewards):
        sample.reward = reward
        if sample.metadata.get("reward_error"):
            state.num_reward_failures += 1
