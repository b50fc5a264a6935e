"""PPO's critic and the algorithm variants of the FSDP trainer, in one process: the clipped value loss against a
hand computation (and independent of the micro-batch split), GAE advantages from the critic's values reaching the
actor's loss, the critic checkpoint round-trip, Dr.GRPO's constant normaliser, and a trainer-side OPD teacher."""

import json

import pytest
import torch
import torch.distributed as dist

from slime.utils.misc import find_free_port
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.fsdp_helpers import make_args, make_train_data, make_trainer, old_values_off_the_clip_edge


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), arch="qwen3", seed=2)


def make_critic(args):
    from slime.backends.factory import create_trainer

    critic = create_trainer(args, 0, 1, "127.0.0.1", find_free_port(), role="critic")
    critic.start_rollout_id = critic.init()
    return critic


def masked_sample_mean(per_sample, masks):
    return float(torch.stack([(x * m).sum() / m.sum().clamp(min=1) for x, m in zip(per_sample, masks)]).mean())


def vanilla_gae(rewards, values, gamma, lambd):
    advantages, next_value, running = torch.zeros_like(values), 0.0, 0.0
    for t in reversed(range(len(values))):
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lambd * running
        advantages[t] = running
        next_value = values[t]
    return advantages, advantages + values


VALUE_CLIP = 0.2


def _value_loss_run(checkpoint, data, returns, *extra):
    critic = make_critic(make_args(checkpoint, "--advantage-estimator", "ppo", "--lr", "1e-2", *extra))
    assert all(float(v.abs().max()) == 0.0 for v in critic.compute_values(0, data))  # value head starts at 0
    critic.train(0, data, critic.compute_values(0, data), returns)  # move the head off zero
    values = critic.compute_values(1, data)
    old_values = old_values_off_the_clip_edge(values, seed=0)
    metrics = critic.train(1, data, old_values, returns)
    dist.destroy_process_group()
    return metrics, values, old_values


def reference_value_loss(values, old_values, returns, masks):
    """Hand computation from a run's own values; also the smallest distance of any token to the branch decision
    of the max (where (V_clip - R)^2 and (V - R)^2 swap), which must be far above rounding noise."""
    losses, clipped, margins = [], [], []
    for v, old, ret, mask in zip(values, old_values, returns, masks):
        v_clip = old + torch.clamp(v - old, -VALUE_CLIP, VALUE_CLIP)
        losses.append(torch.maximum((v_clip - ret) ** 2, (v - ret) ** 2))
        outside = (v - old).abs() > VALUE_CLIP
        clipped.append((outside & ((v_clip - ret) ** 2 > (v - ret) ** 2)).float())
        gap = ((v_clip - ret) ** 2 - (v - ret) ** 2).abs()
        margins.append(gap[outside & mask.bool()])
    return masked_sample_mean(losses, masks), masked_sample_mean(clipped, masks), float(torch.cat(margins).min())


def test_value_loss_matches_reference_and_micro_batch_split(tiny_checkpoint):
    data = make_train_data(6, vocab_size=300, seed=21)
    returns = [torch.linspace(-1, 1, n) for n in data["response_lengths"]]
    masks = [torch.tensor(m, dtype=torch.float32) for m in data["loss_masks"]]
    results = [_value_loss_run(tiny_checkpoint, data, returns, "--micro-batch-size", mbs) for mbs in ("1", "4")]
    clipfracs = []
    for metrics, values, old_values in results:
        loss, clipfrac, margin = reference_value_loss(values, old_values, returns, masks)
        assert margin > 1e-3  # the data keeps every clipped token away from the branch decision
        assert metrics["critic/value_loss"] == pytest.approx(loss, rel=1e-5)
        assert metrics["critic/value_clipfrac"] == pytest.approx(clipfrac, rel=1e-6)
        clipfracs.append(clipfrac)
    assert 0 < clipfracs[0] < 1  # both branches of the max are exercised
    # Invariant across splits: the loss and gradient within rounding, and the same clip decisions (one token of ~66
    # moves the fraction by ~0.015), which the margins above make independent of the CPU's rounding.
    (metrics, _, _), (split_metrics, _, _) = results
    for key in ("critic/value_loss", "critic/grad_norm"):
        assert split_metrics[key] == pytest.approx(metrics[key], rel=1e-5), key
    assert split_metrics["critic/value_clipfrac"] == pytest.approx(metrics["critic/value_clipfrac"], rel=1e-6)


def test_gae_advantages_from_critic_values_drive_the_actor_loss(tiny_checkpoint):
    data = make_train_data(4, vocab_size=300, seed=23)
    generator = torch.Generator().manual_seed(1)
    values = [torch.randn(n, generator=generator) for n in data["response_lengths"]]
    args = make_args(tiny_checkpoint, "--advantage-estimator", "ppo", "--gamma", "0.9", "--lambd", "0.8",
                     "--micro-batch-size", "3")
    actor = make_trainer(args)
    critic_only_returns = actor.returns_for_critic(0, data, values)
    metrics = actor.train(0, data, values)
    masks = [torch.tensor(m, dtype=torch.float32) for m in data["loss_masks"]]
    expected = []
    for reward, v, returns, train_returns in zip(data["rewards"], values, critic_only_returns, actor.last_returns):
        token_rewards = torch.zeros(len(v))
        token_rewards[-1] = reward
        advantages, reference_returns = vanilla_gae(token_rewards, v, 0.9, 0.8)
        torch.testing.assert_close(returns, reference_returns, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(train_returns, reference_returns, rtol=1e-5, atol=1e-6)
        expected.append(-advantages)
    # First step: old log-probs == current ones, ratio 1, so pg_loss = -(sample mean of the masked advantages).
    assert metrics["train/ppo_kl"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["train/pg_loss"] == pytest.approx(masked_sample_mean(expected, masks), rel=1e-5)


def test_critic_checkpoint_round_trip(tiny_checkpoint, tmp_path):
    data = make_train_data(4, vocab_size=300, seed=25)
    returns = [torch.ones(n) for n in data["response_lengths"]]
    extra = ("--advantage-estimator", "ppo", "--lr", "1e-2", "--save", tmp_path)
    critic = make_critic(make_args(tiny_checkpoint, *extra))
    critic.train(0, data, critic.compute_values(0, data), returns)
    critic.save_model(0)
    saved_values = critic.compute_values(1, data)
    dist.destroy_process_group()
    assert (tmp_path / "critic" / "latest").is_file()
    make_trainer(make_args(tiny_checkpoint, *extra)).save_model(0, run_state={"data_source": {}})  # --load needs both
    dist.destroy_process_group()
    resumed = make_critic(make_args(tiny_checkpoint, *extra, "--load", tmp_path))
    assert resumed.start_rollout_id == 1
    for value, saved in zip(resumed.compute_values(1, data), saved_values):
        torch.testing.assert_close(value, saved, rtol=0, atol=0)
    assert any(float(v.abs().max()) > 0 for v in saved_values)


def test_dr_grpo_constant_normaliser(tiny_checkpoint):
    data = make_train_data(4, vocab_size=300, seed=27)
    masks = [torch.tensor(m, dtype=torch.float32) for m in data["loss_masks"]]
    results = []
    for mbs in ("1", "4"):
        args = make_args(tiny_checkpoint, "--loss-agg-mode", "constant", "--loss-agg-constant", "16",
                         "--disable-grpo-std-normalization", "--micro-batch-size", mbs)
        results.append(make_trainer(args).train(0, data))
        dist.destroy_process_group()
    expected = -sum(float(r) * float(m.sum()) for r, m in zip(data["rewards"], masks)) / (4 * 16)
    for metrics in results:
        assert metrics["train/pg_loss"] == pytest.approx(expected, rel=1e-5)


def test_opd_teacher_checkpoint(tiny_checkpoint, tmp_path):
    teacher = build_tiny_model(tmp_path / "teacher", arch="qwen3", seed=3)
    data = make_train_data(4, vocab_size=300, seed=29)
    same = make_trainer(make_args(tiny_checkpoint, "--use-opd", "--opd-teacher-load", tiny_checkpoint)).train(0, data)
    dist.destroy_process_group()
    other = make_trainer(make_args(tiny_checkpoint, "--use-opd", "--opd-teacher-load", teacher)).train(0, data)
    assert same["train/opd_reverse_kl"] == pytest.approx(0.0, abs=1e-7)
    assert abs(other["train/opd_reverse_kl"]) > 1e-3
    assert other["train/pg_loss"] != pytest.approx(same["train/pg_loss"])


def test_critic_resumes_from_the_actors_rollout(tmp_path):
    from slime.backends.critic_flow import critic_resume_dir

    def write_checkpoint(folder, rollout_id):  # a complete checkpoint of no files: only the folder choice matters
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "meta.json").write_text(json.dumps({"rollout_id": rollout_id, "files": []}))

    for folder, rollout_id in (("rollout_1", 1), ("critic/rollout_1", 1), ("critic/rollout_2", 2)):
        write_checkpoint(folder, rollout_id)
    (tmp_path / "latest").write_text("rollout_1")
    (tmp_path / "critic" / "latest").write_text("rollout_2")
    assert critic_resume_dir(str(tmp_path)) == tmp_path / "critic" / "rollout_1"  # the actor's rollout wins
    (tmp_path / "latest").write_text("rollout_3")
    write_checkpoint("rollout_3", 3)
    with pytest.raises(ValueError, match="critic checkpoint"):
        critic_resume_dir(str(tmp_path))
    assert critic_resume_dir(None) is None
