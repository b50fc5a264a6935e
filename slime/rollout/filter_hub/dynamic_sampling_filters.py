"""Built-in `--dynamic-sampling-filter-path` functions: `fn(args, samples) -> DynamicFilterOutput` per group."""

from __future__ import annotations

import statistics

from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.utils.types import Sample

MIN_REWARD_STD = 1e-6


def _zero_std_reason(args, samples: list[Sample]) -> str | None:
    """None if the group's rewards vary (unbiased std > 1e-6), else "zero_std_<reward>"."""
    rewards = [float(sample.get_reward_value(args)) for sample in samples]
    if len(rewards) >= 2 and statistics.stdev(rewards) > MIN_REWARD_STD:
        return None
    return f"zero_std_{round(rewards[0], 1)}" if rewards else "zero_std_empty"


def check_reward_nonzero_std(args, samples: list[Sample]) -> DynamicFilterOutput:
    """DAPO dynamic sampling: keep a group only if its rewards are not all equal (otherwise its GRPO advantages are
    all zero and it carries no gradient). Uses `--reward-key` for dict rewards."""
    reason = _zero_std_reason(args, samples)
    return DynamicFilterOutput(keep=reason is None, reason=reason)


def check_reward_nonzero_std_with_fallback(args, samples: list[Sample]) -> DynamicFilterOutput:
    """`check_reward_nonzero_std`, but a dropped group may still fill the batch when over-sampling runs dry."""
    reason = _zero_std_reason(args, samples)
    return DynamicFilterOutput(keep=reason is None, reason=reason, keep_when_insufficient=True)
