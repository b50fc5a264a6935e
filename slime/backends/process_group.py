"""The training processes' device and default process group, shared by both training backends."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

# The default group's timeout, here or where a launcher creates the group first (slime/ray/actor_group.py).
PROCESS_GROUP_TIMEOUT = timedelta(minutes=30)


def training_device(args, rank: int) -> torch.device:
    """This rank's GPU when training on CUDA (--device cuda, or auto with a GPU), else the CPU."""
    if args.device == "cuda" or (args.device in (None, "auto") and torch.cuda.is_available()):
        local_rank = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_default_group(device: torch.device, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    """The default process group (nccl on GPUs, gloo on the CPU), unless a launcher made it already."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world_size,
                                timeout=PROCESS_GROUP_TIMEOUT)
