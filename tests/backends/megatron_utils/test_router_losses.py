"""The Megatron backend's MoE router losses (--moe-aux-loss-coeff aux_loss / seq_aux_loss, --moe-z-loss-coeff)
against the FSDP backend's (the same definitions, slime/backends/moe_aux_loss.py): on a tiny Qwen3-MoE, two
optimizer steps of one rollout give the same policy loss, router-loss metrics, load metric and gradient norms (the
router losses' gradients included; the second step starts from the first one's update). With activation
recompute the layers route again in the backward: the same numbers."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.helpers.fsdp_helpers import make_args, make_train_data, make_trainer, run_distributed
from tests.helpers.megatron_helpers import make_megatron_args

pytest.importorskip("megatron.core")

ALGORITHM = ("--lr", "1e-2", "--lr-decay-style", "constant", "--adam-beta2", "0.98", "--weight-decay", "0.0",
             "--micro-batch-size", "2", "--moe-aux-loss-coeff", "0.5", "--moe-z-loss-coeff", "0.1")
KEYS = ("train/loss", "train/pg_loss", "train/moe_aux_loss", "train/moe_z_loss", "train/moe_load_imbalance",
        "train/grad_norm")
RECOMPUTE = ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    from slime.utils.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_moe_losses"), arch="qwen3_moe", num_experts=4,
                            num_experts_per_tok=2, seed=1, initializer_range=0.2)


def _both_backends(rank, world_size, port, checkpoint, balance_type):
    from slime.backends.megatron_utils.parallel import destroy_model_parallel

    data = make_train_data(8, vocab_size=300, seed=6, num_steps=2)
    algorithm = (*ALGORITHM, "--moe-router-load-balancing-type", balance_type)
    results = []
    for port_offset, args in enumerate((make_args(checkpoint, *algorithm),
                                        make_megatron_args(checkpoint, *algorithm),
                                        make_megatron_args(checkpoint, *algorithm, *RECOMPUTE))):
        trainer = make_trainer(args, port=port + port_offset)
        trainer.train(0, data)
        results.append(trainer.last_step_metrics)
        if args.train_backend == "megatron":
            destroy_model_parallel()
        dist.destroy_process_group()
    return results


@pytest.mark.parametrize("balance_type", ["aux_loss", pytest.param("seq_aux_loss", marks=pytest.mark.slow)])
def test_router_losses_match_the_fsdp_backend(moe_checkpoint, balance_type):
    fsdp, megatron, recomputed = run_distributed(_both_backends, 1, moe_checkpoint, balance_type)[0]
    assert len(fsdp) == len(megatron) == len(recomputed) == 2
    for step, reference in enumerate(fsdp):
        assert reference["train/moe_aux_loss"] > 0 and reference["train/moe_z_loss"] > 0
        for key in KEYS:
            assert megatron[step][key] == pytest.approx(reference[key], rel=1e-4, abs=1e-6), (step, key)
            assert recomputed[step][key] == pytest.approx(reference[key], rel=1e-4, abs=1e-6), (step, key)


def test_sigmoid_router_losses_match_the_fsdp_backend(tmp_path):
    """GLM-4.5's sigmoid router (biased, with a dense first layer and a shared expert): the losses' probabilities are
    the sigmoid scores normalised over the experts on both backends."""
    from tests.helpers.megatron_families import build_family_checkpoint

    checkpoint = build_family_checkpoint(tmp_path / "glm4_moe", "glm4_moe")
    fsdp, megatron, recomputed = run_distributed(_both_backends, 1, checkpoint, "aux_loss")[0]
    for step, reference in enumerate(fsdp):
        assert reference["train/moe_aux_loss"] > 0 and reference["train/moe_z_loss"] > 0
        for key in KEYS:
            assert megatron[step][key] == pytest.approx(reference[key], rel=1e-4, abs=1e-6), (step, key)
            assert recomputed[step][key] == pytest.approx(reference[key], rel=1e-4, abs=1e-6), (step, key)
