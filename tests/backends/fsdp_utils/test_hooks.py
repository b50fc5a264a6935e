"""Trainer extension points and options around the loss: user hooks by dotted path, --ref-update-interval,
on-policy distillation from teacher log-probs, unsupported options failing loudly."""

import pytest
import torch

from slime.backends.packing import pack_samples
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.fsdp_helpers import make_args, make_train_data, make_trainer

CALLS = []


def record_init(args):
    CALLS.append(("init",))


def record_log_prob(args, model, store_prefix):
    CALLS.append(("log_prob", store_prefix))


def record_train_step(args, rollout_id, step_id, model, optimizer, scheduler):
    CALLS.append(("train_step", rollout_id, step_id))


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), arch="qwen3", seed=9)


def test_hooks_are_called_in_order(tiny_checkpoint):
    CALLS.clear()
    args = make_args(tiny_checkpoint, "--custom-init-path", f"{__name__}.record_init",
                     "--custom-before-log-prob-hook-path", f"{__name__}.record_log_prob",
                     "--custom-before-train-step-hook-path", f"{__name__}.record_train_step",
                     "--use-kl-loss", "--kl-loss-coef", "0.1", "--ref-load", tiny_checkpoint)
    trainer = make_trainer(args, with_ref=True)
    trainer.train(3, make_train_data(4, vocab_size=300, seed=1, num_steps=2))
    assert CALLS == [("init",), ("log_prob", "ref_"), ("log_prob", ""), ("train_step", 3, 0), ("train_step", 3, 1)]


@pytest.mark.parametrize("interval,expect_zero_kl", [(None, False), (1, True)])
def test_ref_update_interval_moves_the_reference(tiny_checkpoint, interval, expect_zero_kl):
    extra = ("--ref-update-interval", interval) if interval else ()
    args = make_args(tiny_checkpoint, "--lr", "1e-3", "--use-kl-loss", "--kl-loss-coef", "0.1",
                     "--ref-load", tiny_checkpoint, *extra)
    trainer = make_trainer(args, with_ref=True)
    data = make_train_data(4, vocab_size=300, seed=2)
    trainer.train(0, data)
    metrics = trainer.train(1, data)
    assert (metrics["train/kl_loss"] == 0.0) == expect_zero_kl


def test_on_policy_distillation_pulls_towards_a_confident_teacher(tiny_checkpoint):
    data = make_train_data(4, vocab_size=300, seed=3)
    data["rewards"] = [0.0] * 4
    data["teacher_log_probs"] = [[0.0] * r for r in data["response_lengths"]]  # the teacher is sure of every token
    # teacher log-probs arrive with the data, as a custom generate function that queries a teacher would set them
    args = make_args(tiny_checkpoint, "--lr", "1e-3", "--use-opd", "--opd-kl-coef", "1.0",
                     "--custom-generate-function-path", "slime.rollout.sglang_rollout.generate")
    trainer = make_trainer(args)
    packed = pack_samples(data["tokens"], data["response_lengths"], list(range(4)))

    def total_log_prob():
        with torch.no_grad():
            return float(trainer.model.forward_micro_batch(packed)[0].sum())

    before = total_log_prob()
    metrics = trainer.train(0, data)
    assert metrics["train/pg_loss"] < 0  # A = -(old - teacher) > 0 on every token
    assert total_log_prob() > before


def test_keep_old_actor_uses_the_weights_that_generated_each_sample(tiny_checkpoint):
    data = make_train_data(4, vocab_size=300, seed=9)
    trainer = make_trainer(make_args(tiny_checkpoint, "--lr", "1e-2", "--keep-old-actor"))
    schedule = trainer._schedule(data)
    trainer.update_weights(weight_version="0")  # no engines connected: only the host copy is kept
    before = trainer.compute_log_probs(schedule)
    with pytest.raises(ValueError, match="no weight versions"):
        trainer.train(0, data)
    trainer.train(0, {**data, "weight_versions": ["0"] * 4})
    trainer.update_weights(weight_version="1")
    after = trainer.compute_log_probs(schedule)
    mixed = trainer._log_probs_of_generating_weights({**data, "weight_versions": ["0", "1", "0", "1"]}, schedule, 4)
    for i in range(4):
        torch.testing.assert_close(mixed[i], (before if i % 2 == 0 else after)[i], rtol=0, atol=0)
        assert not torch.equal(before[i], after[i])
    current = trainer.compute_log_probs(schedule)  # the actor's own weights are back
    assert all(torch.equal(current[i], after[i]) for i in range(4))
    trainer.train(1, {**data, "weight_versions": ["1"] * 4})
    trainer.update_weights(weight_version="2")  # async: rollout 2's data still comes from version 1
    with pytest.raises(ValueError, match=r"weight versions \['0'\]"):
        trainer.train(2, {**data, "weight_versions": ["0"] * 4})
    assert trainer.train(2, {**data, "weight_versions": ["1"] * 4})["train/ppo_kl"] != 0.0
