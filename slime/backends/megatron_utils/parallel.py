"""Process groups for the Megatron backend: torch.distributed (gloo on the CPU, NCCL on the GPU) and
megatron-core's model-parallel state (tensor, pipeline, context, expert, data parallel) over it.

Not the data split: which samples each data-parallel rank trains on is decided by the Ray side
(slime/ray/train_data.py); this module only says which ranks are peers.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int) -> torch.device:
    """Start the default process group (if not yet started) and return this rank's device."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(minutes=30))
    return device


def init_model_parallel(args) -> None:
    """`parallel_state.initialize_model_parallel` from the Megatron parallelism flags; gloo groups are created
    too (the distributed optimizer and dist_checkpointing use them on the CPU)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        create_gloo_process_groups=True,
    )
    from megatron.core.tensor_parallel import random as tp_random

    if torch.cuda.is_available():
        tp_random.model_parallel_cuda_manual_seed(args.seed)


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
