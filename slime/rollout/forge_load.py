"""slime's forge rollout: replay a dumped rollout (`--load-forge-rollout-data`) through the normal pipeline, with
engines, router, weight pushes and colocated memory hand-overs all live (unlike --load-debug-rollout-data, which
starts no engine): a memory or throughput test at a fixed, long context.

    --rollout-function-path slime.rollout.forge_load.generate_rollout --load-forge-rollout-data PATH

PATH is a dump of --save-debug-rollout-data (slime's .pt, or this project's .json: debug_dump.py). Without a
`{rollout_id}` placeholder every rollout replays the same file and eval replays nothing; with one, rollout i reads
its own file (falling back to rollout 0's when it has none) and eval reads `eval_<i>` (no fallback: training
samples are never scored as an eval). The samples keep their own rollout ids.

Not a generator: no request reaches the engines from here.
"""

from __future__ import annotations

import logging
from pathlib import Path

from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.utils.debug_dump import dump_path, load_samples
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

FLAG = "--load-forge-rollout-data"


def _resolve_path(template: str, rollout_id: int, evaluation: bool) -> Path | None:
    if "{rollout_id}" not in template:
        return None if evaluation else Path(template)
    path = dump_path(template, ("eval_" if evaluation else "") + str(rollout_id))
    if path.is_file():
        return path
    fallback = dump_path(template, 0)
    if not evaluation and fallback.is_file():
        logger.info("forge_load: %s missing, replaying %s", path, fallback)
        return fallback
    return None


def _eval_reward(sample: Sample, reward_key: str | None) -> float:
    if sample.reward is None:
        return 0.0
    return sample.reward[reward_key] if reward_key else sample.reward


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False):
    if not args.load_forge_rollout_data:
        raise ValueError(f"slime.rollout.forge_load.generate_rollout needs {FLAG} PATH (a rollout dump)")
    path = _resolve_path(args.load_forge_rollout_data, rollout_id, evaluation)
    if evaluation:
        if path is None:
            logger.info("forge_load: no eval dump for rollout %d; empty eval", rollout_id)
            return RolloutFnEvalOutput(data={})
        samples = load_samples(path, FLAG)
        reward_key = args.eval_reward_key or args.reward_key
        return RolloutFnEvalOutput(data={"forge_eval": {
            "rewards": [_eval_reward(sample, reward_key) for sample in samples],
            "truncated": [sample.status == Sample.Status.TRUNCATED for sample in samples],
            "samples": samples}})
    if path is None or not path.is_file():
        raise ValueError(f"{FLAG} {args.load_forge_rollout_data}: no dump for rollout {rollout_id} "
                         f"({path or 'nor for rollout 0'}); write them with --save-debug-rollout-data")
    samples = load_samples(path, FLAG)
    logger.info("forge_load: %d samples for rollout %d from %s", len(samples), rollout_id, path)
    return RolloutFnTrainOutput(samples=samples)
