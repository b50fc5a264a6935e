"""Fan-out: a generate function that turns one prompt sample into several Samples (sub-agents, segments around a
context compaction). Siblings share a rollout id; group normalisation counts each rollout once; the loss is each
rollout's token mean, weighted like one sample, for any micro-batch split."""

import statistics

import pytest
import torch

from slime.ray.train_data import assign_rollout_ids, post_process_rewards, samples_to_train_data
from slime.utils.loss_aggregation import aggregate_loss, loss_denominator
from slime.utils.types import Sample
from tests.helpers import args_helpers

ARGS = args_helpers.make_args(grpo_std_normalization=True)


def sample(group, rollout_id, reward, num_tokens):
    return Sample(group_index=group, index=group, rollout_id=rollout_id, reward=reward, tokens=[1] * (3 + num_tokens),
                  response_length=num_tokens, loss_mask=[1] * num_tokens)


def batch():
    # group 0: rollouts 10 (one sample, reward 1), 11 (three siblings: 0, 0.5, 1) and 12 (reward 0)
    # group 1: rollouts 20 and 21, one sample each
    return [sample(0, 10, 1.0, 4), sample(0, 11, 0.0, 3), sample(0, 11, 0.5, 2), sample(0, 11, 1.0, 5),
            sample(0, 12, 0.0, 2), sample(1, 20, 2.0, 3), sample(1, 21, 4.0, 1)]


def test_group_statistics_count_each_rollout_once():
    samples = batch()
    raw, normalized = post_process_rewards(ARGS, samples)
    assert raw == [1.0, 0.0, 0.5, 1.0, 0.0, 2.0, 4.0]
    rollout_rewards = [1.0, statistics.fmean([0.0, 0.5, 1.0]), 0.0]  # the fan-out enters with its mean
    mean, std = statistics.fmean(rollout_rewards), statistics.stdev(rollout_rewards)
    expected = [(r - mean) / (std + 1e-6) for r in raw[:5]]
    mean1, std1 = 3.0, statistics.stdev([2.0, 4.0])
    expected += [(r - mean1) / (std1 + 1e-6) for r in raw[5:]]
    assert normalized == pytest.approx(expected, rel=1e-9)
    # Without fan-out (one sample per rollout) it is plain GRPO normalisation.
    single = [sample(0, i, r, 2) for i, r in enumerate([1.0, 0.5, 0.0])]
    _, plain = post_process_rewards(ARGS, single)
    assert plain == pytest.approx([(r - 0.5) / (0.5 + 1e-6) for r in [1.0, 0.5, 0.0]], rel=1e-9)
    rloo = args_helpers.make_args(grpo_std_normalization=True, advantage_estimator="rloo")
    _, advantages = post_process_rewards(rloo, samples)
    # RLOO baseline of rollout 11: the mean of the other rollouts of its group (10 and 12)
    assert advantages[1:4] == pytest.approx([r - statistics.fmean([1.0, 0.0]) for r in (0.0, 0.5, 1.0)])


def test_missing_rollout_ids_are_filled_and_siblings_keep_theirs():
    samples = [Sample(rollout_id=None), Sample(rollout_id=1), Sample(rollout_id=1), Sample(rollout_id=None)]
    assign_rollout_ids(samples)
    assert [s.rollout_id for s in samples] == [0, 1, 1, 2]


def test_loss_is_the_rollout_token_mean_for_any_split():
    samples = batch()
    data = samples_to_train_data(ARGS, samples)
    assert data["rollout_mask_sums"] == [4, 10, 10, 10, 2, 3, 1]
    assert data["rollout_num_samples"] == [1, 3, 3, 3, 1, 1, 1]
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(len(m), generator=generator) for m in data["loss_masks"]]
    masks = [torch.tensor(m, dtype=torch.float32) for m in data["loss_masks"]]
    shares = [1.0 / n for n in data["rollout_num_samples"]]
    denominator = loss_denominator("sample_mean", masks, None, shares)
    assert denominator == pytest.approx(5.0)  # five rollouts, seven samples
    # independent reference: the mean over rollouts of each rollout's token mean
    by_rollout = {}
    for s, v in zip(samples, values):
        by_rollout.setdefault(s.rollout_id, []).append(v)
    expected = statistics.fmean(float(torch.cat(vs).mean()) for vs in by_rollout.values())
    for split in ([7], [1, 6], [2, 2, 3], [1] * 7):
        total, start = 0.0, 0
        for size in split:
            part = slice(start, start + size)
            total += float(aggregate_loss(values[part], masks[part], "sample_mean", denominator,
                                          data["rollout_mask_sums"][part]))
            start += size
        assert total == pytest.approx(expected, rel=1e-6), split


async def two_segments(args, sample, sampling_params):
    """A generate function that splits one conversation into two trainable segments (no engine needed here)."""
    first, second = Sample.from_dict(sample.to_dict()), Sample.from_dict(sample.to_dict())
    for segment, reward in ((first, 1.0), (second, 0.0)):
        segment.reward, segment.status = reward, Sample.Status.COMPLETED
    return [first, second]


def test_generate_function_returning_siblings_gives_them_one_rollout_id():
    from slime.rollout.sglang_rollout import GenerateState, generate_and_rm
    from slime.utils.http_utils import run

    args = args_helpers.make_args(sglang_router_ip="127.0.0.1", sglang_router_port=1, sglang_server_concurrency=2,
                                  custom_generate_function_path=f"{__name__}.two_segments")

    async def one(index):
        return await generate_and_rm(args, Sample(index=index, group_index=0), {}, state=GenerateState(args))

    first, second = run(one(0)), run(one(1))
    assert first[0].rollout_id == first[1].rollout_id is not None
    assert second[0].rollout_id == second[1].rollout_id != first[0].rollout_id
