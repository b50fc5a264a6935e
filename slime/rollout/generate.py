"""One sample or one group through the engines: sampling params from the flags, the `/generate` request (or the
custom generate function, or the multi-turn loop), reward scoring, and the per-rollout state they share.

The default rollout (sglang_rollout.py) and the evaluation rollout (eval.py) are both built from these; slime's
plugins import them by their old path, `slime.rollout.sglang_rollout`, which re-exports them. Not a rollout loop.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import operator
import uuid

from slime.rollout.dataset import prompt_token_ids, tokenizer_for
from slime.rollout.resend import post_generate
from slime.rollout.rm_hub import async_rm, batched_async_rm
from slime.rollout.routed_experts import routed_experts_request, store_routed_experts
from slime.rollout.sample_hooks import apply_rollout_sample_hooks
from slime.utils.engine_access import router_headers
from slime.utils.http_utils import router_url
from slime.utils.misc import load_function
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

_LOG_PROB, _TOKEN_ID = operator.itemgetter(0), operator.itemgetter(1)  # of an output_token_logprobs entry


DEFAULT_REQUEST_TIMEOUT_S = 14400.0
MULTI_TURN_GENERATE = "slime.rollout.multi_turn.generate"  # the generate function when --max-turns > 1


@functools.lru_cache(maxsize=32)
def load_hook(path: str, flag: str):
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


def is_scorable(samples: list[Sample]) -> bool:
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
    if not getattr(args, "group_rm", False) and is_scorable(samples):
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
        if not group_rm and is_scorable(group):
            await _score(args, group, state, batched=False)
    else:
        results = await asyncio.gather(*(generate_and_rm(args, s, sampling_params, state.evaluation, state=state)
                                         for s in group))
        group = _flatten(results)
    if group_rm and is_scorable(group):
        await _score(args, group, state, batched=True)
    return group
