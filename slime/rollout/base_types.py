"""What a `--rollout-function-path` / `--eval-function-path` function returns (slime's `slime.rollout.base_types`).

Training: `RolloutFnTrainOutput(samples, metrics)`, samples a list of groups (each a list of Samples) or a flat
list; evaluation: `RolloutFnEvalOutput(data, metrics)`, data {dataset name: {"rewards", "truncated", "samples"}}.
Metrics (`rollout/...` or `eval/...` keys) travel with the result as values, so the caller needs nothing from the
function's module. Legacy functions that return the bare list or dict are accepted (`split_rollout_output`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class RolloutFnTrainOutput:
    samples: list
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


def split_rollout_output(result) -> tuple[Any, dict[str, Any]]:
    """(samples or eval data, metrics) of any rollout function's return value, typed or legacy."""
    if isinstance(result, RolloutFnTrainOutput):
        return result.samples, dict(result.metrics or {})
    if isinstance(result, RolloutFnEvalOutput):
        return result.data, dict(result.metrics or {})
    return result, {}
