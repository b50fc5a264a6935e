"""Megatron backend over 2 gloo processes on the GLM-4, GLM-4.5, DeepSeek-V3 (MLA + YaRN + expert groups) and
Moonlight-like (MLA without q_lora) tiny checkpoints: TP=2 gives TP=1's log-probs, entropy, loss and gradients
(with sequence parallelism, which megatron-core requires for MoE layers under TP: multi-head latent attention's
column-parallel down projections, its shared rope key (mla_local_spec.py) and its latent norms on each rank's
tokens included), and EP=2 (two data-parallel ranks with half the experts each, the same
micro-batches on both) gives EP=1's log-probs and twice its gradients."""

from __future__ import annotations

import pytest
import torch

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


@pytest.fixture(scope="module", params=FAMILIES)
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


def _ep_log_probs_and_grads(rank, world_size, port, checkpoint):
    from megatron.core import parallel_state

    from slime.backends.megatron_utils.grads import finalize_grads, is_expert
    from slime.backends.megatron_utils.micro_batches import run_micro_batches
    from slime.backends.megatron_utils.optimizer import wrap_data_parallel

    args = make_megatron_args(checkpoint, "--expert-model-parallel-size", world_size, world_size=world_size)
    chunks, hf_config = build_megatron(args, rank, world_size, port)
    wrap_data_parallel(chunks)  # the gradients accumulate in its buffers (param.main_grad), not synchronised here
    micro_batches, per_sample = _train_inputs(hf_config.vocab_size)
    common = dict(temperature=0.7, vocab_size=hf_config.vocab_size, device=torch.device("cpu"))
    forward = run_micro_batches(chunks, micro_batches, **common)
    loss_fn = policy_loss_function(args, micro_batches, per_sample, step_denominator(args, micro_batches, per_sample))
    run_micro_batches(chunks, micro_batches, loss_of=loss_fn, **common)
    # Every rank ran the same micro-batches: the dense gradients summed over the data-parallel ranks, like the
    # expert gradients (the dispatcher brought both ranks' tokens to each expert), are world_size x EP=1's.
    for chunk in chunks:
        for param in chunk.parameters():
            if not is_expert(param):
                torch.distributed.all_reduce(param.main_grad, group=parallel_state.get_data_parallel_group())
    finalize_grads(chunks, [])
    grads = {name: grad / world_size for name, grad in hf_named_grads(chunks, hf_config).items()}
    return dict(log_probs=torch.cat([lp for lp, _ in forward]), grads=grads)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_ep2_equals_ep1(family, tmp_path):
    checkpoint = build_family_checkpoint(tmp_path / family, family)
    (reference,) = run_distributed(_ep_log_probs_and_grads, 1, checkpoint)
    results = run_distributed(_ep_log_probs_and_grads, 2, checkpoint)
    experts = [{name for name in result["grads"] if ".mlp.experts." in name} for result in results]
    assert experts[0] and not experts[0] & experts[1]  # each rank holds half the experts
    merged = {**results[0]["grads"], **results[1]["grads"]}
    assert set(merged) == set(reference["grads"])
    for result in results:
        torch.testing.assert_close(result["log_probs"], reference["log_probs"], rtol=0, atol=2e-5)
    for name, grad in reference["grads"].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(merged[name], grad, rtol=1e-4, atol=2e-6, msg=name)
