"""Megatron backend over 2 gloo processes: TP=2, PP=2 and CP=2 give the same
log-probs, entropy, loss and gradients as TP=1 on the same packed batch (TP=1 takes the hidden-state log-prob
head, TP=2 the vocab-parallel one; CP=2 splits samples of uneven lengths, one shorter than 2 x CP), and the
trainer's two optimizer steps at CP=2 (megatron's DDP and distributed optimizer over data x context ranks) equal
CP=1's."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.fsdp_helpers import make_train_data, make_trainer, run_distributed
from tests.helpers.megatron_helpers import (
    build_megatron,
    hf_named_grads,
    make_megatron_args,
    policy_loss_function,
    step_denominator,
)

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from slime.utils.tiny_model import build_tiny_model

    # 4 layers: two per pipeline stage.
    return build_tiny_model(tmp_path_factory.mktemp("tiny_mcore"), arch="qwen3", num_hidden_layers=4)


def _train_inputs(vocab_size: int, seed: int = 0, groups=([0, 1, 2], [3, 4], [5, 6, 7])):
    """Packed micro-batches of 8 random samples (`groups`: the samples of each) and their loss inputs."""
    from slime.backends.packing import float_tensors, pack_samples

    data = make_train_data(8, vocab_size, seed=seed)
    # sample 4: 3 tokens, fewer than 2 x CP at CP = 2 (padded, all of it on one rank)
    data["tokens"][4], data["response_lengths"][4], data["loss_masks"][4] = data["tokens"][4][:3], 2, [1, 1]
    tokens, lengths = data["tokens"], data["response_lengths"]
    micro_batches = [pack_samples(tokens, lengths, indices) for indices in groups]
    masks = float_tensors(data["loss_masks"])
    generator = torch.Generator().manual_seed(seed)
    per_sample = dict(
        loss_masks=masks,
        advantages=[torch.randn(len(m), generator=generator) for m in masks],
        old_log_probs=[-torch.rand(len(m), generator=generator) * 3 for m in masks],
    )
    return micro_batches, per_sample


def _log_probs_loss_grads(rank, world_size, port, checkpoint, parallel, extra=()):
    from slime.backends.megatron_utils.micro_batches import run_micro_batches
    from slime.backends.megatron_utils.optimizer import wrap_data_parallel

    args = make_megatron_args(checkpoint, "--entropy-coef", "0.01", *extra, world_size=world_size, **parallel)
    chunks, hf_config = build_megatron(args, rank, world_size, port)
    ddp_chunks = wrap_data_parallel(chunks)  # the gradients accumulate in its buffers (param.main_grad)
    micro_batches, per_sample = _train_inputs(hf_config.vocab_size)
    common = dict(temperature=0.7, vocab_size=hf_config.vocab_size, device=torch.device("cpu"))
    forward = run_micro_batches(chunks, micro_batches, **common)
    loss_fn = policy_loss_function(args, micro_batches, per_sample, step_denominator(args, micro_batches, per_sample))
    metrics = run_micro_batches(chunks, micro_batches, loss_of=loss_fn, **common)
    from slime.backends.megatron_utils.grads import finalize_grads

    if args.context_parallel_size > 1:
        # DDP's reduce-scatter leaves each rank only its slice of the sum: the full sum over data x context
        # parallel ranks here (the trainer-step test runs DDP and the distributed optimizer themselves)
        from megatron.core import parallel_state

        for chunk in chunks:
            for param in chunk.parameters():
                torch.distributed.all_reduce(param.main_grad,
                                             group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        finalize_grads(chunks, [])  # the tensor-parallel sums
    else:
        finalize_grads(chunks, ddp_chunks)
    return dict(log_probs=torch.cat([lp for lp, _ in forward]), entropy=torch.cat([e for _, e in forward]),
                loss=float(sum(m["pg_loss"] for m in metrics)), grads=hf_named_grads(chunks, hf_config))


@pytest.fixture(scope="module")
def tp1_reference(tiny_checkpoint):
    return run_distributed(_log_probs_loss_grads, 1, tiny_checkpoint, {})[0]


def _assert_same(result, reference):
    torch.testing.assert_close(result["log_probs"], reference["log_probs"], rtol=0, atol=2e-5)
    torch.testing.assert_close(result["entropy"], reference["entropy"], rtol=0, atol=2e-5)
    assert result["loss"] == pytest.approx(reference["loss"], abs=1e-6)
    assert set(result["grads"]) == set(reference["grads"])
    for name, grad in reference["grads"].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(result["grads"][name], grad, rtol=1e-4, atol=2e-6, msg=name)


def test_tp2_equals_tp1(tiny_checkpoint, tp1_reference):
    results = run_distributed(_log_probs_loss_grads, 2, tiny_checkpoint, {"tp": 2})
    for result in results:
        _assert_same(result, tp1_reference)


def test_pp2_equals_tp1(tiny_checkpoint, tp1_reference):
    first, last = run_distributed(_log_probs_loss_grads, 2, tiny_checkpoint, {"pp": 2})
    assert first["loss"] == last["loss"]
    merged = {**first["grads"], **last["grads"]}
    _assert_same({**last, "grads": merged}, tp1_reference)


def test_cp2_equals_tp1(tiny_checkpoint, tp1_reference):
    results = run_distributed(_log_probs_loss_grads, 2, tiny_checkpoint, {}, ("--context-parallel-size", "2"))
    for result in results:
        _assert_same(result, tp1_reference)


@pytest.mark.slow  # ~60 s, 4 processes: the vocab-parallel head on each CP rank's response positions
def test_tp2_cp2_equals_tp1(tiny_checkpoint, tp1_reference):
    results = run_distributed(_log_probs_loss_grads, 4, tiny_checkpoint, {"tp": 2}, ("--context-parallel-size", "2"))
    for result in results:
        _assert_same(result, tp1_reference)


def _trained(rank, world_size, port, checkpoint, data, cp, overrides):
    from tests.backends.megatron_utils.test_backend import ALGORITHM

    trainer = make_trainer(make_megatron_args(checkpoint, *ALGORITHM, "--context-parallel-size", cp,
                                              world_size=world_size, **overrides), rank, world_size, port)
    metrics = trainer.train(0, data)
    return metrics, {name: tensor.cpu() for name, tensor in trainer.backend.hf_weights(None)}


def check_cp2_trainer_against_cp1(checkpoint, overrides=None, rel=1e-5, atol=2e-5):
    """Two optimizer steps (2 micro-batches each, one sample shorter than 2 x CP) at CP=2 over 2 processes and at
    CP=1 in one: the same metrics and HF weights (`overrides` of the parsed args)."""
    from safetensors.torch import load_file

    data = make_train_data(8, vocab_size=300, seed=3, num_steps=2)
    data["tokens"][1], data["response_lengths"][1], data["loss_masks"][1] = data["tokens"][1][:3], 1, [1]
    metrics, params = run_distributed(_trained, 1, checkpoint, data, 1, overrides or {})[0]
    (cp_metrics, cp_params), (other_metrics, other_params) = run_distributed(_trained, 2, checkpoint, data, 2,
                                                                             overrides or {})
    assert other_params == {}  # the HF export comes from the first replica's first rank
    for key in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm", "train/lr"):
        assert other_metrics[key] == cp_metrics[key], key
        assert cp_metrics[key] == pytest.approx(metrics[key], rel=rel, abs=1e-7), key
    assert set(cp_params) == set(params)
    original = load_file(str(checkpoint / "model.safetensors"))
    for name, value in cp_params.items():
        if value.dtype == torch.float32:  # the steps moved every weight (a bf16 norm weight may round back)
            assert not torch.equal(value, original[name].to(value.dtype)), name
        torch.testing.assert_close(value, params[name], rtol=0, atol=atol, msg=name)


def test_cp2_trainer_steps_equal_cp1(tiny_checkpoint):
    check_cp2_trainer_against_cp1(tiny_checkpoint)
