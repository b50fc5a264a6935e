"""Two FSDP2 processes (gloo, CPU) against one on the same global batch: same loss, grad norm and weights."""

import pytest
import torch

from slime.utils.tiny_model import build_tiny_model
from tests.helpers.fsdp_helpers import (
    full_params,
    make_args,
    make_train_data,
    make_trainer,
    rank_slice,
    run_distributed,
)


def _train(rank, world_size, port, checkpoint, data, extra):
    args = make_args(checkpoint, *extra, world_size=world_size)
    trainer = make_trainer(args, rank, world_size, port, with_ref=True)
    metrics, first_step = [], None
    for rollout_id in range(2):
        metrics.append(trainer.train(rollout_id, rank_slice(data, rank, world_size)))
        first_step = first_step or trainer.last_step_metrics[0]
    return metrics, full_params(trainer), first_step


@pytest.mark.parametrize("batching", [("--micro-batch-size", "2"),
                                      ("--use-dynamic-batch-size", "--max-tokens-per-gpu", "20")])
def test_two_processes_match_one(tmp_path, batching):
    checkpoint = build_tiny_model(tmp_path / "tiny", arch="qwen3", seed=4)
    data = make_train_data(8, vocab_size=300, seed=21, num_steps=2, with_rollout_log_probs=True)
    extra = ("--lr", "1e-7", "--use-kl-loss", "--kl-loss-coef", "0.2", "--ref-load", checkpoint,
             "--entropy-coef", "0.01", *batching)
    (single_metrics, single_params, _), = run_distributed(_train, 1, checkpoint, data, extra)
    results = run_distributed(_train, 2, checkpoint, data, extra)
    for metrics, params, first_step in results:
        # Two steps per rollout: old log-probs come from their own forward and ref == actor before any update,
        # so the first step is exactly on-policy and exactly at the reference.
        assert first_step["train/ppo_kl"] == 0.0
        assert first_step["train/kl_loss"] == 0.0
        for step, reference in zip(metrics, single_metrics):
            for key in ("train/loss", "train/pg_loss", "train/kl_loss", "train/entropy_loss", "train/grad_norm",
                        "train/train_rollout_logprob_abs_diff", "train/lr"):
                assert step[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-6), key
            # A count, so not compared across layouts: at lr 1e-7 every ratio is within ~1e-6 of 1, far from the
            # clip at 1 +- 0.2, so no token is clipped on any CPU.
            assert step["train/pg_clipfrac"] == reference["train/pg_clipfrac"] == 0.0
        for name, value in params.items():
            torch.testing.assert_close(value, single_params[name], rtol=1e-5, atol=1e-7)
