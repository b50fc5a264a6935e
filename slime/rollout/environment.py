"""Gym-like environments for multi-turn rollouts that are not tool calls (games, interactive verifiers).

`--env-path pkg.module.make_env` names a callable `make_env(args)` returning an object with

    reset(sample) -> str | None                      first observation (None: the prompt alone starts the episode)
    step(action_text) -> (observation, reward, done, info)

(either method may be async). An observation is text, or, for a vision-language model, a dict
`{"text": str, "images": [path | file URL | base64 | PIL image, ...]}` whose text holds one `<image>` per image
(none: the images go before the text); the images join the sample's and are sent to the engine with the next turn.
After each assistant turn the rollout calls `step` with the turn's text; the
observation is rendered as a user message with the chat template (loss mask 0) and the model answers it, until
`done`, `--max-turns` or the context budget. The step rewards are summed into `sample.reward` unless a reward
function is also given. Not the tool-call path (`slime.rollout.tools`).
"""

from __future__ import annotations

import inspect

from slime.utils.misc import load_function


async def maybe_await(value):
    return await value if inspect.isawaitable(value) else value


def make_environment(args):
    """A fresh environment for one sample, or None when no --env-path is given."""
    path = args.env_path
    if not path:
        return None
    env = load_function(path, "--env-path")(args)
    for method in ("reset", "step"):
        if not callable(getattr(env, method, None)):
            raise ValueError(f"--env-path {path}: the environment has no {method}() method (see "
                             "slime.rollout.environment for the interface)")
    return env


def check_step_result(result, path: str):
    """(observation, reward, done, info) from env.step, or a ValueError naming what is wrong."""
    if not isinstance(result, tuple) or len(result) != 4:
        raise ValueError(f"--env-path {path}: step() must return (observation, reward, done, info), got {result!r}")
    observation, reward, done, info = result
    if isinstance(observation, dict):
        if not isinstance(observation.get("text"), str) or not isinstance(observation.get("images", []), list):
            raise ValueError(f"--env-path {path}: an observation dict must be {{'text': str, 'images': [...]}}, got "
                             f"keys {sorted(observation)}")
    elif observation is not None and not isinstance(observation, str):
        raise ValueError(f"--env-path {path}: the observation must be a string, a {{'text', 'images'}} dict or None, "
                         f"got {type(observation)}")
    return observation, float(reward or 0.0), bool(done), info or {}
