"""Samples -> train data: reward post-processing, the per-sample lists the trainer reads, the split over
data-parallel ranks, and the rollout metrics. Pure Python + torch, no Ray, so it tests on its own.

Group normalisation uses each Sample's explicit `group_index`, never its position in the batch.
"""

from __future__ import annotations

import collections
import itertools
import statistics
from collections import defaultdict

import torch

from slime.rollout.eval_metrics import compute_pass_at_k
from slime.utils.flops_balance import linear_coefficient, workloads
from slime.utils.hf_config import hf_text_config
from slime.utils.misc import load_function
from slime.utils.ppo_utils import compute_rloo_advantages, group_mean_std
from slime.utils.train_data_types import TrainData
from slime.utils.types import Sample, Status

GROUP_NORMALISED_ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
GROUP_STD_EPS = 1e-6  # as normalize_group_rewards


def post_process_rewards(args, samples: list[Sample]) -> tuple[list[float], list[float]]:
    """Return (raw rewards, the rewards the advantage uses); `--custom-reward-post-process-path` replaces this."""
    if args.custom_reward_post_process_path:
        raw, rewards = load_function(args.custom_reward_post_process_path,
                                     "--custom-reward-post-process-path")(args, samples)
        if len(raw) != len(samples) or len(rewards) != len(samples):
            raise ValueError(f"--custom-reward-post-process-path: returned {len(raw)} raw rewards and {len(rewards)} "
                             f"rewards for {len(samples)} samples")
        return [float(r) for r in raw], [float(r) for r in rewards]
    raw = [float(s.get_reward_value(args)) for s in samples]
    if not samples:
        return raw, raw
    # Group statistics count each rollout once: the siblings of a fan-out (one prompt sample that became several
    # Samples sharing a rollout_id) enter with their mean reward; each sibling is then scored against them.
    # A rollout whose samples are all `remove_sample` (its sandbox or harness failed: no reward was measured) is no
    # member of its group: it gets a group of its own, so it moves no other rollout's mean or std (its advantage is 0).
    rollout_of_key: dict = {}
    first_groups = []
    of_sample_list = []
    removed_rollouts: dict[int, bool] = {}
    for i, s in enumerate(samples):
        key = s.rollout_id if s.rollout_id is not None else ("sample", i)
        rollout = rollout_of_key.setdefault(key, len(rollout_of_key))
        if rollout == len(first_groups):
            first_groups.append(_group_of(s))
        of_sample_list.append(rollout)
        removed_rollouts[rollout] = removed_rollouts.get(rollout, True) and s.remove_sample
    lone_group = min(first_groups) - 1
    for rollout, removed in removed_rollouts.items():
        if removed:
            first_groups[rollout], lone_group = lone_group, lone_group - 1
    of_sample = torch.tensor(of_sample_list)
    rewards = torch.tensor(raw, dtype=torch.float64)
    rollout_sizes = torch.bincount(of_sample, minlength=len(first_groups))
    rollout_rewards = torch.zeros(len(first_groups), dtype=torch.float64).index_add_(0, of_sample, rewards)
    rollout_rewards /= rollout_sizes
    group_ids = torch.tensor(first_groups)
    if args.advantage_estimator == "rloo":
        baselines = rollout_rewards - compute_rloo_advantages(rollout_rewards, group_ids)
        return raw, (rewards - baselines[of_sample]).tolist()
    if args.advantage_estimator in GROUP_NORMALISED_ESTIMATORS and args.rewards_normalization:
        means, stds = group_mean_std(rollout_rewards, group_ids)
        centred = rewards - means[of_sample]
        std_normalize = args.grpo_std_normalization and args.advantage_estimator in ("grpo", "gspo", "cispo")
        return raw, (centred / (stds[of_sample] + GROUP_STD_EPS) if std_normalize else centred).tolist()
    return raw, raw


def _group_of(sample: Sample) -> int:
    return sample.group_index if sample.group_index is not None else -1


CONVERTED_KEYS = ("tokens", "response_lengths", "loss_masks", "rewards", "raw_reward")  # a custom conversion's


def samples_to_train_data(args, samples: list[Sample]) -> TrainData:
    """The per-sample lists the trainer reads; `--custom-convert-samples-to-train-data-path` may build them
    (`fn(args, samples) -> dict` with at least CONVERTED_KEYS; the per-rollout sums are filled in when absent)."""
    if args.custom_convert_samples_to_train_data_path:
        data = load_function(args.custom_convert_samples_to_train_data_path,
                             "--custom-convert-samples-to-train-data-path")(args, samples)
        missing = [key for key in CONVERTED_KEYS if key not in data]
        if missing:
            raise ValueError(f"--custom-convert-samples-to-train-data-path: the train data lacks {missing}")
        data.setdefault("group_indices", [s.group_index for s in samples])
        data.setdefault("sample_indices", [s.index for s in samples])
        data.setdefault("truncated", [int(s.status == Status.TRUNCATED) for s in samples])
        data.setdefault("rollout_ids", [s.rollout_id for s in samples])
        data.setdefault("rollout_mask_sums", _rollout_mask_sums(samples, data["loss_masks"]))
        data.setdefault("rollout_num_samples", _rollout_sizes(samples))
        return data
    raw, rewards = post_process_rewards(args, samples)
    loss_masks = []
    for s in samples:
        mask = _as_list(s.loss_mask) if s.loss_mask is not None else [1] * s.response_length
        if len(mask) != s.response_length:
            raise ValueError(f"sample {s.index}: loss_mask has {len(mask)} entries, response_length is "
                             f"{s.response_length}; a custom rollout must keep them aligned")
        loss_masks.append([0] * len(mask) if s.remove_sample else mask)
    data = {
        "tokens": [_as_list(s.tokens) for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "loss_masks": loss_masks,
        "rewards": rewards,
        "raw_reward": raw,
        "group_indices": [s.group_index for s in samples],
        "sample_indices": [s.index for s in samples],
        "truncated": [int(s.status == Status.TRUNCATED) for s in samples],
        "rollout_ids": [s.rollout_id for s in samples],
        "rollout_mask_sums": _rollout_mask_sums(samples, loss_masks),
        "rollout_num_samples": _rollout_sizes(samples),
    }
    if samples and all(s.rollout_log_probs is not None for s in samples):
        data["rollout_log_probs"] = [_as_list(s.rollout_log_probs) for s in samples]
    if samples and all(s.weight_versions for s in samples):
        data["weight_versions"] = [s.weight_versions[-1] for s in samples]  # the weights that finished it
    if samples and all(s.teacher_log_probs is not None for s in samples):
        data["teacher_log_probs"] = [_as_list(s.teacher_log_probs) for s in samples]
    if any(s.rollout_routed_experts is not None for s in samples):
        data["rollout_routed_experts"] = [_routed_experts_of(s) for s in samples]
    if any(s.multimodal_train_inputs for s in samples):  # vision-language: each sample's pixels and grids, or None
        data["multimodal_train_inputs"] = [s.multimodal_train_inputs or None for s in samples]
    return data


def _as_list(values) -> list:
    """The sample's own list, not a copy (the train data leaves the process through ray.put, which copies it); any
    other sequence as a list."""
    return values if type(values) is list else list(values)


def _routed_experts_of(sample: Sample):
    """R3: the sample's engine routing, one row per position but the last (a clear error names a bad sample)."""
    routed = sample.rollout_routed_experts
    name = f"sample {sample.index} (group {sample.group_index})"
    if routed is None:
        raise ValueError(f"{name} has no rollout_routed_experts while others of the rollout do (a custom rollout / "
                         "generate function must keep the engine's meta_info['routed_experts'], see "
                         "slime.rollout.routed_experts.store_routed_experts)")
    if routed.ndim != 3 or len(routed) != len(sample.tokens) - 1:
        raise ValueError(f"{name}: rollout_routed_experts has shape {tuple(routed.shape)}, expected "
                         f"[len(tokens) - 1 = {len(sample.tokens) - 1}, num_hidden_layers, top_k]")
    return routed


def assign_rollout_ids(samples: list[Sample]) -> None:
    """Give every sample without a `rollout_id` its own (slime: "fill missing rollout_id with unused ints"); samples
    that already share one (fan-out siblings) keep it. Not the rollout step: that is the train data's `rollout_id`."""
    taken = {s.rollout_id for s in samples if s.rollout_id is not None}
    fresh = (i for i in itertools.count() if i not in taken)
    for s in samples:
        if s.rollout_id is None:
            s.rollout_id = next(fresh)


def _rollout_mask_sums(samples: list[Sample], loss_masks: list[list[int]]) -> list[float]:
    """Per sample, the loss-mask total of every sample of its rollout (siblings share one per-token mean)."""
    totals: dict = defaultdict(float)
    for s, mask in zip(samples, loss_masks):
        totals[s.rollout_id] += sum(mask)
    return [totals[s.rollout_id] if s.rollout_id is not None else float(sum(mask))
            for s, mask in zip(samples, loss_masks)]


def _rollout_sizes(samples: list[Sample]) -> list[int]:
    """Per sample, how many samples its rollout has (1 unless a generate function fanned out)."""
    sizes = collections.Counter(s.rollout_id for s in samples)
    return [sizes[s.rollout_id] if s.rollout_id is not None else 1 for s in samples]


def data_parallel_rank(args, rank: int) -> int:
    """The data-parallel rank of trainer process `rank`: Megatron's rank order (tensor, context, expert, data,
    pipeline from fastest to slowest) puts the tensor and context peers of one replica next to each other, and
    its pipeline stages dp x tp x cp apart; every process of a replica trains on the same data. With the FSDP
    backend every process is its own data-parallel rank."""
    replica_width = args.tensor_model_parallel_size * args.context_parallel_size
    return (rank // replica_width) % args.data_parallel_size


def split_train_data(args, data: TrainData, rollout_id: int) -> tuple[list[TrainData], int]:
    """Split into one dict per data-parallel rank, step by step, so every rank holds the same number of samples
    of every optimizer step. Returns (per-rank dicts, number of samples dropped to make the split even); the
    train group hands dict `data_parallel_rank(args, rank)` to process `rank`."""
    num_samples = len(data["tokens"])
    dp_size = args.data_parallel_size
    num_steps = args.num_steps_per_rollout
    per_rank_per_step = num_samples // (num_steps * dp_size)
    if per_rank_per_step == 0:
        raise ValueError(f"rollout {rollout_id} produced {num_samples} samples, fewer than "
                         f"num_steps_per_rollout ({num_steps}) x data-parallel ranks ({dp_size})")
    global_batch_size = per_rank_per_step * dp_size
    used = global_batch_size * num_steps
    per_rank = [defaultdict(list) for _ in range(dp_size)]
    coefficient = linear_coefficient(hf_text_config(args)) if args.balance_by_flops else None
    for step in range(num_steps):
        step_indices = list(range(step * global_batch_size, (step + 1) * global_batch_size))
        if args.balance_data:
            lengths = [len(data["tokens"][i]) for i in step_indices]
            if args.balance_by_flops:
                lengths = workloads(lengths, coefficient)
            ranks = balanced_equal_partition(lengths, dp_size)
        else:
            ranks = [list(range(r * per_rank_per_step, (r + 1) * per_rank_per_step)) for r in range(dp_size)]
        for rank, members in enumerate(ranks):
            for key, values in data.items():
                per_rank[rank][key].extend(values[step_indices[i]] for i in members)
    out = []
    for rank_data in per_rank:
        rank_data = dict(rank_data)
        rank_data.update(rollout_id=rollout_id, num_steps_per_rollout=num_steps, global_batch_size=global_batch_size)
        out.append(rank_data)
    return out, num_samples - used


def balanced_equal_partition(lengths: list[float], num_parts: int) -> list[list[int]]:
    """--balance-data: split indices into `num_parts` equal-size parts with token sums (--balance-by-flops: FLOPs
    workloads) as even as possible
    (largest first, each to the part with the smallest sum that still has room); each part in index order."""
    size = len(lengths) // num_parts
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    sums = [0] * num_parts
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        part = min((p for p in range(num_parts) if len(parts[p]) < size), key=lambda p: (sums[p], p))
        parts[part].append(i)
        sums[part] += lengths[i]
    return [sorted(part) for part in parts]


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
    prompt_tokens = sum(s.prefix_cache_info.total_prompt_tokens for s in samples)
    if prompt_tokens:
        cached = sum(s.prefix_cache_info.cached_tokens for s in samples)
        metrics["rollout/prefix_cache_hit_rate"] = cached / prompt_tokens
    groups = defaultdict(list)
    for s, r in zip(samples, raw_rewards):
        groups[s.group_index].append(r)
    metrics["rollout/zero_std_groups"] = sum(1 for g in groups.values() if len(g) > 1 and max(g) == min(g))
    metrics.update(multi_turn_metrics(samples))
    metrics.update(optional_rollout_metrics(args, samples, raw_rewards, list(groups.values())))
    return metrics


def optional_rollout_metrics(args, samples: list[Sample], raw_rewards: list[float], groups: list[list[float]]) -> dict:
    """--log-passrate (pass@2^k over each group, a reward > 0 counts as passed), --log-reward-category KEY (mean
    reward per value of metadata[KEY]), --log-correct-samples (response length of the samples with reward > 0)."""

    metrics = {}
    if args.log_passrate and groups:
        k = 1
        while k <= min(len(g) for g in groups):
            metrics[f"rollout/pass@{k}"] = compute_pass_at_k(groups, k)
            k *= 2
    if args.log_reward_category:
        by_category = defaultdict(list)
        for s, r in zip(samples, raw_rewards):
            by_category[str(s.metadata.get(args.log_reward_category))].append(r)
        metrics.update({f"rollout/reward_category/{c}": statistics.fmean(v) for c, v in sorted(by_category.items())})
    if args.log_correct_samples:
        correct = [s.response_length for s, r in zip(samples, raw_rewards) if r > 0]
        metrics["rollout/correct_samples"] = len(correct)
        if correct:
            metrics["rollout/correct_response_len/mean"] = statistics.fmean(correct)
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
