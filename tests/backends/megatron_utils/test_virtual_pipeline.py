"""Megatron backend with virtual pipeline stages (megatron's interleaved 1F1B schedule) over 2 gloo processes:
PP=2 x VPP=2 (4 layers: each rank holds two one-layer chunks, rank 0 layers 0 and 2, rank 1 layers 1 and 3)
gives PP=1's log-probs, entropy, loss and gradients on the same packed batch; the trainer's optimizer steps
(distributed optimizer and clipping over every chunk, a KL loss whose reference pass switches every chunk's
weights) equal PP=1's; its HF export is the PP=1 model's; and its
torch_dist checkpoint loads at PP=1 with identical weights and outputs. Slow: an MoE model's routing records and
replay per chunk, and the PPO critic, as PP=1's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.backends.megatron_utils.test_backend import ALGORITHM
from tests.backends.megatron_utils.test_critic import critic_checkpoint, tp1_runs  # noqa: F401 - the module-scoped fixtures
from tests.backends.megatron_utils.test_parallel import _train_inputs
from tests.helpers.fsdp_helpers import make_train_data, make_trainer, run_distributed
from tests.helpers.megatron_helpers import (
    build_megatron,
    hf_named_grads,
    make_megatron_args,
    policy_loss_function,
    step_denominator,
)

pytest.importorskip("megatron.core")

INTERLEAVED = {"pp": 2, "vpp": 2}
# Four micro-batches: two groups of PP=2 in megatron's interleaved schedule.
GROUPS = ([0, 1], [2, 3, 4], [5], [6, 7])


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from slime.utils.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_vpp"), arch="qwen3", num_hidden_layers=4, seed=5)


def _log_probs_loss_grads(rank, world_size, port, checkpoint, parallel):
    from slime.backends.megatron_utils.grads import finalize_grads
    from slime.backends.megatron_utils.micro_batches import run_micro_batches
    from slime.backends.megatron_utils.optimizer import wrap_data_parallel

    args = make_megatron_args(checkpoint, "--entropy-coef", "0.01", world_size=world_size, **parallel)
    chunks, hf_config = build_megatron(args, rank, world_size, port)
    ddp_chunks = wrap_data_parallel(chunks)
    micro_batches, per_sample = _train_inputs(hf_config.vocab_size, seed=1, groups=GROUPS)
    common = dict(temperature=0.7, vocab_size=hf_config.vocab_size, device=torch.device("cpu"))
    forward = run_micro_batches(chunks, micro_batches, **common)
    loss_fn = policy_loss_function(args, micro_batches, per_sample, step_denominator(args, micro_batches, per_sample))
    metrics = run_micro_batches(chunks, micro_batches, loss_of=loss_fn, **common)
    finalize_grads(chunks, ddp_chunks)
    layers = [[name for name, _ in chunk.named_parameters() if name.startswith("decoder.layers.")] for chunk in chunks]
    return dict(num_chunks=len(chunks), layers=layers, log_probs=torch.cat([lp for lp, _ in forward]),
                entropy=torch.cat([e for _, e in forward]), loss=float(sum(m["pg_loss"] for m in metrics)),
                grads=hf_named_grads(chunks, hf_config))


def test_pp2_vpp2_equals_pp1(tiny_checkpoint):
    reference = run_distributed(_log_probs_loss_grads, 1, tiny_checkpoint, {})[0]
    first, last = run_distributed(_log_probs_loss_grads, 2, tiny_checkpoint, INTERLEAVED)
    assert first["num_chunks"] == last["num_chunks"] == 2 and reference["num_chunks"] == 1
    assert all(len(chunk_layers) > 0 for chunk_layers in first["layers"] + last["layers"])
    for rank, layers in enumerate((first["grads"], last["grads"])):  # rank r holds layers r and r + 2
        own = {int(name.split(".")[2]) for name in layers if name.startswith("model.layers.")}
        assert own == {rank, rank + 2}, own
    assert first["loss"] == last["loss"]
    for result in (first, last):  # the last stage's outputs, broadcast to both
        torch.testing.assert_close(result["log_probs"], reference["log_probs"], rtol=0, atol=2e-5)
        torch.testing.assert_close(result["entropy"], reference["entropy"], rtol=0, atol=2e-5)
        assert result["loss"] == pytest.approx(reference["loss"], abs=1e-6)
    merged = {**first["grads"], **last["grads"]}
    assert set(merged) == set(reference["grads"])
    for name, grad in reference["grads"].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(merged[name], grad, rtol=1e-4, atol=2e-6, msg=name)


def _forward(trainer, data) -> list:
    """The backend's forward-only log-probs and entropy of `data`'s first step (the flow's schedule), on the host."""
    return [tuple(t.cpu() for t in output) for output in trainer.backend.forward_only(trainer._schedule(data)[0])]


def _host_hf_weights(trainer) -> dict:
    return {name: tensor.cpu() for name, tensor in trainer.backend.hf_weights(None)}


def _with_reference(checkpoint) -> tuple:
    """A KL loss against the initial weights: the reference pass switches every chunk's weights and back."""
    return (*ALGORITHM, "--use-kl-loss", "--kl-loss-coef", "0.1", "--ref-load", checkpoint)


def interleaved_train_and_save(rank, world_size, port, checkpoint, save, data, overrides):
    """PP=2 x VPP=2: the HF export before training, one rollout of steps, a save; (metrics, HF weights, outputs)."""
    from safetensors.torch import load_file

    trainer = make_trainer(make_megatron_args(checkpoint, *_with_reference(checkpoint), "--save", save,
                                              world_size=world_size, **overrides, **INTERLEAVED),
                           rank, world_size, port, with_ref=True)
    backend = trainer.backend
    assert len(backend.model_chunks) == len(backend.ddp_chunks) == 2 and backend.num_micro_batches_multiple == 2
    exported = _host_hf_weights(trainer)  # every chunk's layers, by their global numbers, on rank 0
    if rank == 0:
        original = load_file(str(checkpoint / "model.safetensors"))
        assert set(exported) == set(original)
        assert all(torch.equal(exported[k], original[k].to(exported[k].dtype)) for k in original)  # bf16 on GPUs
    else:
        assert exported == {}
    metrics = trainer.train(0, data)
    trainer.save_model(0, run_state={"data_source": {}})
    return metrics, _host_hf_weights(trainer), _forward(trainer, data)


def one_stage_train_and_load(rank, world_size, port, checkpoint, save, data, overrides):
    """PP=1: the same rollout's steps, then the PP=2 x VPP=2 save loaded; (metrics, HF weights, the loaded run's
    start rollout, HF weights and outputs)."""
    from slime.backends.megatron_utils.parallel import destroy_model_parallel

    reference = make_trainer(make_megatron_args(checkpoint, *_with_reference(checkpoint), **overrides), port=port,
                             with_ref=True)
    metrics = reference.train(0, data)
    params = _host_hf_weights(reference)
    destroy_model_parallel()
    dist.destroy_process_group()
    loaded = make_trainer(make_megatron_args(checkpoint, *ALGORITHM, "--load", save, **overrides), port=port + 1)
    result = metrics, params, loaded.start_rollout_id, _host_hf_weights(loaded), _forward(loaded, data)
    destroy_model_parallel()
    return result


def check_interleaved_against_one_stage(checkpoint, save, overrides=None, rel=1e-5, atol=2e-5, outputs_atol=1e-6):
    """Runs both sides (2 processes, then 1; `overrides` of the parsed args) and checks: the same steps, weights,
    and the save's outputs at PP=1."""
    data = make_train_data(8, vocab_size=300, seed=6, num_steps=2)  # 2 steps of 2 micro-batches (mbs 2)
    ranks = run_distributed(interleaved_train_and_save, 2, checkpoint, save, data, overrides or {})
    (metrics, params, start, loaded_params, loaded_outputs) = run_distributed(
        one_stage_train_and_load, 1, checkpoint, save, data, overrides or {})[0]
    (vpp_metrics, vpp_params, vpp_outputs), (other_metrics, other_params, other_outputs) = ranks
    assert other_params == {}
    assert metrics["train/kl_loss"] > 0  # the second step's policy has moved off the reference
    for key in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/kl_loss", "train/grad_norm", "train/lr"):
        assert other_metrics[key] == vpp_metrics[key], key
        assert vpp_metrics[key] == pytest.approx(metrics[key], rel=rel, abs=1e-7), key
    assert set(vpp_params) == set(params)
    for name, value in vpp_params.items():  # clipped AdamW steps over both chunks, as PP=1's
        torch.testing.assert_close(value, params[name], rtol=0, atol=atol, msg=name)
    assert start == 1 and set(loaded_params) == set(vpp_params)
    for name, value in loaded_params.items():  # the checkpoint resharded from 2 x 2 chunks to one model
        assert torch.equal(value, vpp_params[name]), name
    for mine, theirs in ((vpp_outputs, loaded_outputs), (other_outputs, loaded_outputs)):
        assert len(mine) == len(theirs) == 2
        for (log_probs, entropy), (loaded_log_probs, loaded_entropy) in zip(mine, theirs):
            torch.testing.assert_close(log_probs, loaded_log_probs, rtol=0, atol=outputs_atol)
            torch.testing.assert_close(entropy, loaded_entropy, rtol=0, atol=outputs_atol)


def test_pp2_vpp2_trainer_steps_as_pp1_and_its_checkpoint_loads_at_pp1(tiny_checkpoint, tmp_path):
    check_interleaved_against_one_stage(tiny_checkpoint, tmp_path / "save")


def _recorded_routing(rank, world_size, port, checkpoint, data, parallel):
    """--use-routing-replay: the old-policy pass's old log-probs and the routing records its micro-batches carry
    into training, then one step trained on them."""
    args = make_megatron_args(checkpoint, "--use-routing-replay", "--get-mismatch-metrics", "--micro-batch-size", "2",
                              world_size=world_size, **parallel)
    trainer = make_trainer(args, rank, world_size, port)
    schedule, per_sample, _ = trainer._prepare(data)
    records = [micro_batch.routed_experts.clone() for step in schedule for micro_batch in step]
    return per_sample["old_log_probs"], records, trainer.train(0, data)


@pytest.mark.slow  # 30-60 s: the MoE twin of the dense tests above
def test_pp2_vpp2_records_and_replays_each_chunks_moe_layers(tmp_path):
    from slime.utils.tiny_model import build_tiny_model

    checkpoint = build_tiny_model(tmp_path / "moe", arch="qwen3_moe", num_hidden_layers=4, seed=3, num_experts=4,
                                  num_experts_per_tok=2)
    data = make_train_data(8, vocab_size=300, seed=7, with_rollout_log_probs=True)
    old_log_probs, records, metrics = run_distributed(_recorded_routing, 1, checkpoint, data, {})[0]
    assert len(records) == 4 and all((record >= 0).all() for record in records)
    for rank, (vpp_old, vpp_records, vpp_metrics) in enumerate(
            run_distributed(_recorded_routing, 2, checkpoint, data, INTERLEAVED)):
        own, other = [rank, rank + 2], [1 - rank, 3 - rank]  # the MoE layers of this rank's two chunks
        assert len(vpp_records) == len(records)
        for vpp_record, record in zip(vpp_records, records):
            assert torch.equal(vpp_record[:, own], record[:, own]) and (vpp_record[:, other] == -1).all()
        for vpp, reference in zip(vpp_old, old_log_probs):
            torch.testing.assert_close(vpp, reference, rtol=0, atol=2e-5)
        for key in ("train/loss", "train/pg_loss", "train/grad_norm"):
            assert vpp_metrics[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key


def _interleaved_critic(rank, world_size, port, checkpoint, data, returns):
    from tests.backends.megatron_utils.test_critic import CRITIC, _critic_run

    args = make_megatron_args(checkpoint, *CRITIC, "--critic-load", checkpoint, world_size=world_size, **INTERLEAVED)
    return _critic_run(rank, world_size, port, args, data, returns)


@pytest.mark.slow  # ~40 s: the PPO critic (value head on the last chunk) at PP=2 x VPP=2
def test_pp2_vpp2_critic_equals_pp1(critic_checkpoint, tp1_runs):
    from tests.backends.megatron_utils.test_critic import _assert_same_run, _batch

    data, returns = _batch()  # 6 samples in 3 micro-batches of 2, split to 4 for the interleaved schedule
    first, last = run_distributed(_interleaved_critic, 2, critic_checkpoint, data, returns)
    assert not set(first["grads"]) & set(last["grads"])
    for run in (first, last):
        _assert_same_run({**run, "grads": {**first["grads"], **last["grads"]}}, tp1_runs[1], grad_rtol=1e-4)
