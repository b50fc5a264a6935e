"""megatron-core's model-parallel state (tensor, pipeline, context, expert, data parallel groups) over the default
process group (gloo on the CPU, NCCL on GPUs: fsdp_utils/backend.py's init_default_group starts it).

Not the data split: which samples each data-parallel rank trains on is decided by the Ray side
(slime/ray/train_data.py); this module only says which ranks are peers.
"""

from __future__ import annotations

import torch


def parallel_sizes(args) -> dict:
    """The parallel layout under megatron-core's keyword names (parallel_state and TransformerConfig share them)."""
    return {name: getattr(args, name) for name in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
        "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size")}


def init_model_parallel(args, device: torch.device) -> None:
    """`parallel_state.initialize_model_parallel` from the Megatron parallelism flags; gloo groups are created
    too (the distributed optimizer and dist_checkpointing use them on the CPU)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(**parallel_sizes(args), create_gloo_process_groups=True)
    from megatron.core.tensor_parallel import random as tp_random

    if device.type == "cuda":  # the CUDA RNG tracker (the CPU has none: cpu_shim.py)
        tp_random.model_parallel_cuda_manual_seed(args.seed)


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
