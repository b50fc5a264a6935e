"""Megatron expert parallelism over 2 gloo processes (fp32) on a tiny Qwen3-MoE: EP=2 (two data-parallel ranks,
each with half the experts and half the micro-batches, tokens exchanged by megatron-core's alltoall dispatcher)
gives EP=1's log-probs, loss, expert gradients, gradient norm (megatron's distributed optimizer, over dense and
expert slices) and weights after an optimizer step on the same packed micro-batches; its HF export equals EP=1's
and the checkpoint's (expert shards gathered); a torch_dist folder saved at EP=2 after the step loads at EP=1 to
the same weights (resharded)."""

from __future__ import annotations

import pytest
import torch

from tests.backends.megatron_utils.test_parallel import _train_inputs
from tests.helpers.fsdp_helpers import run_distributed
from tests.helpers.megatron_helpers import (
    build_megatron,
    hf_named_grads,
    make_megatron_args,
    policy_loss_function,
    step_denominator,
)

pytest.importorskip("megatron.core")

NUM_EXPERTS = 4
# EP=1 runs all four micro-batches; at EP=2 data-parallel rank r runs RANK_MICRO_BATCHES[r].
RANK_MICRO_BATCHES = ([0, 1], [2, 3])


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    from slime.utils.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_moe_ep"), arch="qwen3_moe", num_experts=NUM_EXPERTS,
                            num_experts_per_tok=2, seed=5, initializer_range=0.2)


def _ep_run(rank, world_size, port, checkpoint, save_dir):
    from slime.backends.megatron_utils import checkpoint as torch_dist
    from slime.backends.megatron_utils.grads import finalize_grads
    from slime.backends.megatron_utils.hf_weights import model_hf_weights
    from slime.backends.megatron_utils.micro_batches import run_micro_batches
    from slime.backends.megatron_utils.optimizer import build_distributed_optimizer, clip_grad_norm, wrap_data_parallel

    # Adam's eps well above the smallest gradients: its first step moves a weight by lr * g / (|g| + eps), which
    # for |g| near the default 1e-8 turns the gradients' rounding (EP=2 sums in another order; ~1e-11 here, and it
    # differs between CPUs) into weight differences of ~5e-6. At 1e-4 a weight moves at most lr / eps = 100 times
    # its gradient's difference, so the updated weights stay comparable to 1e-6.
    args = make_megatron_args(checkpoint, "--expert-model-parallel-size", world_size, "--lr", "1e-2",
                              "--lr-warmup-iters", "0", "--weight-decay", "0", "--adam-eps", "1e-4",
                              world_size=world_size)
    chunks, hf_config = build_megatron(args, rank, world_size, port)
    ddp_chunks = wrap_data_parallel(chunks)  # the backend's path: DDP grad buffers, the distributed optimizer
    optimizer, _ = build_distributed_optimizer(args, ddp_chunks, torch.float32)
    everything, per_sample = _train_inputs(hf_config.vocab_size, groups=([0, 1, 2], [3], [4], [5, 6, 7]))
    micro_batches = everything if world_size == 1 else [everything[i] for i in RANK_MICRO_BATCHES[rank]]
    common = dict(temperature=0.7, vocab_size=hf_config.vocab_size, device=torch.device("cpu"))
    forward = run_micro_batches(chunks, micro_batches, **common)
    exported = {name: tensor.clone() for name, tensor in model_hf_weights(chunks, hf_config)}
    # The denominator of the whole step (both ranks' samples), as the train flow all-reduces it.
    loss_fn = policy_loss_function(args, micro_batches, per_sample, step_denominator(args, everything, per_sample))
    metrics = run_micro_batches(chunks, micro_batches, loss_of=loss_fn, **common)
    finalize_grads(chunks, ddp_chunks)
    # Expert gradients: DDP's expert buffers are summed over the expert data-parallel group (size 1 at EP=2 with
    # two ranks), so each rank's are whole, and the HF names of this rank's experts with them.
    expert_grads = {name: grad for name, grad in hf_named_grads(chunks, hf_config).items() if ".mlp.experts." in name}
    optimizer.prepare_grads()
    grad_norm = clip_grad_norm(optimizer, 0.0)  # the backend's: over dense and expert slices; no clipping
    optimizer.step_with_ready_grads()
    updated = {name: tensor.clone() for name, tensor in model_hf_weights(chunks, hf_config)}
    loaded = None
    if world_size > 1:
        torch_dist.save_weights(save_dir, chunks, args, hf_config)
    else:  # after the EP=2 run: its folder, resharded to EP=1
        torch_dist.load_model_weights(save_dir, chunks)
        loaded = {name: tensor.clone() for name, tensor in model_hf_weights(chunks, hf_config)}
    return dict(log_probs=[lp for lp, _ in forward], loss=float(sum(m["pg_loss"] for m in metrics)),
                expert_grads=expert_grads, grad_norm=grad_norm, exported=exported, updated=updated, loaded=loaded)


def test_ep2_equals_ep1_and_its_weights_gather_and_reshard(moe_checkpoint, tmp_path):
    from safetensors.torch import load_file

    save_dir = tmp_path / "ep2_torch_dist"
    first, second = run_distributed(_ep_run, 2, moe_checkpoint, save_dir)
    reference = run_distributed(_ep_run, 1, moe_checkpoint, save_dir)[0]

    for rank, result in enumerate((first, second)):
        for mine, index in zip(result["log_probs"], RANK_MICRO_BATCHES[rank]):
            torch.testing.assert_close(mine, reference["log_probs"][index], rtol=0, atol=2e-5)
    assert first["loss"] + second["loss"] == pytest.approx(reference["loss"], abs=1e-6)
    assert first["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    assert second["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    # Each rank holds the gradients of its own experts, EP=1's for them.
    expert_names = {rank: set(result["expert_grads"]) for rank, result in enumerate((first, second))}
    assert expert_names[0].isdisjoint(expert_names[1])
    merged = {**first["expert_grads"], **second["expert_grads"]}
    assert set(merged) == set(reference["expert_grads"])
    for name, grad in reference["expert_grads"].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(merged[name], grad, rtol=1e-4, atol=2e-6, msg=name)

    # HF export on rank 0: every expert, equal to the checkpoint before the update and to EP=1's after it.
    on_disk = load_file(str(moe_checkpoint / "model.safetensors"))
    assert second["exported"] == {} and second["updated"] == {}
    assert set(first["exported"]) == set(on_disk)
    for name, tensor in on_disk.items():
        torch.testing.assert_close(first["exported"][name], tensor, rtol=0, atol=0, msg=name)
    for name, tensor in reference["updated"].items():
        torch.testing.assert_close(first["updated"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    # The EP=2 torch_dist folder resharded to EP=1.
    loaded = reference["loaded"]
    assert set(loaded) == set(first["updated"])
    for name, tensor in first["updated"].items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)
