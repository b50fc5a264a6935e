"""The verdict a dynamic-sampling filter returns for one group of samples, and the rule that turns it into "drop"
(slime's `slime.rollout.filter_hub.base_types`)."""

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


def call_dynamic_filter(fn, *args, **kwargs) -> DynamicFilterOutput:
    """Run a `--dynamic-sampling-filter-path` function (None keeps everything); a legacy bare bool comes back as a
    DynamicFilterOutput."""
    if fn is None:
        return DynamicFilterOutput(keep=True)
    output = fn(*args, **kwargs)
    return output if isinstance(output, DynamicFilterOutput) else DynamicFilterOutput(keep=bool(output))


def should_drop_dynamic_filter_output(output: DynamicFilterOutput, *, remaining_batch_size: int,
                                      target_data_size: int) -> bool:
    """Drop a rejected group, unless it may fill the batch (`keep_when_insufficient`) and the groups still in the
    running (accepted plus not yet judged, this one included: `remaining_batch_size`) are no more than the
    `target_data_size` wanted."""
    if output.keep:
        return False
    return not (output.keep_when_insufficient and remaining_batch_size <= target_data_size)
