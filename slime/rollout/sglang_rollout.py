"""The default rollout: prompt groups -> /generate requests through the sglang-router -> scored Samples.

`generate_rollout(args, rollout_id, data_source, evaluation=False)` is the `--rollout-function-path` default.
Training: keep `--rollout-batch-size` groups in flight (fetched `--over-sampling-batch-size` at a time), score each
finished group, pass it through `--dynamic-sampling-filter-path`, and once enough groups are accepted abort the rest
on every engine; with `--partial-rollout` the half-generated groups go back to the data source's buffer and are
continued next time. Evaluation (`evaluation=True`, `eval_rollout`): n responses for every prompt of every eval
dataset (`--eval-config` or `--eval-prompt-data`) with that dataset's settings, returned as
`{name: {"rewards", "truncated", "samples"}}`, samples ordered by prompt then sample (what pass@k takes).

One request's pieces are in generate_request.py and scoring in scoring.py; `GenerateState`, `generate`,
`generate_and_rm` and `generate_group` stay here, where slime's plugins and tests import and patch them.

Training returns `RolloutFnTrainOutput(groups, metrics)`: the metrics (drop counts, reward failures, prefix-cache
hit rate) travel with the samples.

All asyncio runs on one background event loop (`http_utils.run`), so synchronous callers can call in.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import functools
import logging
import time
import uuid

from tqdm import tqdm

from slime.rollout.base_types import RolloutFnTrainOutput
from slime.rollout.dataset import EvalDataset, load_eval_datasets, load_processor, prompt_token_ids, tokenizer_for
from slime.rollout.deterministic_seeds import with_sample_seed
from slime.rollout.filter_hub.base_types import call_dynamic_filter, should_drop_dynamic_filter_output
from slime.rollout.generate_request import (
    build_sampling_params,
    encode_multimodal_prompt,
    generate_group_in_one_request,
    group_prompt_ids,
    load_hook,
    sample_continuation,
    takes_evaluation,
)
from slime.rollout.sample_hooks import apply_rollout_sample_hooks
from slime.rollout.scoring import is_scorable, score_samples
from slime.utils.engine_access import engine_admin_headers, router_headers
from slime.utils.eval_config import EvalDatasetConfig
from slime.utils.http_utils import abort_all_requests, router_url, run
from slime.utils.misc import load_function
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

MULTI_TURN_GENERATE = "slime.rollout.multi_turn.generate"  # the generate function when --max-turns > 1


class GenerateState:
    """Per-call state shared by all requests of one rollout (slime's `GenerateState`, which generate functions
    build from args for its tokenizer and sampling params): the concurrency limit, the abort flag, which rollout
    this is (for the sample hooks), the tokenizer and the default sampling params."""

    def __init__(self, args, rollout_id: int | None = None, evaluation: bool = False):
        self.args = args
        self.concurrency = args.sglang_server_concurrency * args.rollout_num_engines
        self.semaphore = asyncio.Semaphore(self.concurrency)
        self.aborted = False
        self.url = router_url(args)
        self.num_reward_failures = 0
        self.rollout_id = rollout_id
        self.evaluation = evaluation

    @functools.cached_property
    def tokenizer(self):
        return tokenizer_for(self.args)

    @functools.cached_property
    def processor(self):
        """slime's state.processor: the vision-language checkpoint's processor with --multimodal-keys, else None."""
        return load_processor(str(self.args.hf_checkpoint)) if self.args.multimodal_keys else None

    @functools.cached_property
    def sampling_params(self) -> dict:
        return build_sampling_params(self.args, evaluation=self.evaluation)


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    """One POST /generate for `sample`, continuing its response if it already has one (partial rollout).

    Same signature as a `--custom-generate-function-path` hook, which may wrap it.
    """
    if sample.multimodal_inputs:
        if sample.multimodal_train_inputs is None or not sample.tokens:  # (a restored partial sample: the first)
            encode_multimodal_prompt(args, sample)
    elif not sample.tokens:
        tokenizer = tokenizer_for(args)
        if tokenizer is None:
            raise ValueError("the default rollout needs --hf-checkpoint: its tokenizer turns prompts into token ids")
        sample.tokens = prompt_token_ids(tokenizer, sample)
    if sample.response_length and (args.partial_rollout or args.fully_async):  # continuing a cut response
        if args.mask_offpolicy_in_partial_rollout:
            sample.loss_mask = [0] * sample.response_length  # the prefix came from older weights
    max_new_tokens = sampling_params["max_new_tokens"] - sample.response_length
    if max_new_tokens <= 0:
        sample.status = Sample.Status.TRUNCATED
        return sample
    await sample_continuation(args, sample, {**sampling_params, "max_new_tokens": max_new_tokens})
    return sample






def _flatten(items) -> list[Sample]:
    return [s for item in items for s in (item if isinstance(item, list) else [item])]



async def generate_and_rm(args, sample: Sample, sampling_params: dict, evaluation: bool = False, *,
                          state: GenerateState | None = None):
    """Generate (unless finished in an earlier rollout), then score unless rewards are computed per group
    (`--group-rm`). slime's signature: a plugin may call it as slime's rollout does; `state` is the calling
    rollout's (its concurrency limit, abort flag and rollout id), a fresh one without it (slime keeps one per
    process), and the sample hooks' rollout id then falls back to `set_current_rollout_id`'s."""
    hook_kwargs = {"evaluation": evaluation} if state is None else {"evaluation": evaluation,
                                                                    "rollout_id": state.rollout_id}
    state = state if state is not None else GenerateState(args)
    if sample.status not in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED):
        async with state.semaphore:
            if state.aborted:
                sample.status = Sample.Status.ABORTED
                return sample
            hook_path = sample.generate_function_path or args.custom_generate_function_path
            # slime's plugins may pass args without this flag
            if hook_path is None and getattr(args, "max_turns", 1) > 1:
                hook_path = MULTI_TURN_GENERATE
            # paths were checked at start-up with their flag's name (validate_args); this imports the module once
            generate_fn = load_function(hook_path) if hook_path else generate
            kwargs = {"evaluation": evaluation} if takes_evaluation(generate_fn) else {}
            if getattr(args, "deterministic_mode", False):  # slime's plugins may pass args without the flag
                sampling_params = with_sample_seed(args, sampling_params, state.rollout_id, sample.index)
            sample = await generate_fn(args, sample, dict(sampling_params), **kwargs)  # a copy: hooks edit theirs
        sample = await apply_rollout_sample_hooks(args, sample, **hook_kwargs)
    samples = sample if isinstance(sample, list) else [sample]
    if len(samples) > 1 and any(s.rollout_id is None for s in samples):
        shared = next((s.rollout_id for s in samples if s.rollout_id is not None), None)
        shared = shared if shared is not None else uuid.uuid4().int >> 65  # fan-out siblings: one rollout
        for s in samples:
            s.rollout_id = shared
    if not args.group_rm and is_scorable(samples):
        await score_samples(args, samples, state, batched=isinstance(sample, list))
    return sample


async def generate_group(args, group: list[Sample], sampling_params: dict, state: GenerateState) -> list[Sample]:
    """Generate and score one prompt group. Each member gets its own session id, as in slime (the router's
    affinity key, and the agent examples' session key: two members of a group are two sessions)."""
    # --deterministic-mode: the routing key (and what the dumps record) is a function of the sample, not random
    deterministic = getattr(args, "deterministic_mode", False)
    for position, sample in enumerate(group):
        if sample.session_id is None:
            sample.session_id = (f"{state.rollout_id}-{group[0].index}-{position}" if deterministic
                                 else uuid.uuid4().hex)
    group_rm = args.group_rm
    prompt_ids = group_prompt_ids(args, group)
    if prompt_ids is not None:
        if deterministic:
            sampling_params = with_sample_seed(args, sampling_params, state.rollout_id, group[0].index)
        await generate_group_in_one_request(args, group, prompt_ids, sampling_params, state)
        if not group_rm and is_scorable(group):
            await score_samples(args, group, state, batched=False)
    else:
        results = await asyncio.gather(*(generate_and_rm(args, s, sampling_params, state.evaluation, state=state)
                                         for s in group))
        group = _flatten(results)
    if group_rm and is_scorable(group):
        await score_samples(args, group, state, batched=True)
    return group


async def _generate_rollout_async(args, rollout_id: int, data_source) -> tuple[list[list[Sample]], dict]:
    state = GenerateState(args, rollout_id=rollout_id)
    sampling_params = build_sampling_params(args)
    target = int(args.rollout_batch_size)
    over_sampling = args.over_sampling_batch_size
    filter_path = args.dynamic_sampling_filter_path
    dynamic_filter = load_hook(filter_path, "--dynamic-sampling-filter-path") if filter_path else None

    accepted: list[list[Sample]] = []
    leftovers: list[list[Sample]] = []
    returned: list[list[Sample]] = []  # every group that came back: accepted, dropped or unfinished
    drop_counts: collections.Counter = collections.Counter()
    num_groups_fetched = num_kept_when_insufficient = 0
    pending: set[asyncio.Task] = set()
    started, first_group_at, last_group_at = time.perf_counter(), None, None
    progress = tqdm(total=target, desc=f"rollout {rollout_id}", unit="group", mininterval=2.0, leave=False,
                    disable=args.no_progress)
    try:
        while len(accepted) < target:
            while len(accepted) + len(pending) < target:
                groups = data_source.get_samples(over_sampling)
                if not groups:
                    if not pending:
                        raise RuntimeError(
                            f"the data source ran out of prompt groups with {len(accepted)} of {target} accepted"
                        )
                    break
                num_groups_fetched += len(groups)
                pending |= {asyncio.create_task(generate_group(args, g, sampling_params, state)) for g in groups}
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            last_group_at = time.perf_counter() - started
            first_group_at = last_group_at if first_group_at is None else first_group_at
            done = sorted(done, key=lambda t: t.result()[0].index)  # deterministic among simultaneous finishes
            for position, task in enumerate(done):
                group = task.result()
                returned.append(group)
                if not is_scorable(group):  # aborted on the engine side (e.g. a weight update): try again later
                    leftovers.append(group)
                    continue
                verdict = call_dynamic_filter(dynamic_filter, args, group)
                num_unjudged = len(pending) + len(done) - position - 1  # still running or not yet judged
                if should_drop_dynamic_filter_output(verdict, remaining_batch_size=len(accepted) + num_unjudged + 1,  # +1: this group
                                                     target_data_size=target):
                    drop_counts[verdict.reason or "filtered"] += 1
                    continue
                num_kept_when_insufficient += not verdict.keep
                accepted.append(group)
                progress.update(1)
        num_in_flight = len(pending)
        if pending:
            state.aborted = True  # requests still waiting for the semaphore will not be sent
            await abort_all_requests(state.url, router_headers(args), engine_admin_headers(args))
            unfinished = await asyncio.gather(*pending)
            leftovers += unfinished
            returned += unfinished
            pending = set()
    finally:
        progress.close()
        for task in pending:
            task.cancel()

    leftovers = sorted(leftovers + accepted[target:], key=lambda g: g[0].index)
    accepted = sorted(accepted[:target], key=lambda g: g[0].index)
    num_returned = 0
    if args.partial_rollout:
        group_size = args.n_samples_per_prompt
        returnable = [g for g in leftovers if len(g) == group_size]  # hooks that return several samples can't resume
        for group in returnable:
            for sample in group:
                sample.metadata.setdefault("start_rollout_id", rollout_id)
        data_source.add_samples(returnable)
        num_returned = len(returnable)

    if args.rollout_sample_filter_path:  # marks Sample.remove_sample on what not to train on
        load_hook(args.rollout_sample_filter_path, "--rollout-sample-filter-path")(args, accepted)
    if args.rollout_all_samples_process_path:
        load_hook(args.rollout_all_samples_process_path, "--rollout-all-samples-process-path")(
            args, sorted(returned, key=lambda g: g[0].index), data_source)

    samples = [s for g in accepted for s in g]
    prompt_tokens = sum(s.prefix_cache_info.total_prompt_tokens for s in samples)
    cached_tokens = sum(s.prefix_cache_info.cached_tokens for s in samples)
    metrics = {
        "rollout/num_groups_fetched": num_groups_fetched,
        "rollout/num_groups_aborted": num_in_flight,
        "rollout/num_groups_returned_to_buffer": num_returned,
        "rollout/dynamic_filter/num_dropped": sum(drop_counts.values()),
        "rollout/dynamic_filter/num_kept_when_insufficient": num_kept_when_insufficient,
        "rollout/reward_failures": state.num_reward_failures,
        "rollout/prefix_cache_hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        # from the rollout function's start: the first and the last group back (generated and scored)
        "perf/rollout_first_group_time": first_group_at, "perf/rollout_last_group_time": last_group_at,
    }
    metrics.update({f"rollout/dynamic_filter/drop_{reason}": count for reason, count in drop_counts.items()})
    return accepted, metrics


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False):
    """Training: `RolloutFnTrainOutput` of `--rollout-batch-size` accepted groups (list[list[Sample]], sorted by
    index) and the rollout's metrics. Evaluation: {dataset name: {"rewards", "truncated", "samples"}} (`eval_rollout`)."""
    if evaluation:
        return eval_rollout(args, rollout_id)
    groups, metrics = run(_generate_rollout_async(args, rollout_id, data_source))
    return RolloutFnTrainOutput(groups, metrics)


_dataset_cache: dict[tuple, list[EvalDataset]] = {}


def _eval_reward_value(args, sample: Sample) -> float:
    reward = sample.reward
    if isinstance(reward, dict):
        key = args.eval_reward_key or args.reward_key
        if key is None or key not in reward:
            raise ValueError(f"eval reward is a dict with keys {sorted(reward)}; pick one with --eval-reward-key")
        reward = reward[key]
    return float(reward) if reward is not None else 0.0


def _cached_eval_datasets(args) -> list[EvalDataset]:
    key = (tuple(repr(c) for c in args.eval_datasets), args.hf_checkpoint)
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
