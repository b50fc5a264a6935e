"""Moving weights from a trainer process into an inference engine process.

Two transports, both used by the engine's HTTP server and by the trainer:

- By handle (same host): `serialize_named_tensors` pickles tensors with torch's multiprocessing reductions, so only
  handles travel: a shared-memory file name for CPU tensors (the `file_system` strategy, which an unrelated process
  can open, unlike the default file-descriptor strategy) and a CUDA IPC handle for GPU tensors. The pickle is
  base64 text: one item of `serialized_named_tensors` in `POST /update_weights_from_tensor`.
  `deserialize_named_tensors` maps them back in the receiver. `pack_named_tensors` first puts a bucket's tensors
  into one buffer, so a bucket is one handle.
- By collective (any host): `init_custom_process_group` builds a torch.distributed group that is independent of the
  default one (the engine and the trainer's rank 0 are not in any common default group), and
  `broadcast_named_tensors` / `receive_named_tensors` move tensors over it from rank 0.

Not a checkpoint format and not a general RPC layer: tensors are only valid while the sender keeps them alive.
"""

from __future__ import annotations

import base64
import contextlib
import io
import threading
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
import torch.multiprocessing.reductions

from slime.utils.tensor_unpickler import ForbiddenPickleError, loads_named_tensors

DEFAULT_GROUP_TIMEOUT = timedelta(minutes=10)

_sharing_strategy_lock = threading.Lock()
PACK_ALIGN_BYTES = 16  # every packed tensor starts aligned for any dtype (and for vectorized copies)


@contextlib.contextmanager
def _file_system_sharing():
    """CPU tensors shared inside this block get a shared-memory file name that an unrelated process can open."""
    with _sharing_strategy_lock:
        previous_strategy = torch_mp.get_sharing_strategy()
        torch_mp.set_sharing_strategy("file_system")
        try:
            yield
        finally:
            torch_mp.set_sharing_strategy(previous_strategy)


def pack_named_tensors(named_tensors) -> list[tuple[str, torch.Tensor]]:
    """The tensors (all on one device) copied into one fresh buffer, as views of it: serialized, the whole list is
    one shared-memory segment or one CUDA IPC handle however many tensors it holds, so the sender shares and the
    receiver opens it once (per-tensor handles cost a share and an open each). On the CPU the buffer is made in
    shared memory, so `serialize_named_tensors` copies nothing more. Fresh on every call: a receiver may still be
    reading the previous one."""
    named_tensors = list(named_tensors)
    if not named_tensors:
        return []
    offsets, total = [], 0
    for _, tensor in named_tensors:
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // PACK_ALIGN_BYTES) * PACK_ALIGN_BYTES
    buffer = torch.empty(max(total, PACK_ALIGN_BYTES), dtype=torch.uint8, device=named_tensors[0][1].device)
    if buffer.device.type == "cpu":
        with _file_system_sharing():
            buffer.share_memory_()
    packed = []
    for (name, tensor), offset in zip(named_tensors, offsets):
        nbytes = tensor.numel() * tensor.element_size()
        view = buffer[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor.detach())
        packed.append((name, view))
    return packed


def serialize_named_tensors(named_tensors) -> str:
    """Pickle `[(name, tensor), ...]` by handle and return base64 text.

    CPU tensors are moved into shared memory in place (file_system strategy). Lifetime follows torch's protocol:
    pickling takes one extra reference on the segment, which the receiver's unpickling takes over, so the segment
    outlives the sender's tensor and is unlinked once the receiver frees its copy (deserialize each string exactly
    once; a string never deserialized holds its segment until the sender process exits). CUDA tensors travel as
    IPC handles and the sender keeps the block until the receiver releases it (the sender must stay alive).
    """
    detached = []
    for name, tensor in named_tensors:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise ValueError(f"named_tensors must be (str, torch.Tensor) pairs, got ({type(name)}, {type(tensor)})")
        detached.append((name, tensor.detach()))
    buffer = io.BytesIO()
    with _file_system_sharing():
        ForkingPickler(buffer).dump(detached)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def deserialize_named_tensors(serialized: str) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `serialize_named_tensors`: map the sender's tensors into this process (no copy yet).

    Decoded by `slime.utils.tensor_unpickler`, which admits only torch's tensor / storage rebuild functions: a
    payload naming anything else is rejected before any object is built (a plain unpickle would run it). The
    returned tensors alias the sender's memory; copy them (e.g. into model parameters) before the sender frees
    them. Raises ValueError when the text is not a serialized tensor list.
    """
    try:
        payload = base64.b64decode(serialized.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as error:
        raise ValueError(f"serialized_named_tensors item is not base64 text: {error}") from error
    try:
        return loads_named_tensors(payload)
    except ForbiddenPickleError as error:
        raise ValueError(f"serialized_named_tensors item rejected: {error}") from error
    except Exception as error:  # any decode / shared-memory failure of an admitted payload is a bad input
        raise ValueError(f"serialized_named_tensors item could not be deserialized: {error!r}") from error


def init_custom_process_group(
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta = DEFAULT_GROUP_TIMEOUT,
):
    """Create a process group of `world_size` ranks that does not involve the default group.

    Works whether or not this process already called `init_process_group` (a trainer has a default group, an
    engine does not). `init_method` is a rendezvous URL such as "tcp://127.0.0.1:29500"; `backend` "gloo" (CPU)
    or "nccl" (GPU). Use it with `dist.broadcast(..., group=group, group_src=0)` or the helpers below.
    """
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world, rendezvous

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    if group_name in _world.pg_names.values():
        raise ValueError(f"a process group named {group_name!r} already exists in this process")
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    # A prefix keeps this group's keys apart from any other group that shares the same store address.
    prefix_store = dist.PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(
        world_size, rank, [], dist.Backend(backend), prefix_store, group_name=group_name, timeout=timeout
    )
    # Identity rank mapping: group rank i is "global" rank i for collectives called with this group.
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_custom_process_group(group) -> None:
    """Tear down a group made by `init_custom_process_group`. Drop your references to `group` afterwards: a
    process-group object that is still alive at interpreter teardown can abort the process (seen with gloo)."""
    dist.destroy_process_group(group)


def broadcast_named_tensors(group, named_tensors, src: int = 0) -> None:
    """Trainer side: broadcast each tensor, in order, from group rank `src` (the receivers allocate matching
    buffers from the names / dtypes / shapes sent alongside, e.g. in `/update_weights_from_distributed`)."""
    for _, tensor in named_tensors:
        dist.broadcast(tensor.detach().contiguous(), group=group, group_src=src)


def receive_named_tensors(group, names, dtypes, shapes, device="cpu", src: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Engine side of `broadcast_named_tensors`: allocate each tensor and receive it from group rank `src`."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}")
    received = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        tensor = torch.empty(tuple(shape), dtype=parse_dtype(dtype), device=device)
        dist.broadcast(tensor, group=group, group_src=src)
        received.append((name, tensor))
    return received


def parse_dtype(dtype) -> torch.dtype:
    """'bfloat16', 'torch.bfloat16' or a torch.dtype -> torch.dtype; ValueError for anything else."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    resolved = getattr(torch, name, None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use a torch dtype name such as 'bfloat16' or 'float32'")
    return resolved
