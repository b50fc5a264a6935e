"""slime's --megatron-config-path: a YAML of per-role overrides of the Megatron trainer's args,

    megatron:
      - name: default
        role: actor
        overrides: {lr: 1e-6, recompute_granularity: full}
      - name: default
        role: critic
        overrides: {lr: 1e-5}

(`args:` is accepted for `overrides:`, as slime). The actor's train processes run with the command line's args
plus the `role: actor` entry's overrides, the PPO critic's with the `role: critic` entry's (a string given for a
numeric flag is converted, as slime does for YAML's `1e-6`); the driver and the rollout keep the command line's.
The critic entry's `lr` is the critic's learning rate (this project's --critic-lr, which it overrides).
`num_nodes` / `num_gpus_per_node` are ignored (the command line places the processes), and the parallel layout
flags refused: the rollout data is split for the command line's layout.

Not --custom-config-path (custom_config.py: extra attributes for plugins, set everywhere).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import yaml

logger = logging.getLogger(__name__)

IGNORED_KEYS = ("num_nodes", "num_gpus_per_node")
LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
               "expert_model_parallel_size", "expert_tensor_parallel_size", "data_parallel_size",
               "actor_num_nodes", "actor_num_gpus_per_node", "train_backend")


def role_overrides(args, path: str, role: str) -> dict:
    """The overrides of `role`'s entry ({} without one), checked against args; ValueError naming the problem."""
    where = f"--megatron-config-path {path}"
    try:
        config = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    entries = config.get("megatron") if isinstance(config, dict) else None
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise ValueError(f"{where}: needs a top-level 'megatron' list of entries, e.g. "
                         "megatron: [{name: default, role: actor, overrides: {lr: 1e-6}}]")
    for entry in entries:
        if entry.get("role") not in ("actor", "critic"):
            raise ValueError(f"{where}: entry {entry.get('name')!r} has role {entry.get('role')!r}; "
                             "use role: actor or role: critic")
    matching = [entry for entry in entries if entry["role"] == role]
    if len(matching) > 1:
        raise ValueError(f"{where}: {len(matching)} entries with role: {role}; give at most one")
    if not matching:
        return {}
    overrides = matching[0].get("overrides") or matching[0].get("args") or {}
    if not isinstance(overrides, dict):
        raise ValueError(f"{where}: the {role} entry's overrides must be a mapping of flag: value")
    checked = {}
    for key, value in overrides.items():
        key = str(key).replace("-", "_")
        if key in IGNORED_KEYS:
            logger.info("%s: ignoring %s (the command line places the train processes)", where, key)
            continue
        if key in LAYOUT_KEYS:
            raise ValueError(f"{where}: {key} sets the parallel layout, which the rollout data split must follow; "
                             "give it on the command line")
        if not hasattr(args, key):
            raise ValueError(f"{where}: {key!r} is not a flag of this trainer")
        original = getattr(args, key)
        if isinstance(value, str) and isinstance(original, (int, float)) and not isinstance(original, bool):
            try:
                value = type(original)(value)
            except ValueError:
                raise ValueError(f"{where}: {key}: {value!r} is not a {type(original).__name__}") from None
        checked[key] = value
    return checked


def role_args(args, role: str):
    """A copy of args with `role`'s overrides applied (args itself when there is no --megatron-config-path)."""
    if args.megatron_config_path is None:
        return args
    overrides = role_overrides(args, args.megatron_config_path, role)
    result = copy.deepcopy(args)
    for key, value in overrides.items():
        setattr(result, key, value)
    if role == "critic" and "lr" in overrides:
        result.critic_lr = overrides["lr"]
    logger.info("--megatron-config-path: %s overrides %s", role, sorted(overrides))
    return result
