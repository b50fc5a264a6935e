"""Shared helpers for the Megatron backend tests: args of --train-backend megatron, a model built and
filled from an HF checkpoint in the calling process, full gradients under HF names, and a policy-loss step that
mirrors the FSDP trainer's (the same loss functions and global denominator)."""

from __future__ import annotations

import torch

from tests.helpers.fsdp_helpers import make_args


def make_megatron_args(hf_checkpoint, *extra, world_size=1, tp: int = 1, pp: int = 1, vpp: int | None = None,
                       **overrides):
    """Parsed args of --train-backend megatron with the given tensor / pipeline parallel sizes (`vpp`: virtual
    pipeline stages per pipeline rank); `overrides` set after parsing (make_args)."""
    virtual = () if vpp is None else ("--num-virtual-stages-per-pipeline-rank", vpp)
    return make_args(hf_checkpoint, "--train-backend", "megatron", "--tensor-model-parallel-size", tp,
                     "--pipeline-model-parallel-size", pp, *virtual, *extra, world_size=world_size, **overrides)


def build_megatron(args, rank: int, world_size: int, port: int):
    """(model chunks, hf config) of this rank, weights from args.hf_checkpoint."""
    from slime.backends.megatron_utils.cpu_shim import apply_cpu_shim
    from slime.backends.megatron_utils.hf_config import load_hf_config
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime.backends.process_group import init_default_group

    cpu = torch.device("cpu")
    apply_cpu_shim()
    init_default_group(cpu, rank, world_size, "127.0.0.1", port)
    init_model_parallel(args, cpu)
    hf_config = load_hf_config(args.hf_checkpoint)
    return build_chunks(args, hf_config), hf_config


def build_chunks(args, hf_config, device: torch.device = torch.device("cpu")):
    """Another model in a process whose groups build_megatron set up (the same parallel layout)."""
    from slime.backends.megatron_utils.hf_weights import load_hf_weights
    from slime.backends.megatron_utils.model import build_model_chunks

    torch.manual_seed(0)
    chunks = build_model_chunks(args, hf_config, device)
    load_hf_weights(chunks, args.hf_checkpoint, hf_config)
    return chunks


def hf_named_grads(chunks, hf_config) -> dict[str, torch.Tensor]:
    """This rank's pipeline stage's full gradients under HF names (TP shards gathered), from the DDP grad buffers
    (at DP=1: with more data-parallel ranks each holds only its slice's sum)."""
    from megatron.core import parallel_state

    from slime.backends.megatron_utils import tp_shards
    from slime.backends.megatron_utils.hf_mapping import mapping_for
    from slime.backends.megatron_utils.names import is_stacked_experts, named_global_parameters, unstack_experts

    mapping = mapping_for(hf_config)
    num_experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "n_routed_experts", None) or 0
    num_local_experts = num_experts // parallel_state.get_expert_model_parallel_world_size()
    first_expert = parallel_state.get_expert_model_parallel_rank() * num_local_experts
    grads = {}
    for name, param in named_global_parameters(chunks):
        full = tp_shards.full_tensor(name, param, param.main_grad)
        pairs = unstack_experts(name, full, first_expert) if is_stacked_experts(name) else [(name, full)]
        for weight_name, grad in pairs:
            grads.update((hf, t.clone()) for hf, t in mapping.to_hf(weight_name, grad, hf_config))
    return grads


def step_denominator(args, micro_batches, per_sample) -> float:
    from slime.backends.loss import aggregation_mode
    from slime.utils.ppo_utils import loss_denominator

    masks = [per_sample["loss_masks"][i] for mb in micro_batches for i in mb.sample_indices]
    return max(float(loss_denominator(aggregation_mode(args), masks, args.loss_agg_constant, None)), 1.0)


def policy_loss_function(args, micro_batches, per_sample, denominator):
    """loss_function(micro_batch, log_probs, entropy) of the FSDP trainer's policy loss."""
    from slime.backends.loss import LossReducer, MicroBatchTensors, get_loss_function

    loss_fn = get_loss_function(args)

    def compute(index, outputs):
        log_probs, entropy = outputs
        indices = micro_batches[index].sample_indices
        batch = MicroBatchTensors(
            loss_masks=[per_sample["loss_masks"][i] for i in indices],
            advantages=torch.cat([per_sample["advantages"][i] for i in indices]),
            old_log_probs=torch.cat([per_sample["old_log_probs"][i] for i in indices]))
        reduce = LossReducer(args, batch.loss_masks, denominator,
                             [float(per_sample["loss_masks"][i].sum()) for i in indices])
        return loss_fn(args, log_probs, entropy, batch, reduce)

    return compute
