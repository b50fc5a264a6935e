"""Samples -> train data: grouping by explicit group id, the even split over ranks, metrics, the metrics logger."""

import json
import random
import statistics

import pytest

from slime.ray.train_data import (
    data_parallel_rank,
    post_process_rewards,
    rollout_metrics,
    samples_to_train_data,
    split_train_data,
)
from slime.rollout.eval_metrics import eval_metrics
from slime.utils.metrics import MetricsLogger
from slime.utils.types import Sample, Status
from tests.helpers import args_helpers


def make_args(**overrides):
    defaults = {"grpo_std_normalization": True, "world_size": 2, "data_parallel_size": 2, "num_steps_per_rollout": 2}
    return args_helpers.make_args(**{**defaults, **overrides})


def make_samples(rewards_by_group, shuffle_seed=None):
    samples = []
    for g, rewards in enumerate(rewards_by_group):
        for r in rewards:
            n = 3 + len(samples) % 4
            samples.append(Sample(group_index=g, index=len(samples), tokens=list(range(5 + n)), response_length=n,
                                  reward=r, rollout_log_probs=[-0.5] * n, status=Status.COMPLETED))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(samples)
    return samples


def reference_grpo(samples, std=True):
    out = {}
    groups = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s.reward)
    for s in samples:
        rs = groups[s.group_index]
        mean = sum(rs) / len(rs)
        sd = statistics.stdev(rs) if len(rs) > 1 else 0.0
        out[s.index] = (s.reward - mean) / (sd + 1e-6) if std else s.reward - mean
    return out


@pytest.mark.parametrize("estimator, std", [("grpo", True), ("gspo", True), ("reinforce_plus_plus_baseline", False)])
def test_group_normalisation_uses_group_index_not_position(estimator, std):
    samples = make_samples([[1, 0, 0, 1], [1, 1, 1, 1], [0, 0.5, 2, 1], [3]], shuffle_seed=3)
    _, rewards = post_process_rewards(make_args(advantage_estimator=estimator), samples)
    expected = reference_grpo(samples, std=std)
    for s, r in zip(samples, rewards):
        assert r == pytest.approx(expected[s.index], abs=1e-9)


def test_raw_rewards_for_other_estimators_and_dict_rewards():
    samples = make_samples([[1, 0]])
    samples[0].reward = {"score": 2.0, "acc": True}
    samples[1].reward = {"score": -1.0, "acc": False}
    raw, rewards = post_process_rewards(make_args(advantage_estimator="ppo", reward_key="score"), samples)
    assert raw == rewards == [2.0, -1.0]
    with pytest.raises(ValueError, match="--reward-key"):
        post_process_rewards(make_args(advantage_estimator="ppo"), samples)


def test_rloo_leave_one_out():
    samples = make_samples([[1, 0, 0, 2]])
    _, rewards = post_process_rewards(make_args(advantage_estimator="rloo"), samples)
    assert rewards == pytest.approx([1 - 2 / 3, 0 - 1, 0 - 1, 2 - 1 / 3])


def test_train_data_fields_and_removed_samples():
    samples = make_samples([[1, 0]])
    samples[1].remove_sample = True
    data = samples_to_train_data(make_args(), samples)
    assert data["tokens"][0] == samples[0].tokens and data["response_lengths"] == [3, 4]
    assert data["loss_masks"] == [[1, 1, 1], [0, 0, 0, 0]]
    assert data["rollout_log_probs"][1] == [-0.5] * 4
    samples[0].loss_mask = [1, 1]
    with pytest.raises(ValueError, match="loss_mask"):
        samples_to_train_data(make_args(), samples)


def test_split_is_even_per_step_and_keeps_order():
    samples = make_samples([[0, 1, 0, 1]] * 4)  # 16 samples, 2 steps x 2 ranks -> 4 per rank per step
    data = samples_to_train_data(make_args(), samples)
    per_rank, dropped = split_train_data(make_args(), data, rollout_id=7)
    assert dropped == 0 and len(per_rank) == 2
    assert per_rank[0]["sample_indices"] == [0, 1, 2, 3, 8, 9, 10, 11]
    assert per_rank[1]["sample_indices"] == [4, 5, 6, 7, 12, 13, 14, 15]
    assert per_rank[0]["global_batch_size"] == 8 and per_rank[1]["rollout_id"] == 7
    # 15 samples cannot split evenly: one is dropped and reported, never silently mis-assigned
    data = samples_to_train_data(make_args(), samples[:15])
    per_rank, dropped = split_train_data(make_args(), data, rollout_id=0)
    assert dropped == 3 and per_rank[0]["global_batch_size"] == 6
    with pytest.raises(ValueError, match="fewer than"):
        split_train_data(make_args(), samples_to_train_data(make_args(), samples[:3]), rollout_id=0)


def test_rollout_and_eval_metrics():
    samples = make_samples([[1, 1], [0, 1]])
    samples[0].status = Status.TRUNCATED
    samples[1].metadata["reward_error"] = "boom"
    metrics = rollout_metrics(make_args(), samples, [1, 1, 0, 1])
    assert metrics["rollout/raw_reward"] == 0.75 and metrics["rollout/truncated_ratio"] == 0.25
    assert metrics["rollout/zero_std_groups"] == 1 and metrics["rollout/reward_failures"] == 1
    ev = eval_metrics("arith", samples, [1, 0, 0, 0], n_per_prompt=2)
    assert ev["eval/arith"] == 0.25 and ev["eval/arith-pass@1"] == 0.25 and ev["eval/arith-pass@2"] == 0.5


def test_metrics_logger_writes_jsonl_tensorboard_and_plot(tmp_path):
    args = args_helpers.make_args(output_dir=str(tmp_path), use_tensorboard=True)
    logger = MetricsLogger(args)
    lines = []
    for i in range(3):
        logger.log(i, {"rollout/raw_reward": 0.1 * i, "train/loss": 1.0 / (i + 1), "eval/arith": 0.5,
                       "bad": float("nan"), "text": "x"}, print_fn=lines.append)
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in rows] == [0, 1, 2] and "bad" not in rows[0] and "text" not in rows[0]
    assert rows[2]["train/loss"] == pytest.approx(1 / 3)
    assert "reward=0.2" in lines[2] and "eval/arith=0.500" in lines[2]
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    assert any((tmp_path / "tensorboard").iterdir())


@pytest.mark.parametrize("tp, pp, dp, expected", [
    (1, 1, 4, [0, 1, 2, 3]),  # FSDP, or Megatron data parallel only
    (2, 1, 2, [0, 0, 1, 1]),  # tensor peers share a replica's data
    (1, 2, 2, [0, 1, 0, 1]),  # pipeline stages sit dp x tp apart (Megatron's tp-cp-ep-dp-pp order)
    (2, 2, 1, [0, 0, 0, 0]),
])
def test_tensor_and_pipeline_peers_get_their_replicas_data(tp, pp, dp, expected):
    args = args_helpers.make_args(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=dp)
    assert [data_parallel_rank(args, rank) for rank in range(tp * pp * dp)] == expected
