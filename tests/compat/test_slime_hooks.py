"""slime's reward / train-data / log hooks and the optional rollout logs, on the RolloutManager's pure path
(slime.ray.train_data); the rollout-side hooks run against a real engine in test_rollout.py."""

import pytest

from slime.ray.train_data import rollout_metrics, samples_to_train_data
from slime.utils.types import Sample
from tests.helpers import args_helpers


def negate_rewards(args, samples):  # --custom-reward-post-process-path: fn(args, samples) -> (raw, rewards)
    raw = [s.reward for s in samples]
    return raw, [-r for r in raw]


def convert(args, samples):  # --custom-convert-samples-to-train-data-path: slime's keys
    return {"tokens": [s.tokens for s in samples], "response_lengths": [s.response_length for s in samples],
            "loss_masks": [[1] * s.response_length for s in samples], "rewards": [7.0] * len(samples),
            "raw_reward": [s.reward for s in samples]}


def bad_convert(args, samples):
    return {"tokens": [s.tokens for s in samples]}


def args_with(**overrides):
    return args_helpers.make_args("--n-samples-per-prompt", 2, **overrides)


def samples():
    out = []
    for group, rewards in enumerate(((1.0, 0.0), (1.0, 1.0))):
        for i, reward in enumerate(rewards):
            out.append(Sample(group_index=group, index=2 * group + i, tokens=[1, 2, 3, 4], response_length=2 + i,
                              loss_mask=[1] * (2 + i), reward=reward, metadata={"source": "ab"[group]},
                              status=Sample.Status.COMPLETED))
    return out


def test_reward_post_process_hook_replaces_group_normalisation():
    data = samples_to_train_data(args_with(custom_reward_post_process_path=f"{__name__}.negate_rewards"), samples())
    assert data["raw_reward"] == [1.0, 0.0, 1.0, 1.0] and data["rewards"] == [-1.0, -0.0, -1.0, -1.0]
    default = samples_to_train_data(args_with(), samples())
    assert default["rewards"][1] < 0 < default["rewards"][0]  # the default normalises within each group


def test_convert_hook_builds_the_train_data_and_the_rest_is_filled_in():
    data = samples_to_train_data(args_with(custom_convert_samples_to_train_data_path=f"{__name__}.convert"),
                                 samples())
    assert data["rewards"] == [7.0] * 4 and data["group_indices"] == [0, 0, 1, 1]
    assert data["rollout_mask_sums"] == [2, 3, 2, 3]  # each sample its own rollout (no rollout_id set)
    with pytest.raises(ValueError, match="lacks"):
        samples_to_train_data(args_with(custom_convert_samples_to_train_data_path=f"{__name__}.bad_convert"),
                              samples())


def test_optional_rollout_logs():
    args = args_with(log_passrate=True, log_reward_category="source", log_correct_samples=True)
    metrics = rollout_metrics(args, samples(), [1.0, 0.0, 1.0, 1.0])
    assert metrics["rollout/pass@1"] == pytest.approx((0.5 + 1.0) / 2)
    assert metrics["rollout/pass@2"] == pytest.approx(1.0)
    assert metrics["rollout/reward_category/a"] == 0.5 and metrics["rollout/reward_category/b"] == 1.0
    assert metrics["rollout/correct_samples"] == 3
    assert metrics["rollout/correct_response_len/mean"] == pytest.approx((2 + 2 + 3) / 3)
    assert not any("pass@" in k or "category" in k for k in rollout_metrics(args_with(), samples(), [1, 0, 1, 1]))


def test_balance_data_evens_the_token_counts_of_the_ranks():
    from slime.ray.train_data import split_train_data

    lengths = [100, 1, 90, 2, 80, 3, 70, 4]  # one step; unbalanced, rank 0 would get the four long ones
    data = {"tokens": [[0] * n for n in lengths], "sample_indices": list(range(8))}
    args = args_helpers.make_args(data_parallel_size=2)
    plain, _ = split_train_data(args, data, 0)
    args.balance_data = True
    balanced, dropped = split_train_data(args, data, 0)
    sums = lambda parts: [sum(len(t) for t in p["tokens"]) for p in parts]
    assert sums(plain) == [100 + 1 + 90 + 2, 80 + 3 + 70 + 4]  # contiguous halves
    assert max(sums(balanced)) - min(sums(balanced)) <= 2 and dropped == 0
    assert [len(p["tokens"]) for p in balanced] == [4, 4]
    assert sorted(i for p in balanced for i in p["sample_indices"]) == list(range(8))
