"""Samples -> train data: reward post-processing, the per-sample lists the trainer reads, the split over
data-parallel ranks, and the rollout metrics. Pure Python + torch, no Ray, so it tests on its own.

Group normalisation uses each Sample's explicit `group_index`, never its position in the batch.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

import torch

from slime.utils.ppo_utils import compute_rloo_advantages, normalize_group_rewards
from slime.utils.types import Sample, Status

GROUP_NORMALISED_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus_baseline")


def post_process_rewards(args, samples: list[Sample]) -> tuple[list[float], list[float]]:
    """Return (raw rewards, the rewards the advantage uses)."""
    raw = [s.get_reward_value(args) for s in samples]
    if not samples:
        return raw, raw
    group_ids = torch.tensor([s.group_index if s.group_index is not None else -1 for s in samples])
    rewards = torch.tensor(raw, dtype=torch.float64)
    if args.advantage_estimator == "rloo":
        return raw, compute_rloo_advantages(rewards, group_ids).tolist()
    if args.advantage_estimator in GROUP_NORMALISED_ESTIMATORS and args.rewards_normalization:
        std_normalize = args.grpo_std_normalization and args.advantage_estimator in ("grpo", "gspo")
        return raw, normalize_group_rewards(rewards, group_ids, std_normalize=std_normalize).tolist()
    return raw, raw


def samples_to_train_data(args, samples: list[Sample]) -> dict:
    raw, rewards = post_process_rewards(args, samples)
    loss_masks = []
    for s in samples:
        mask = list(s.loss_mask) if s.loss_mask is not None else [1] * s.response_length
        if len(mask) != s.response_length:
            raise ValueError(f"sample {s.index}: loss_mask has {len(mask)} entries, response_length is "
                             f"{s.response_length}; a custom rollout must keep them aligned")
        loss_masks.append([0] * len(mask) if s.remove_sample else mask)
    data = {
        "tokens": [list(s.tokens) for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "loss_masks": loss_masks,
        "rewards": rewards,
        "raw_reward": raw,
        "group_indices": [s.group_index for s in samples],
        "sample_indices": [s.index for s in samples],
        "truncated": [int(s.status == Status.TRUNCATED) for s in samples],
    }
    if samples and all(s.rollout_log_probs is not None for s in samples):
        data["rollout_log_probs"] = [list(s.rollout_log_probs) for s in samples]
    if samples and all(s.weight_versions for s in samples):
        data["weight_versions"] = [s.weight_versions[-1] for s in samples]  # the weights that finished it
    if samples and all(s.teacher_log_probs is not None for s in samples):
        data["teacher_log_probs"] = [list(s.teacher_log_probs) for s in samples]
    return data


def split_train_data(args, data: dict, rollout_id: int) -> tuple[list[dict], int]:
    """Split into one dict per data-parallel rank, step by step, so every rank holds the same number of samples
    of every optimizer step. Returns (per-rank dicts, number of samples dropped to make the split even)."""
    num_samples = len(data["tokens"])
    dp_size = args.world_size
    num_steps = args.num_steps_per_rollout
    per_rank_per_step = num_samples // (num_steps * dp_size)
    if per_rank_per_step == 0:
        raise ValueError(f"rollout {rollout_id} produced {num_samples} samples, fewer than "
                         f"num_steps_per_rollout ({num_steps}) x trainer processes ({dp_size})")
    global_batch_size = per_rank_per_step * dp_size
    used = global_batch_size * num_steps
    per_rank = [defaultdict(list) for _ in range(dp_size)]
    for step in range(num_steps):
        for rank in range(dp_size):
            start = step * global_batch_size + rank * per_rank_per_step
            for key, values in data.items():
                per_rank[rank][key].extend(values[start:start + per_rank_per_step])
    out = []
    for rank_data in per_rank:
        rank_data = dict(rank_data)
        rank_data.update(rollout_id=rollout_id, num_steps_per_rollout=num_steps, global_batch_size=global_batch_size)
        out.append(rank_data)
    return out, num_samples - used


def rollout_metrics(args, samples: list[Sample], raw_rewards: list[float]) -> dict:
    if not samples:
        return {}
    lengths = [s.response_length for s in samples]
    metrics = {
        "rollout/raw_reward": statistics.fmean(raw_rewards),
        "rollout/num_samples": len(samples),
        "rollout/response_len/mean": statistics.fmean(lengths),
        "rollout/response_len/max": max(lengths),
        "rollout/response_len/min": min(lengths),
        "rollout/truncated_ratio": statistics.fmean(float(s.status == Status.TRUNCATED) for s in samples),
        "rollout/aborted_ratio": statistics.fmean(float(s.status == Status.ABORTED) for s in samples),
        "rollout/reward_failures": sum(1 for s in samples if "reward_error" in s.metadata),
    }
    prompt_tokens = sum(s.prefix_cache_info.get("prompt_tokens", 0) for s in samples)
    if prompt_tokens:
        cached = sum(s.prefix_cache_info.get("cached_tokens", 0) for s in samples)
        metrics["rollout/prefix_cache_hit_rate"] = cached / prompt_tokens
    groups = defaultdict(list)
    for s, r in zip(samples, raw_rewards):
        groups[s.group_index].append(r)
    metrics["rollout/zero_std_groups"] = sum(1 for g in groups.values() if len(g) > 1 and max(g) == min(g))
    metrics.update(multi_turn_metrics(samples))
    return metrics


def multi_turn_metrics(samples: list[Sample]) -> dict:
    """Per-sample means of what slime.rollout.multi_turn recorded in sample.metadata["multi_turn"]."""
    states = [s.metadata["multi_turn"] for s in samples if isinstance(s.metadata.get("multi_turn"), dict)]
    if not states:
        return {}
    turn_lengths = [n for state in states for n in state["turn_lengths"]]
    num_calls = sum(state["tool_calls"] for state in states)
    return {
        "rollout/turns_per_sample": statistics.fmean(state["turns"] for state in states),
        "rollout/tool_calls_per_sample": num_calls / len(states),
        "rollout/tool_errors_per_sample": statistics.fmean(state["tool_errors"] for state in states),
        "rollout/tool_latency_s": sum(state["tool_seconds"] for state in states) / max(num_calls, 1),
        "rollout/cut_by_context_ratio": statistics.fmean(float(state["cut_by_context"]) for state in states),
        "rollout/turn_response_len/mean": statistics.fmean(turn_lengths) if turn_lengths else 0.0,
    }
