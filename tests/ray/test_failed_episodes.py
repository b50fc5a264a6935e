"""A sample its generate function gave up on (`remove_sample`, e.g. a coding agent whose sandbox failed) stays out of
its group: the group still trains, and the others' advantages are those of the group without it (no fake zero)."""

import statistics

import pytest

from slime.ray.train_data import post_process_rewards, samples_to_train_data
from slime.rollout.scoring import is_scorable
from slime.utils.types import Sample, Status
from tests.helpers import args_helpers


def group(rewards, removed=(), rollout_ids=None):
    samples = []
    for i, reward in enumerate(rewards):
        failed = i in removed
        samples.append(Sample(group_index=7, index=i, tokens=[1, 2, 3, 4], response_length=2, reward=reward,
                              loss_mask=[1, 1], rollout_log_probs=[-0.5, -0.5], remove_sample=failed,
                              rollout_id=rollout_ids[i] if rollout_ids else None,
                              status=Status.ABORTED if failed else Status.COMPLETED))
    return samples


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_a_failed_episode_moves_no_advantage_of_its_group(estimator):
    args = args_helpers.make_args(advantage_estimator=estimator, grpo_std_normalization=True)
    samples = group([1.0, 0.0, 1.0, 0.0], removed={3})
    _, rewards = post_process_rewards(args, samples)
    kept = [1.0, 0.0, 1.0]
    if estimator == "grpo":
        mean, std = statistics.fmean(kept), statistics.stdev(kept)
        expected = [(r - mean) / (std + 1e-6) for r in kept]
    else:
        expected = [r - statistics.fmean(kept[:i] + kept[i + 1:]) for i, r in enumerate(kept)]
    assert rewards[:3] == pytest.approx(expected, abs=1e-9)
    assert rewards[3] == 0.0
    assert samples_to_train_data(args, samples)["loss_masks"][3] == [0, 0]
    # with the failed episode counted as a zero reward the advantages would differ: the test can tell
    _, poisoned = post_process_rewards(args, group([1.0, 0.0, 1.0, 0.0]))
    assert poisoned[:3] != pytest.approx(expected, abs=1e-3)


def test_fan_out_siblings_of_a_failed_rollout_leave_together():
    args = args_helpers.make_args(advantage_estimator="grpo", grpo_std_normalization=False)
    samples = group([1.0, 0.0, 0.0, 0.0], removed={2, 3}, rollout_ids=["a", "b", "c", "c"])
    _, rewards = post_process_rewards(args, samples)
    assert rewards == pytest.approx([0.5, -0.5, 0.0, 0.0])


def test_scorable_groups():
    assert is_scorable(group([1.0, 0.0], removed={1}))
    assert not is_scorable(group([1.0, 0.0], removed={0, 1}))  # nothing left to learn from
    engine_aborted = group([1.0, 0.0])
    engine_aborted[1].status = Status.ABORTED  # an engine abort (a weight update): generated again later
    assert not is_scorable(engine_aborted)
