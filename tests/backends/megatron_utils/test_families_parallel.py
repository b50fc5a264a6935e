"""Megatron backend over 2 gloo processes on the GLM-4, GLM-4.5, DeepSeek-V3 (MLA + YaRN + expert groups) and
Moonlight-like (MLA without q_lora) tiny checkpoints: TP=2 gives TP=1's log-probs, entropy, loss and gradients
(with sequence parallelism, which megatron-core requires for MoE layers under TP: multi-head latent attention's
column-parallel down projections, its shared rope key (mla_local_spec.py) and its latent norms on each rank's
tokens included), PP=2 (and CP=2 for the dense GLM-4) gives TP=1's too, and EP=2 (two data-parallel ranks with half the experts and half the
micro-batches each) gives EP=1's log-probs, loss and expert gradients."""

from __future__ import annotations

import pytest
import torch

from tests.backends.megatron_utils.test_expert_parallel import RANK_MICRO_BATCHES
from tests.backends.megatron_utils.test_parallel import _assert_same, _log_probs_loss_grads, _train_inputs
from tests.helpers.fsdp_helpers import run_distributed
from tests.helpers.megatron_families import FAMILIES, MOE_FAMILIES, build_family_checkpoint
from tests.helpers.megatron_helpers import (
    build_megatron,
    hf_named_grads,
    make_megatron_args,
    policy_loss_function,
    step_denominator,
)

pytest.importorskip("megatron.core")


def _marked_slow(families, slow):
    """Every family in CI's representative subset would take minutes (~40 s per run): `slow` run with
    SLIME_RUN_SLOW=1."""
    return [pytest.param(family, marks=pytest.mark.slow) if family in slow else family for family in families]


@pytest.fixture(scope="module", params=_marked_slow(FAMILIES, slow=("moonlight",)))
def family_run(request, tmp_path_factory):
    """(family, checkpoint, TP=1 result)."""
    checkpoint = build_family_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, checkpoint, run_distributed(_log_probs_loss_grads, 1, checkpoint, {})[0]


def test_tp2_equals_tp1(family_run):
    """MoE layers train under TP only with sequence parallelism (megatron-core); the dense GLM-4 both ways."""
    family, checkpoint, reference = family_run
    for sequence_parallel in ((False, True) if family == "glm4" else (True,)):
        extra = ("--sequence-parallel",) if sequence_parallel else ()
        for result in run_distributed(_log_probs_loss_grads, 2, checkpoint, {"tp": 2}, extra):
            _assert_same(result, reference)


@pytest.mark.parametrize("family", _marked_slow(FAMILIES, slow=("glm4", "glm4_moe", "moonlight")))
def test_pp2_equals_pp1(family, tmp_path):
    """Two pipeline stages of two layers: the first holds GLM-4.5's / DeepSeek-V3's dense layer (the MoE layer
    pattern is global, each stage builds its slice); GLM-4 (dense: context parallelism is for dense models) also at
    CP=2."""
    checkpoint = build_family_checkpoint(tmp_path / family, family, num_hidden_layers=4)
    (reference,) = run_distributed(_log_probs_loss_grads, 1, checkpoint, {})
    first, last = run_distributed(_log_probs_loss_grads, 2, checkpoint, {"pp": 2})
    assert first["loss"] == last["loss"]
    _assert_same({**last, "grads": {**first["grads"], **last["grads"]}}, reference)
    if family == "glm4":
        for result in run_distributed(_log_probs_loss_grads, 2, checkpoint, {}, ("--context-parallel-size", "2")):
            _assert_same(result, reference)


def _ep_log_probs_and_grads(rank, world_size, port, checkpoint):
    from slime.backends.megatron_utils.grads import finalize_grads
    from slime.backends.megatron_utils.micro_batches import run_micro_batches
    from slime.backends.megatron_utils.optimizer import wrap_data_parallel

    args = make_megatron_args(checkpoint, "--entropy-coef", "0.01", "--expert-model-parallel-size", world_size,
                              world_size=world_size)  # entropy: a gradient at every token (the clipped ratio has none)
    chunks, hf_config = build_megatron(args, rank, world_size, port)
    ddp_chunks = wrap_data_parallel(chunks)
    everything, per_sample = _train_inputs(hf_config.vocab_size, groups=([0, 1, 2], [3], [4], [5, 6, 7]))
    micro_batches = everything if world_size == 1 else [everything[i] for i in RANK_MICRO_BATCHES[rank]]
    common = dict(temperature=0.7, vocab_size=hf_config.vocab_size, device=torch.device("cpu"))
    forward = run_micro_batches(chunks, micro_batches, **common)
    # The denominator of the whole step (both ranks' samples), as the train flow all-reduces it.
    loss_fn = policy_loss_function(args, micro_batches, per_sample, step_denominator(args, everything, per_sample))
    metrics = run_micro_batches(chunks, micro_batches, loss_of=loss_fn, **common)
    finalize_grads(chunks, ddp_chunks)
    # DDP sums expert gradients over the expert data-parallel group (size 1 at EP=2 with two ranks): each rank's
    # experts' gradients are whole.
    expert_grads = {name: grad for name, grad in hf_named_grads(chunks, hf_config).items() if ".mlp.experts." in name}
    return dict(log_probs=[lp for lp, _ in forward], loss=float(sum(m["pg_loss"] for m in metrics)),
                expert_grads=expert_grads)


@pytest.mark.parametrize("family", _marked_slow(MOE_FAMILIES, slow=("glm4_moe", "moonlight")))
def test_ep2_equals_ep1(family, tmp_path):
    """Two data-parallel ranks with half the experts each and half the micro-batches, tokens exchanged by the
    alltoall dispatcher: EP=1's log-probs, loss and expert gradients."""
    checkpoint = build_family_checkpoint(tmp_path / family, family)
    (reference,) = run_distributed(_ep_log_probs_and_grads, 1, checkpoint)
    results = run_distributed(_ep_log_probs_and_grads, 2, checkpoint)
    for rank, result in enumerate(results):
        for mine, index in zip(result["log_probs"], RANK_MICRO_BATCHES[rank]):
            torch.testing.assert_close(mine, reference["log_probs"][index], rtol=0, atol=2e-5)
    assert sum(result["loss"] for result in results) == pytest.approx(reference["loss"], abs=1e-6)
    names = [set(result["expert_grads"]) for result in results]
    assert names[0] and names[0].isdisjoint(names[1])
    merged = {**results[0]["expert_grads"], **results[1]["expert_grads"]}
    assert set(merged) == set(reference["expert_grads"])
    for name, grad in reference["expert_grads"].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(merged[name], grad, rtol=1e-4, atol=2e-6, msg=name)
