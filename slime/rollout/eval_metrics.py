"""The metrics of evaluation results and of a rollout's groups: mean reward, truncated ratio, and the unbiased pass@k
estimator. Pure functions of rewards and samples; the rollout manager logs what they return."""

from __future__ import annotations

import math

from slime.utils.types import Sample


def compute_pass_at_k(rewards_per_prompt: list[list[float]], k: int) -> float:
    """Mean over prompts of the unbiased pass@k estimate 1 - C(n - c, k) / C(n, k) (Chen et al., 2021),
    where n is the number of samples of the prompt and c how many have reward > 0."""
    if not rewards_per_prompt:
        raise ValueError("compute_pass_at_k needs at least one prompt")
    total = 0.0
    for rewards in rewards_per_prompt:
        n, c = len(rewards), sum(1 for r in rewards if r > 0)
        if not 1 <= k <= n:
            raise ValueError(f"pass@{k} needs 1 <= k <= samples per prompt ({n})")
        total += 1.0 - math.comb(n - c, k) / math.comb(n, k)
    return total / len(rewards_per_prompt)


def eval_metrics(name: str, samples: list[Sample], rewards: list[float], n_per_prompt: int) -> dict:
    """eval/NAME (mean reward), eval/NAME-truncated_ratio and eval/NAME-pass@k for k = 1, 2, 4, ... up to the
    smallest number of samples of a prompt."""
    metrics = {f"eval/{name}": sum(rewards) / max(len(rewards), 1)}
    if samples:
        metrics[f"eval/{name}-truncated_ratio"] = sum(s.status.value == "truncated" for s in samples) / len(samples)
    by_prompt: dict = {}
    for s, r in zip(samples, rewards):
        by_prompt.setdefault(s.group_index, []).append(r)
    k = 1
    while by_prompt and k <= min(len(rs) for rs in by_prompt.values()):
        metrics[f"eval/{name}-pass@{k}"] = compute_pass_at_k(list(by_prompt.values()), k)
        k *= 2
    return metrics
