"""What a `--rollout-function-path` / `--eval-function-path` function returns (slime's `slime.rollout.base_types`).

Training: `RolloutFnTrainOutput(samples, metrics)`, samples a list of groups (each a list of Samples) or a flat
list; evaluation: `RolloutFnEvalOutput(data, metrics)`, data {dataset name: {"rewards", "truncated", "samples"}}.
Metrics (`rollout/...` or `eval/...` keys) travel with the result as values, so the caller needs nothing from the
function's module. Legacy functions that return the bare list or dict are accepted (`call_rollout_fn`).
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


def call_rollout_fn(fn, *args, evaluation: bool, **kwargs) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """Call a rollout function (slime's `call_rollout_fn`); a legacy bare list / dict comes back typed."""
    output = fn(*args, **kwargs, evaluation=evaluation)
    if not isinstance(output, (RolloutFnTrainOutput, RolloutFnEvalOutput)):
        output = RolloutFnEvalOutput(data=output) if evaluation else RolloutFnTrainOutput(samples=output)
    return output
