"""slime's loss variants through the training backends' policy loss (slime.backends.loss): CISPO (the
estimator), OPSM (--use-opsm), the custom TIS hook and the custom pg-loss reducer, each against its closed form on
a micro-batch of two sequences."""

import torch

from slime.backends.loss import LossReducer, MicroBatchTensors, policy_loss
from tests.helpers import args_helpers


def args_for(**overrides):
    return args_helpers.make_args("--eps-clip-high", 0.28, "--loss-agg-mode", "token_mean", **overrides)


def batch_and_log_probs():
    old = torch.tensor([-1.0, -2.0, -0.5, -1.5, -1.0], dtype=torch.float64)
    new = torch.tensor([-0.2, -2.0, -0.5, -0.5, -3.0], dtype=torch.float64, requires_grad=True)
    masks = [torch.ones(2, dtype=torch.float64), torch.ones(3, dtype=torch.float64)]
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    return MicroBatchTensors(loss_masks=masks, advantages=advantages, old_log_probs=old), new


def run(args, batch, log_probs):
    reduce = LossReducer(args, batch.loss_masks, global_denominator=5.0)
    return policy_loss(args, log_probs, torch.zeros_like(log_probs), batch, reduce)


def test_cispo_loss_is_the_clipped_ratio_times_advantage_times_log_prob():
    batch, log_probs = batch_and_log_probs()
    args = args_for(advantage_estimator="cispo", eps_clip=1.0, eps_clip_high=0.5)
    loss, metrics = run(args, batch, log_probs)
    ratio = torch.exp(log_probs.detach() - batch.old_log_probs).clamp(0.0, 1.5)
    expected = (-ratio * batch.advantages * log_probs.detach()).sum() / 5.0
    torch.testing.assert_close(loss.detach(), expected)
    loss.backward()  # gradient -sg(ratio) * A / 5 on every token, clipped ones included
    torch.testing.assert_close(log_probs.grad, -ratio * batch.advantages / 5.0)
    assert metrics["pg_clipfrac"].item() == 2 / 5  # token 0 (ratio e^0.8) and token 3 (e^1.0) hit 1.5


def test_opsm_masks_negative_advantage_tokens_of_drifted_sequences():
    batch, log_probs = batch_and_log_probs()
    plain, _ = run(args_for(), batch, log_probs)
    masked, metrics = run(args_for(use_opsm=True, opsm_delta=0.1), batch, log_probs)
    # sequence 2 drifted (mean old - new = (0 - 1 + 2) / 3 > 0.1) and its advantages are negative: its tokens drop
    ratio = torch.exp(log_probs.detach() - batch.old_log_probs)
    unclipped = -batch.advantages * ratio
    clipped = -batch.advantages * ratio.clamp(0.8, 1.28)
    per_token = torch.maximum(unclipped, clipped)
    torch.testing.assert_close(masked.detach(), per_token[:2].sum() / 5.0)
    torch.testing.assert_close(plain.detach(), per_token.sum() / 5.0)
    assert metrics["opsm_clipfrac"].item() == 1.0  # one sequence, all of its 3 tokens


def halve_and_reject_second(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
                            response_lengths):  # slime's --custom-tis-function-path signature
    assert [len(x) for x in train_log_probs] == [len(x) for x in rollout_log_probs] == response_lengths == [2, 3]
    assert total_lengths == [7, 9]
    masks = [loss_masks[0], torch.zeros_like(loss_masks[1])]
    return pg_loss * 0.5, masks, {"tis_seen": torch.ones_like(pg_loss)}


def test_custom_tis_hook_rescales_and_its_masks_set_the_reduction():
    batch, log_probs = batch_and_log_probs()
    batch.rollout_log_probs = batch.old_log_probs - 0.1
    batch.total_lengths = [7, 9]
    plain, _ = run(args_for(), batch, log_probs)
    args = args_for(use_tis=True, custom_tis_function_path=f"{__name__}.halve_and_reject_second")
    loss, metrics = run(args, batch, log_probs)
    ratio = torch.exp(log_probs.detach() - batch.old_log_probs)
    per_token = torch.maximum(-batch.advantages * ratio, -batch.advantages * ratio.clamp(0.8, 1.28))
    torch.testing.assert_close(loss.detach(), 0.5 * per_token[:2].sum() / 5.0)
    torch.testing.assert_close(plain.detach(), per_token.sum() / 5.0)
    assert metrics["tis_seen"].item() == 1.0  # the hook's metrics, reduced over the original masks (5 / 5)


REDUCER_CALLS = []


def max_per_sample_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss):
    """slime's --custom-pg-loss-reducer-function-path signature: each sample's largest masked-in loss, summed."""
    REDUCER_CALLS.append((total_lengths, response_lengths, [m.tolist() for m in loss_masks], calculate_per_token_loss))

    def reduce(values):
        return sum((x * m).max() for x, m in zip(values.split(response_lengths), loss_masks))

    return reduce


def test_custom_pg_loss_reducer_replaces_only_the_pg_term_over_the_step_denominator():
    batch, log_probs = batch_and_log_probs()
    batch.total_lengths = [7, 9]
    batch.loss_masks[1] = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    default_args = args_for(loss_agg_mode="sample_mean", calculate_per_token_loss=False)
    plain, plain_metrics = run(default_args, batch, log_probs)
    REDUCER_CALLS.clear()
    args = args_for(loss_agg_mode="sample_mean", calculate_per_token_loss=False,
                    custom_pg_loss_reducer_function_path=f"{__name__}.max_per_sample_reducer")
    loss, metrics = run(args, batch, log_probs)
    assert REDUCER_CALLS == [([7, 9], [2, 3], [[1.0, 1.0], [1.0, 0.0, 1.0]], False)]
    ratio = torch.exp(log_probs.detach() - batch.old_log_probs)
    per_token = torch.maximum(-batch.advantages * ratio, -batch.advantages * ratio.clamp(0.8, 1.28))
    expected = (per_token[:2].max() + torch.stack([per_token[2], per_token[4]]).max()) / 5.0  # global denominator 5
    torch.testing.assert_close(loss.detach(), expected)
    torch.testing.assert_close(metrics["pg_loss"], expected)
    assert not torch.allclose(plain.detach(), expected)
    for key in ("pg_clipfrac", "ppo_kl", "entropy_loss"):  # every other term keeps the default reduction
        torch.testing.assert_close(metrics[key], plain_metrics[key])
