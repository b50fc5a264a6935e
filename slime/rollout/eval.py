"""Evaluation rollouts of the default rollout function, and the pass@k estimator.

`eval_rollout(args, rollout_id)` generates n responses for every prompt of every eval dataset (`--eval-config` or
`--eval-prompt-data`, slime.config.eval_datasets) with that dataset's settings (its own, else `eval.defaults`, else
`--eval-*`, else `--rollout-*`), scores them, and returns
`{name: {"rewards": [...], "truncated": [...], "samples": [...]}}`, samples ordered by prompt then sample, so
`rewards[i * n : (i + 1) * n]` are the n rewards of prompt i (what `compute_pass_at_k` takes).
"""

from __future__ import annotations

import asyncio
import copy

from slime.rollout.dataset import EvalDataset, load_eval_datasets
from slime.rollout.generate import GenerateState, build_sampling_params, generate_group
from slime.config.eval_datasets import EvalDatasetConfig, resolve_eval_datasets
from slime.utils.http_utils import run
from slime.utils.types import Sample

_dataset_cache: dict[tuple, list[EvalDataset]] = {}



def _eval_reward_value(args, sample: Sample) -> float:
    reward = sample.reward
    if isinstance(reward, dict):
        key = getattr(args, "eval_reward_key", None) or getattr(args, "reward_key", None)
        if key is None or key not in reward:
            raise ValueError(f"eval reward is a dict with keys {sorted(reward)}; pick one with --eval-reward-key")
        reward = reward[key]
    return float(reward) if reward is not None else 0.0


def _cached_eval_datasets(args) -> list[EvalDataset]:
    configs = args.eval_datasets if hasattr(args, "eval_datasets") else resolve_eval_datasets(args)
    key = (tuple(repr(c) for c in configs), getattr(args, "hf_checkpoint", None))
    if key not in _dataset_cache:
        _dataset_cache[key] = load_eval_datasets(args)
    return _dataset_cache[key]


def dataset_sampling_params(args, config: EvalDatasetConfig) -> dict:
    """The eval sampling params with the dataset's own settings (already resolved against the flags)."""
    params = build_sampling_params(args, evaluation=True)
    params.update({"temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k,
                   "max_new_tokens": config.max_response_len, "stop": config.stop,
                   "stop_token_ids": config.stop_token_ids, "min_new_tokens": config.min_new_tokens,
                   "skip_special_tokens": config.skip_special_tokens, "no_stop_trim": config.no_stop_trim})
    return {key: value for key, value in params.items() if value is not None}


async def _eval_dataset(args, dataset: EvalDataset, state: GenerateState) -> dict:
    sampling_params = dataset_sampling_params(args, dataset.config)
    n = int(dataset.config.n_samples_per_eval_prompt or 1)
    groups = []
    for prompt_index, prompt in enumerate(dataset.samples):
        group = []
        for j in range(n):
            sample = copy.deepcopy(prompt)
            sample.group_index, sample.index = prompt_index, prompt_index * n + j
            group.append(sample)
        groups.append(group)
    results = await asyncio.gather(*(generate_group(args, g, sampling_params, state) for g in groups))
    samples = [s for group in results for s in group]
    return {
        "rewards": [_eval_reward_value(args, s) for s in samples],
        "truncated": [s.status == Sample.Status.TRUNCATED for s in samples],
        "samples": samples,
    }


async def _eval_rollout_async(args, rollout_id: int) -> dict:
    datasets = _cached_eval_datasets(args)
    if not datasets:
        raise ValueError("evaluation needs --eval-prompt-data (name path [name path ...])")
    state = GenerateState(args, rollout_id=rollout_id, evaluation=True)
    results = await asyncio.gather(*(_eval_dataset(args, d, state) for d in datasets))
    return {dataset.name: result for dataset, result in zip(datasets, results)}


def eval_rollout(args, rollout_id: int) -> dict:
    return run(_eval_rollout_async(args, rollout_id))
