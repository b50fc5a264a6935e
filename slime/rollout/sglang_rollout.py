"""The default rollout: prompt groups -> /generate requests through the sglang-router -> scored Samples.

`generate_rollout(args, rollout_id, data_source, evaluation=False)` is the `--rollout-function-path` default.
Training: keep `--rollout-batch-size` groups in flight (fetched `--over-sampling-batch-size` at a time), score each
finished group, pass it through `--dynamic-sampling-filter-path`, and once enough groups are accepted abort the rest
on every engine; with `--partial-rollout` the half-generated groups go back to the data source's buffer and are
continued next time. Evaluation (`evaluation=True`) is in eval.py; one sample's or one group's generation and
scoring in generate.py.

Training returns `RolloutFnTrainOutput(groups, metrics)`: the metrics (drop counts, reward failures, prefix-cache
hit rate) travel with the samples.

All asyncio runs on one background event loop (`http_utils.run`), so synchronous callers can call in.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from tqdm import tqdm

from slime.rollout.base_types import RolloutFnTrainOutput
# slime's plugins import the generation helpers from here (their path in slime): re-exported from generate.py.
from slime.rollout.generate import (  # noqa: F401
    DEFAULT_REQUEST_TIMEOUT_S,
    GenerateState,
    _append_output,
    build_sampling_params,
    generate,
    generate_and_rm,
    generate_group,
    group_prompt_ids,
    is_scorable,
    load_hook,
    sample_continuation,
)
from slime.rollout.filter_hub.base_types import call_dynamic_filter, should_drop_dynamic_filter_output
from slime.utils.http_utils import abort_all_requests, run
from slime.utils.engine_access import engine_admin_headers, router_headers
from slime.utils.types import Sample

logger = logging.getLogger(__name__)





async def _generate_rollout_async(args, rollout_id: int, data_source) -> tuple[list[list[Sample]], dict]:
    state = GenerateState(args, rollout_id=rollout_id)
    sampling_params = build_sampling_params(args)
    target = int(args.rollout_batch_size)
    over_sampling = int(getattr(args, "over_sampling_batch_size", None) or target)
    filter_path = getattr(args, "dynamic_sampling_filter_path", None)
    dynamic_filter = load_hook(filter_path, "--dynamic-sampling-filter-path") if filter_path else None

    accepted: list[list[Sample]] = []
    leftovers: list[list[Sample]] = []
    returned: list[list[Sample]] = []  # every group that came back: accepted, dropped or unfinished
    drop_counts: collections.Counter = collections.Counter()
    num_groups_fetched = num_kept_when_insufficient = 0
    pending: set[asyncio.Task] = set()
    started, first_group_at, last_group_at = time.perf_counter(), None, None
    progress = tqdm(total=target, desc=f"rollout {rollout_id}", unit="group", mininterval=2.0, leave=False,
                    disable=bool(getattr(args, "no_progress", False)))
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
    if getattr(args, "partial_rollout", False):
        group_size = int(getattr(args, "n_samples_per_prompt", 1) or 1)
        returnable = [g for g in leftovers if len(g) == group_size]  # hooks that return several samples can't resume
        for group in returnable:
            for sample in group:
                sample.metadata.setdefault("start_rollout_id", rollout_id)
        data_source.add_samples(returnable)
        num_returned = len(returnable)

    if getattr(args, "rollout_sample_filter_path", None):  # marks Sample.remove_sample on what not to train on
        load_hook(args.rollout_sample_filter_path, "--rollout-sample-filter-path")(args, accepted)
    if getattr(args, "rollout_all_samples_process_path", None):
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
    index) and the rollout's metrics. Evaluation: {dataset name: {"rewards", "truncated", "samples"}} (eval.py)."""
    if evaluation:
        from slime.rollout.eval import eval_rollout

        return eval_rollout(args, rollout_id)
    groups, metrics = run(_generate_rollout_async(args, rollout_id, data_source))
    return RolloutFnTrainOutput(groups, metrics)
