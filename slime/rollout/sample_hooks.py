"""`--rollout-sample-hook-path` (slime's `slime.rollout.sample_hooks`): user functions run on every generated
sample, in order, before its reward.

A hook is `[async] fn(args, sample, *, rollout_id=None, evaluation=False) -> Sample | None` (None keeps the sample;
keyword arguments it does not declare are not passed). `apply_rollout_sample_hooks` keeps the shape of what it is
given (a Sample, or nested lists of them). The rollout passes `rollout_id` and `evaluation` explicitly;
`set_current_rollout_id` is slime's way for code that calls the hooks without them (its value is the fallback).
"""

from __future__ import annotations

import inspect
from typing import Any

from slime.utils.misc import load_function
from slime.utils.types import Sample

_current_rollout_id: int | None = None  # slime's API: the fallback rollout id of apply_rollout_sample_hooks


def set_current_rollout_id(rollout_id: int | None) -> None:
    global _current_rollout_id
    _current_rollout_id = rollout_id


def _accepted_kwargs(function, kwargs: dict[str, Any]) -> dict[str, Any]:
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return kwargs
    names = {p.name for p in parameters}
    return {key: value for key, value in kwargs.items() if key in names}


async def _apply(args, sample: Sample, paths: list[str], kwargs: dict) -> Sample:
    for path in paths:
        hook = load_function(path, "--rollout-sample-hook-path")
        result = hook(args, sample, **_accepted_kwargs(hook, kwargs))
        if inspect.isawaitable(result):
            result = await result
        if result is not None:
            if not isinstance(result, Sample):
                raise TypeError(f"--rollout-sample-hook-path {path}: returned {type(result).__name__}, "
                                "expected Sample or None")
            sample = result
    return sample


async def apply_rollout_sample_hooks(args, value, **kwargs):
    """Run the configured hooks on every Sample in `value` (a Sample or nested lists), keeping its shape."""
    paths = getattr(args, "rollout_sample_hook_path", None)  # slime's plugins may pass args without this flag
    if not paths:
        return value
    kwargs.setdefault("rollout_id", _current_rollout_id)
    if isinstance(value, Sample):
        return await _apply(args, value, paths, kwargs)
    if isinstance(value, list):
        return [await apply_rollout_sample_hooks(args, item, **kwargs) for item in value]
    raise TypeError(f"rollout sample hooks take a Sample or a list of them, got {type(value).__name__}")
