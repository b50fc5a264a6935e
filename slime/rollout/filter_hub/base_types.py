"""The verdict a dynamic-sampling filter returns for one group of samples."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DynamicFilterOutput:
    """`keep`: whether the group is used for training. `reason`: why it was dropped (counted in the metric
    `rollout/dynamic_filter/drop_<reason>`). `keep_when_insufficient`: keep a dropped group anyway when
    over-sampling cannot fill the batch any more."""

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False
