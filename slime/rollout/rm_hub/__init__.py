"""Reward functions: pick one per sample and run it so that a failing or hanging reward cannot stall a rollout.

Which reward runs, first match wins: `sample.custom_rm_path` > `--custom-rm-path` > `sample.metadata["rm_type"]` >
`--rm-type`. Built-in types: math, deepscaler, dapo, f1, gpqa, remote_rm, random, and `boxed_<type>` (grade the
content of the response's last `\\boxed{}` with <type>). Custom rewards are `async def fn(args, sample)` (or
`fn(args, samples)` with `--group-rm`); plain functions also work and run in a thread. A reward that reads no
label sets `fn.uses_label = False`, so rows without `--label-key` are accepted (`reward_uses_labels`).

Robustness: each reward computation is bounded by `args.reward_timeout` seconds (default 30). An exception or a
timeout gives the sample `args.reward_failure_value` (default 0.0) and records the error text in
`sample.metadata["reward_error"]`; the rollout keeps going. A configuration mistake (unknown rm type, bad hook
path, no reward configured) raises ValueError instead. Only awaiting code can be interrupted: an async reward that
blocks the event loop cannot be bounded, and a plain function that hangs keeps its worker thread busy.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random

from slime.rollout.rm_hub.answer_parsing import last_boxed_content
from slime.rollout.rm_hub.f1 import f1_reward
from slime.rollout.rm_hub.gpqa import compute_gpqa_reward
from slime.rollout.rm_hub.math_rewards import dapo_reward, deepscaler_reward, math_reward
from slime.rollout.rm_hub.remote_rm import request_remote_reward
from slime.utils.daemon_threads import DaemonThreadPool
from slime.utils.misc import load_function
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

RM_TYPES = ("math", "deepscaler", "dapo", "f1", "gpqa", "remote_rm", "random")
LABEL_FREE_RM_TYPES = ("random",)
BOXED_PREFIX = "boxed_"
DEFAULT_REWARD_TIMEOUT_S = 30.0
DEFAULT_FAILURE_REWARD = 0.0

# Plain (non-async) custom reward functions run here, not in the event loop's default executor, so that a hung
# call never blocks `asyncio.run` from returning; daemon threads, so that it never blocks the process's exit either.
_sync_reward_threads = DaemonThreadPool(max_workers=8, thread_name_prefix="slime-reward")


_GROUP_FAILED = object()  # sentinel: the group reward call failed (its error is already recorded)


def _check_rm_type(args, rm_type: str | None) -> str:
    if rm_type is None:
        raise ValueError(
            "no reward configured: pass --rm-type (one of " + ", ".join(RM_TYPES) + ", or boxed_<type>), "
            "--custom-rm-path, or set metadata['rm_type'] on the sample"
        )
    base = rm_type[len(BOXED_PREFIX):] if rm_type.startswith(BOXED_PREFIX) else rm_type
    if base not in RM_TYPES:
        raise ValueError(f"unknown rm_type {rm_type!r} (--rm-type); valid: {', '.join(RM_TYPES)}, or boxed_<type>")
    if base == "remote_rm" and not args.rm_url:
        raise ValueError("--rm-type remote_rm needs --rm-url")
    return rm_type


def reward_uses_labels(args) -> bool:
    """Whether the configured reward reads `Sample.label`: a custom reward says it does not with a function
    attribute `uses_label = False`; of the built-in types only `random` does not."""
    custom_path = args.custom_rm_path
    if custom_path:
        return bool(getattr(load_function(custom_path, "--custom-rm-path"), "uses_label", True))
    rm_type = args.rm_type or ""
    return rm_type.removeprefix(BOXED_PREFIX) not in LABEL_FREE_RM_TYPES


async def _builtin_reward(args, sample: Sample, rm_type: str):
    response, label = sample.response, sample.label
    if rm_type.startswith(BOXED_PREFIX):
        response = last_boxed_content(response) or ""
        rm_type = rm_type[len(BOXED_PREFIX):]
    if rm_type == "math":
        return await math_reward(response, label)
    if rm_type == "deepscaler":
        return await deepscaler_reward(response, label)
    if rm_type == "dapo":
        return dapo_reward(response, label)
    if rm_type == "f1":
        return f1_reward(response, label)
    if rm_type == "gpqa":
        return compute_gpqa_reward(response, label, sample.metadata)
    if rm_type == "remote_rm":
        payload = {"prompt": sample.prompt, "response": response, "label": label}
        return await request_remote_reward(args.rm_url, payload, budget_s=args.reward_timeout)
    return float(random.randint(0, 1))  # "random"


async def _call_custom(fn, args, arg):
    if inspect.iscoroutinefunction(fn):
        return await fn(args, arg)
    loop = asyncio.get_running_loop()
    result = await loop.run_in_executor(_sync_reward_threads, fn, args, arg)
    return await result if inspect.isawaitable(result) else result


async def _bounded(args, samples: list[Sample], make_coroutine, failure):
    """Await `make_coroutine()` within the reward timeout; on any error record it on the samples and return
    `failure`."""
    # slime's plugins may pass args without this flag
    timeout = getattr(args, "reward_timeout", DEFAULT_REWARD_TIMEOUT_S)
    try:
        result = await asyncio.wait_for(make_coroutine(), timeout)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - any reward failure becomes the failure reward, by design
        if isinstance(exc, TimeoutError) and not str(exc):
            error = f"TimeoutError: reward took longer than {timeout}s (--reward-timeout)"
        else:
            error = f"{type(exc).__name__}: {exc}"
        for sample in samples:
            sample.metadata["reward_error"] = error
        logger.warning("reward failed for sample(s) %s: %s", [s.index for s in samples], error)
        return failure
    for sample in samples:  # a re-scored sample must not keep the error of an earlier attempt
        sample.metadata.pop("reward_error", None)
    return result


def _failure_reward(args) -> float:
    # slime's plugins may pass args without this flag
    return float(getattr(args, "reward_failure_value", DEFAULT_FAILURE_REWARD))


async def async_rm(args, sample: Sample) -> float | dict:
    """The reward of one sample (a float, or a dict for dapo / dict-returning custom or remote rewards)."""
    custom_path = sample.custom_rm_path or args.custom_rm_path
    if custom_path:
        flag = "sample.custom_rm_path" if sample.custom_rm_path else "--custom-rm-path"
        fn = load_function(custom_path, flag)
        return await _bounded(args, [sample], lambda: _call_custom(fn, args, sample), _failure_reward(args))
    rm_type = _check_rm_type(args, sample.metadata.get("rm_type") or args.rm_type)
    return await _bounded(args, [sample], lambda: _builtin_reward(args, sample, rm_type), _failure_reward(args))


async def batched_async_rm(args, samples: list[Sample]) -> list:
    """Rewards of a list of samples, in order.

    With `--group-rm` and `--custom-rm-path` (and no per-sample override) the custom function gets the whole list
    once, `fn(args, samples) -> list`, under one timeout; otherwise every sample goes through `async_rm`
    concurrently.
    """
    group_path = args.custom_rm_path
    if args.group_rm and group_path and not any(s.custom_rm_path for s in samples):
        fn = load_function(group_path, "--custom-rm-path")
        failure = _failure_reward(args)
        rewards = await _bounded(args, samples, lambda: _call_custom(fn, args, samples), _GROUP_FAILED)
        if rewards is _GROUP_FAILED:
            return [failure] * len(samples)
        if not isinstance(rewards, (list, tuple)) or len(rewards) != len(samples):
            got = f"{len(rewards)} rewards" if isinstance(rewards, (list, tuple)) else type(rewards).__name__
            raise ValueError(
                f"--custom-rm-path {group_path} with --group-rm must return a list of {len(samples)} rewards "
                f"(one per sample), got {got}"
            )
        return list(rewards)
    return list(await asyncio.gather(*(async_rm(args, sample) for sample in samples)))


__all__ = ["RM_TYPES", "async_rm", "batched_async_rm", "reward_uses_labels"]
