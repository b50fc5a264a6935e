"""Staleness of trained tokens: how many policy versions lie between the weights that sampled a token and the
weights trained on it. Pure functions of Samples (no I/O, no torch).

A token's version is `Sample.token_weight_versions` (one per response token, None for tokens the policy did not
sample); a Sample without it (an engine that reports versions per response only) counts every token at the oldest
of its `weight_versions`. Only tokens with loss mask 1 count: masked tokens are not trained.
"""

from __future__ import annotations

from dataclasses import dataclass

from slime.utils.types import Sample


@dataclass(frozen=True)
class Staleness:
    max: int
    mean: float
    num_tokens: int
    max_versions_per_sample: int  # distinct versions among one sample's trained tokens


def trained_token_versions(sample: Sample) -> list[int]:
    """The policy version of each trained (loss mask 1) response token of `sample`."""
    mask = sample.loss_mask if sample.loss_mask is not None else [1] * sample.response_length
    versions = sample.token_weight_versions
    if versions is None:
        if not sample.weight_versions:
            raise ValueError(f"sample {sample.index} records no weight version: the engine must report "
                             "meta_info.weight_version")
        oldest = min(int(v) for v in sample.weight_versions)
        return [oldest] * sum(1 for m in mask if m)
    missing = [i for i, (m, v) in enumerate(zip(mask, versions)) if m and v is None]
    if missing:
        raise ValueError(f"sample {sample.index}: trained response token {missing[0]} has no weight version")
    return [int(v) for m, v in zip(mask, versions) if m]


def batch_staleness(samples: list[Sample], trained_version: int) -> Staleness:
    """Staleness of every trained token of `samples` when the weights of `trained_version` train on them."""
    lags, max_versions = [], 0
    for sample in samples:
        versions = trained_token_versions(sample)
        lags.extend(trained_version - v for v in versions)
        max_versions = max(max_versions, len(set(versions)))
    if not lags:
        return Staleness(0, 0.0, 0, 0)
    return Staleness(max(lags), sum(lags) / len(lags), len(lags), max_versions)
