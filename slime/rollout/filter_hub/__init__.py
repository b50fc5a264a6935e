"""Group filters for the rollout loop (`--dynamic-sampling-filter-path`)."""

from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.rollout.filter_hub.dynamic_sampling_filters import (
    check_reward_nonzero_std,
    check_reward_nonzero_std_with_fallback,
)

__all__ = ["DynamicFilterOutput", "check_reward_nonzero_std", "check_reward_nonzero_std_with_fallback"]
