"""A rollout function's result: typed (`RolloutFnTrainOutput` / `RolloutFnEvalOutput`, slime's names) with its
metrics as values, or the legacy bare list / dict, which slime's `call_rollout_fn` types."""

from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput, call_rollout_fn

GROUPS = [["s0", "s1"], ["s2", "s3"]]
DATA = {"arith": {"rewards": [1.0], "truncated": [False], "samples": ["s"]}}


def rollout(args, rollout_id, data_source, evaluation=False):
    return RolloutFnEvalOutput(DATA, {"eval/y": 2.0}) if evaluation else RolloutFnTrainOutput(GROUPS, {"x": 1.0})


def legacy_rollout(args, rollout_id, data_source, evaluation=False):
    return DATA if evaluation else GROUPS


def test_typed_and_legacy_results():
    assert call_rollout_fn(rollout, None, 0, None, evaluation=False) == RolloutFnTrainOutput(GROUPS, {"x": 1.0})
    assert call_rollout_fn(rollout, None, 0, None, evaluation=True) == RolloutFnEvalOutput(DATA, {"eval/y": 2.0})
    assert call_rollout_fn(legacy_rollout, None, 0, None, evaluation=False) == RolloutFnTrainOutput(GROUPS)
    assert call_rollout_fn(legacy_rollout, None, 0, None, evaluation=True) == RolloutFnEvalOutput(DATA)
