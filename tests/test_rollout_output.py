"""A rollout function's result: typed (`RolloutFnTrainOutput` / `RolloutFnEvalOutput`, slime's names) with its
metrics as values, or the legacy bare list / dict."""

from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput, split_rollout_output


def test_typed_and_legacy_results():
    groups = [["s0", "s1"], ["s2", "s3"]]
    assert split_rollout_output(RolloutFnTrainOutput(groups, {"rollout/x": 1.0})) == (groups, {"rollout/x": 1.0})
    assert split_rollout_output(RolloutFnTrainOutput(groups)) == (groups, {})
    assert split_rollout_output(groups) == (groups, {})
    data = {"arith": {"rewards": [1.0], "truncated": [False], "samples": ["s"]}}
    assert split_rollout_output(RolloutFnEvalOutput(data, {"eval/y": 2.0})) == (data, {"eval/y": 2.0})
    assert split_rollout_output(data) == (data, {})
    metrics = {"rollout/x": 1.0}
    _, returned = split_rollout_output(RolloutFnTrainOutput(groups, metrics))
    returned["rollout/z"] = 3.0
    assert metrics == {"rollout/x": 1.0}  # the caller gets its own copy
