"""FSDP2 across two GPUs (NCCL, bf16 mixed precision) against one GPU on the same global batch: the multi-GPU
issue's invariance, the CUDA twin of test_fsdp_distributed.py. Skipped unless two GPUs are visible."""

import pytest
import torch
from fsdp_helpers import full_params, make_args, make_train_data, make_trainer, rank_slice, run_distributed

from slime.utils.tiny_model import build_tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


def _train(rank, world_size, port, checkpoint, data, extra):
    import os

    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    args = make_args(checkpoint, *extra, world_size=world_size, device="cuda")
    trainer = make_trainer(args, rank, world_size, port, with_ref=True)
    metrics = [trainer.train(rollout_id, rank_slice(data, rank, world_size)) for rollout_id in range(2)]
    return metrics, {name: value.float().cpu() for name, value in full_params(trainer).items()}


def test_two_gpus_match_one(tmp_path):
    checkpoint = build_tiny_model(tmp_path / "tiny", arch="qwen3", seed=4, hidden_size=256, intermediate_size=512)
    data = make_train_data(8, vocab_size=300, seed=21, num_steps=2, with_rollout_log_probs=True)
    extra = ("--lr", "1e-5", "--use-kl-loss", "--kl-loss-coef", "0.2", "--ref-load", checkpoint,
             "--use-dynamic-batch-size", "--max-tokens-per-gpu", "64")
    (single_metrics, single_params), = run_distributed(_train, 1, checkpoint, data, extra)
    for metrics, params in run_distributed(_train, 2, checkpoint, data, extra):
        for step, reference in zip(metrics, single_metrics):
            # bf16 forward on differently packed micro-batches, fp32 gradient reduction in another order.
            for key in ("train/loss", "train/pg_loss", "train/kl_loss", "train/grad_norm"):
                assert step[key] == pytest.approx(reference[key], rel=2e-2, abs=1e-5), key
        for name, value in params.items():
            torch.testing.assert_close(value, single_params[name], rtol=1e-3, atol=1e-5)
