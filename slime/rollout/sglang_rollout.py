"""The default rollout: prompt groups -> /generate requests through the sglang-router -> scored Samples.

`generate_rollout(args, rollout_id, data_source, evaluation=False)` is the `--rollout-function-path` default.
Training: keep `--rollout-batch-size` groups in flight (fetched `--over-sampling-batch-size` at a time), score each
finished group, pass it through `--dynamic-sampling-filter-path`, and once enough groups are accepted abort the rest
on every engine; with `--partial-rollout` the half-generated groups go back to the data source's buffer and are
continued next time. Evaluation (`evaluation=True`) is in eval.py.

Training returns `RolloutFnTrainOutput(groups, metrics)`: the metrics (drop counts, reward failures, prefix-cache
hit rate) travel with the samples.

All asyncio runs on one background event loop (`http_utils.run`), so synchronous callers can call in.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import inspect
import logging
import operator
import time
import uuid

from tqdm import tqdm

from slime.rollout.base_types import RolloutFnTrainOutput
from slime.rollout.filter_hub.base_types import call_dynamic_filter, should_drop_dynamic_filter_output
from slime.rollout.dataset import prompt_token_ids, tokenizer_for
from slime.rollout.resend import post_generate
from slime.utils.http_utils import abort_all_requests, router_url, run
from slime.rollout.routed_experts import routed_experts_request, store_routed_experts
from slime.utils.engine_access import engine_admin_headers, router_headers
from slime.rollout.rm_hub import async_rm, batched_async_rm
from slime.rollout.sample_hooks import apply_rollout_sample_hooks
from slime.utils.misc import load_function
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

DEFAULT_REQUEST_TIMEOUT_S = 14400.0
MULTI_TURN_GENERATE = "slime.rollout.multi_turn.generate"  # the generate function when --max-turns > 1


@functools.lru_cache(maxsize=32)
def _load_hook(path: str, flag: str):
    return load_function(path, flag)


def _takes_evaluation(generate_fn) -> bool:
    """slime passes `evaluation=` to a generate function whose signature has that parameter."""
    return "evaluation" in inspect.signature(generate_fn).parameters


def build_sampling_params(args, evaluation: bool = False) -> dict:
    """SGLang sampling params from the `--rollout-*` flags (`--eval-*` first when evaluating)."""

    def pick(name: str):
        value = getattr(args, f"eval_{name}", None) if evaluation else None
        return value if value is not None else getattr(args, f"rollout_{name}", None)

    params = {
        "temperature": pick("temperature"),
        "top_p": pick("top_p"),
        "top_k": pick("top_k"),
        "max_new_tokens": pick("max_response_len"),
        "stop": pick("stop"),
        "stop_token_ids": pick("stop_token_ids"),
        "min_new_tokens": pick("min_new_tokens"),
        "skip_special_tokens": bool(getattr(args, "rollout_skip_special_tokens", False)),
        "no_stop_trim": True,
    }
    if params["max_new_tokens"] is None:
        raise ValueError("--rollout-max-response-len is required by the default rollout (max new tokens per sample)")
    return {key: value for key, value in params.items() if value is not None}


class GenerateState:
    """Per-call state shared by all requests of one rollout (slime's `GenerateState`, which generate functions
    build from args for its tokenizer and sampling params): the concurrency limit, the abort flag, which rollout
    this is (for the sample hooks), the tokenizer and the default sampling params."""

    def __init__(self, args, rollout_id: int | None = None, evaluation: bool = False):
        self.args = args
        num_engines = max(1, int(getattr(args, "rollout_num_engines", 1) or 1))
        self.concurrency = int(getattr(args, "sglang_server_concurrency", 512)) * num_engines
        self.semaphore = asyncio.Semaphore(self.concurrency)
        self.aborted = False
        self.url = router_url(args)
        self.num_reward_failures = 0
        self.rollout_id = rollout_id
        self.evaluation = evaluation
        self.processor = None  # no multimodal models here

    @functools.cached_property
    def tokenizer(self):
        return tokenizer_for(self.args)

    @functools.cached_property
    def sampling_params(self) -> dict:
        return build_sampling_params(self.args, evaluation=self.evaluation)


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    """One POST /generate for `sample`, continuing its response if it already has one (partial rollout).

    Same signature as a `--custom-generate-function-path` hook, which may wrap it.
    """
    if not sample.tokens:
        tokenizer = tokenizer_for(args)
        if tokenizer is None:
            raise ValueError("the default rollout needs --hf-checkpoint: its tokenizer turns prompts into token ids")
        sample.tokens = prompt_token_ids(tokenizer, sample)
    if sample.response_length and getattr(args, "partial_rollout", False):
        if getattr(args, "mask_offpolicy_in_partial_rollout", False):
            sample.loss_mask = [0] * sample.response_length  # the prefix came from older weights
    max_new_tokens = sampling_params["max_new_tokens"] - sample.response_length
    if max_new_tokens <= 0:
        sample.status = Sample.Status.TRUNCATED
        return sample
    await sample_continuation(args, sample, {**sampling_params, "max_new_tokens": max_new_tokens})
    return sample


async def sample_continuation(args, sample: Sample, sampling_params: dict) -> str:
    """One POST /generate continuing `sample.tokens`: appends the sampled ids (loss mask 1, the engine's log-probs)
    and the text, sets the status from the finish reason, counts prefix-cache hits; returns the text sampled."""
    routing = routed_experts_request(args, sample)
    payload = {"input_ids": sample.tokens, "sampling_params": sampling_params, "return_logprob": True, **routing}
    output = await _post_generate(args, payload, sample)
    return _append_output(args, sample, output, routing.get("routed_experts_start_len", 0))


async def _post_generate(args, payload: dict, sample: Sample):
    """POST /generate through the router, routed by the sample's session; under fault tolerance re-sent (counted
    on `sample`) while its engine is recovered."""
    timeout = getattr(args, "sglang_router_request_timeout_secs", None) or DEFAULT_REQUEST_TIMEOUT_S
    headers = {**router_headers(args), **({"X-SMG-Routing-Key": sample.session_id} if sample.session_id else {})}
    return await post_generate(args, f"{router_url(args)}/generate", payload, sample, timeout=timeout,
                               headers=headers)


_LOG_PROB, _TOKEN_ID = operator.itemgetter(0), operator.itemgetter(1)  # of an output_token_logprobs entry


def _append_output(args, sample: Sample, output: dict, routed_experts_start_len: int) -> str:
    """Apply one /generate result to `sample` (see sample_continuation); returns the text sampled."""
    meta = output.get("meta_info", {})
    logprob_items = meta.get("output_token_logprobs")
    if logprob_items is None:
        raise ValueError(f"{router_url(args)}/generate answered without meta_info.output_token_logprobs "
                         "(return_logprob was requested): not an SGLang-compatible engine?")
    text = output.get("text", "")
    # append_response_tokens makes them ints and floats
    sample.append_response_tokens(args, tokens=list(map(_TOKEN_ID, logprob_items)),
                                  log_probs=list(map(_LOG_PROB, logprob_items)), meta_info=meta, text=text)
    # The engine echoes the start it used (sglang-router 0.3.2 drops the field from the request).
    store_routed_experts(args, sample, meta, meta.get("routed_experts_start_len", routed_experts_start_len))
    return text


def group_prompt_ids(args, group: list[Sample]) -> list[int] | None:
    """The prompt ids of a group that one /generate with sampling_params.n can sample: fresh samples of one prompt
    that the default generate function would sample one by one (no generate hook, one turn, nothing generated yet,
    no per-sample hooks after generation). None when the group must go sample by sample."""
    if len(group) < 2 or getattr(args, "custom_generate_function_path", None) or (getattr(args, "max_turns", None)
                                                                                  or 1) > 1:
        return None
    if getattr(args, "rollout_sample_hook_path", None):
        return None
    if any(s.generate_function_path or s.tokens or s.response_length or s.status != Sample.Status.PENDING
           for s in group):
        return None
    if any(_prompt_key(s) != _prompt_key(group[0]) for s in group[1:]):
        return None
    tokenizer = tokenizer_for(args)
    if tokenizer is None:
        raise ValueError("the default rollout needs --hf-checkpoint: its tokenizer turns prompts into token ids")
    # Once per group, not per sample: a prompt through the chat template and the tokenizer costs milliseconds.
    return prompt_token_ids(tokenizer, group[0])


def _prompt_key(sample: Sample):
    """What a sample's prompt ids are made from (prompt_token_ids): the prompt and, for chat messages, the tools."""
    tools = sample.metadata.get("tools") if isinstance(sample.metadata, dict) else None
    return sample.prompt, tools


async def generate_group_in_one_request(args, group: list[Sample], prompt_ids: list[int], sampling_params: dict,
                                        state: GenerateState) -> None:
    """The group's n samples from one /generate with SGLang's sampling_params.n (one HTTP round trip and one
    response instead of n; the engine admits the copies together, so they share the prompt's KV blocks)."""
    async with state.semaphore:
        if state.aborted:
            for sample in group:
                sample.status = Sample.Status.ABORTED
            return
        for sample in group:
            sample.tokens = list(prompt_ids)
        payload = {"input_ids": prompt_ids, "sampling_params": {**sampling_params, "n": len(group)},
                   "return_logprob": True, **routed_experts_request(args, group[0])}  # R3: each sample's routing
        outputs = await _post_generate(args, payload, group[0])
    if not isinstance(outputs, list) or len(outputs) != len(group):
        raise RuntimeError(f"/generate with sampling_params.n={len(group)} answered {type(outputs).__name__} "
                           f"of {len(outputs) if isinstance(outputs, list) else 1} result(s); the engine must "
                           "support SGLang's parallel sampling")
    num_resends = group[0].metadata.get("num_resends")  # a re-sent request re-sends every sample of the group
    for sample, output in zip(group, outputs):
        if num_resends:
            sample.metadata["num_resends"] = num_resends
        _append_output(args, sample, output, routed_experts_start_len=0)


def _flatten(items) -> list[Sample]:
    return [s for item in items for s in (item if isinstance(item, list) else [item])]


def _is_scorable(samples: list[Sample]) -> bool:
    return all(s.status != Sample.Status.ABORTED for s in samples)


async def _score(args, samples: list[Sample], state: GenerateState, batched: bool) -> None:
    """Fill missing rewards via rm_hub; a sample whose reward function failed counts in state.num_reward_failures."""
    todo = [s for s in samples if s.reward is None]
    if not todo:
        return
    if batched:
        rewards = await batched_async_rm(args, todo)
    else:
        rewards = await asyncio.gather(*(async_rm(args, s) for s in todo))
    for sample, reward in zip(todo, rewards):
        sample.reward = reward
        if sample.metadata.get("reward_error"):
            state.num_reward_failures += 1


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
            hook_path = sample.generate_function_path or getattr(args, "custom_generate_function_path", None)
            if hook_path is None and (getattr(args, "max_turns", None) or 1) > 1:
                hook_path = MULTI_TURN_GENERATE
            # paths were checked at start-up with their flag's name (validate_args); this imports the module once
            generate_fn = load_function(hook_path) if hook_path else generate
            kwargs = {"evaluation": evaluation} if _takes_evaluation(generate_fn) else {}
            sample = await generate_fn(args, sample, dict(sampling_params), **kwargs)  # a copy: hooks edit theirs
        sample = await apply_rollout_sample_hooks(args, sample, **hook_kwargs)
    samples = sample if isinstance(sample, list) else [sample]
    if len(samples) > 1 and any(s.rollout_id is None for s in samples):
        shared = next((s.rollout_id for s in samples if s.rollout_id is not None), None)
        shared = shared if shared is not None else uuid.uuid4().int >> 65  # fan-out siblings: one rollout
        for s in samples:
            s.rollout_id = shared
    if not getattr(args, "group_rm", False) and _is_scorable(samples):
        await _score(args, samples, state, batched=isinstance(sample, list))
    return sample


async def generate_group(args, group: list[Sample], sampling_params: dict, state: GenerateState) -> list[Sample]:
    """Generate and score one prompt group; the members share a session id (router affinity key)."""
    session_id = uuid.uuid4().hex
    for sample in group:
        sample.session_id = sample.session_id or session_id
    group_rm = bool(getattr(args, "group_rm", False))
    prompt_ids = group_prompt_ids(args, group)
    if prompt_ids is not None:
        await generate_group_in_one_request(args, group, prompt_ids, sampling_params, state)
        if not group_rm and _is_scorable(group):
            await _score(args, group, state, batched=False)
    else:
        results = await asyncio.gather(*(generate_and_rm(args, s, sampling_params, state.evaluation, state=state)
                                         for s in group))
        group = _flatten(results)
    if group_rm and _is_scorable(group):
        await _score(args, group, state, batched=True)
    return group


async def _generate_rollout_async(args, rollout_id: int, data_source) -> tuple[list[list[Sample]], dict]:
    state = GenerateState(args, rollout_id=rollout_id)
    sampling_params = build_sampling_params(args)
    target = int(args.rollout_batch_size)
    over_sampling = int(getattr(args, "over_sampling_batch_size", None) or target)
    filter_path = getattr(args, "dynamic_sampling_filter_path", None)
    dynamic_filter = _load_hook(filter_path, "--dynamic-sampling-filter-path") if filter_path else None

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
                if not _is_scorable(group):  # aborted on the engine side (e.g. a weight update): try again later
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
        _load_hook(args.rollout_sample_filter_path, "--rollout-sample-filter-path")(args, accepted)
    if getattr(args, "rollout_all_samples_process_path", None):
        _load_hook(args.rollout_all_samples_process_path, "--rollout-all-samples-process-path")(
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
