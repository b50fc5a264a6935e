"""The coding-agent rollout's own metrics, added to metrics.jsonl next to the default ones:

    --custom-rollout-log-function-path examples.coding_agent_rl.metrics.log_rollout

Per rollout (an episode = one sample's session; its fork siblings count once): `agent/episodes`,
`agent/sandbox_failures` (episodes that came back ABORTED with an abort_reason: not trained, not scored),
`agent/turns_per_episode`, `agent/tool_calls_per_episode`, `agent/tests_solved` (share of graded episodes whose
hidden tests all passed), `agent/tests_passed_ratio` (passed / run hidden tests, where the grader counts them),
`agent/episode_seconds`, `agent/tokens_per_episode` (prompt and sampled tokens of its model calls),
`agent/trained_tokens_per_episode`, `agent/prefix_cache_hit_rate` (cached / prompt tokens of the agent's calls).
Not the default rollout metrics (slime.ray.train_data.rollout_metrics), which still run.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from slime.utils.types import Sample


def episode_metrics(samples: list[Sample]) -> dict[str, float]:
    episodes: dict = defaultdict(list)
    for sample in samples:
        episodes[sample.session_id or ("sample", sample.group_index, sample.index)].append(sample)
    failed = [group for group in episodes.values() if group[0].metadata.get("abort_reason")]
    done = [group for group in episodes.values() if not group[0].metadata.get("abort_reason")]
    metrics = {"agent/episodes": float(len(episodes)), "agent/sandbox_failures": float(len(failed))}
    if not done:
        return metrics
    stats = [[turn for s in group for turn in s.metadata.get("turn_stats", [])] for group in done]
    prompt_tokens = sum(t["prompt_tokens"] for turns in stats for t in turns)
    cached_tokens = sum(t["cached_tokens"] for turns in stats for t in turns)
    passed = [s.metadata["tests_passed"] for s in (g[0] for g in done) if s.metadata.get("tests_passed")]
    metrics.update({
        "agent/turns_per_episode": statistics.fmean(len(turns) for turns in stats),
        "agent/tool_calls_per_episode": statistics.fmean(sum(t["tool_calls"] for t in turns) for turns in stats),
        "agent/tests_solved": statistics.fmean(float(g[0].metadata.get("grading_solved", False)) for g in done),
        "agent/episode_seconds": statistics.fmean(g[0].metadata.get("episode_seconds", 0.0) for g in done),
        "agent/tokens_per_episode": statistics.fmean(sum(t["prompt_tokens"] + t["output_tokens"] for t in turns)
                                                     for turns in stats),
        "agent/trained_tokens_per_episode": statistics.fmean(sum(sum(s.loss_mask or []) for s in g) for g in done),
        "agent/prefix_cache_hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
    })
    if passed:
        metrics["agent/tests_passed_ratio"] = sum(p for p, _ in passed) / max(sum(n for _, n in passed), 1)
    return metrics


def log_rollout(rollout_id, args, samples: list[Sample], extra_metrics: dict, rollout_time: float) -> bool:
    """Adds episode_metrics to the rollout's metrics; False: the default rollout log runs too."""
    extra_metrics.update(episode_metrics(samples))
    return False
