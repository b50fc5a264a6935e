"""Dynamic-sampling filters: keep a group only when its rewards vary."""

import pytest

from slime.rollout import filter_hub
from slime.rollout.filter_hub import DynamicFilterOutput
from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std_with_fallback
from slime.utils.types import Sample
from tests.helpers import args_helpers

ARGS = args_helpers.make_args()


def group(*rewards):
    return [Sample(reward=r) for r in rewards]


def test_groups_with_varying_rewards_are_kept():
    assert filter_hub.check_reward_nonzero_std(ARGS, group(0.0, 1.0, 1.0)) == DynamicFilterOutput(keep=True)
    assert filter_hub.check_reward_nonzero_std(ARGS, group(0.5, 0.5 + 1e-5)).keep


@pytest.mark.parametrize("rewards,reason", [((1.0, 1.0, 1.0), "zero_std_1.0"), ((0, 0), "zero_std_0.0"),
                                            ((-1.0,), "zero_std_-1.0"), ((0.3, 0.3 + 1e-7), "zero_std_0.3")])
def test_constant_groups_are_dropped_with_reason(rewards, reason):
    out = filter_hub.check_reward_nonzero_std(ARGS, group(*rewards))
    assert (out.keep, out.reason, out.keep_when_insufficient) == (False, reason, False)


def test_dict_rewards_use_reward_key():
    samples = [Sample(reward={"score": s, "acc": s > 0}) for s in (1.0, -1.0)]
    assert filter_hub.check_reward_nonzero_std(args_helpers.make_args(reward_key="score"), samples).keep
    with pytest.raises(ValueError, match="--reward-key"):
        filter_hub.check_reward_nonzero_std(ARGS, samples)


def test_fallback_variant_marks_dropped_groups_usable_when_short():
    out = check_reward_nonzero_std_with_fallback(ARGS, group(1.0, 1.0))
    assert (out.keep, out.reason, out.keep_when_insufficient) == (False, "zero_std_1.0", True)
    assert check_reward_nonzero_std_with_fallback(ARGS, group(0.0, 1.0)).keep
