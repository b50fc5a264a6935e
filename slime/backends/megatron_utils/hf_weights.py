"""Megatron model chunks <-> HF checkpoints: fill a rank's chunks from an HF safetensors folder (each rank reads only
the tensors its shards need), and produce the full HF-named weights from the sharded model, tensor, pipeline and
expert shards gathered (for weight sync and tools/convert_torch_dist_to_hf.py).

Not the bucketing or the transport to engines (slime/backends/weight_sender.py does that for both backends) and
not Megatron's own checkpoint format (checkpoint.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from slime.backends.checkpoint_files import copy_hf_extra_files
from slime.backends.megatron_utils import tp_shards
from slime.backends.megatron_utils.grads import is_expert
from slime.backends.megatron_utils.hf_mapping import mapping_for
from slime.backends.megatron_utils.names import (
    is_stacked_experts,
    named_global_buffers,
    named_global_parameters,
    renumber_expert,
    unstack_experts,
)
from slime.engine.models.weight_loader import checkpoint_files


class LazyHFCheckpoint:
    """`read(hf_name)` of an HF safetensors folder, opening each file once."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = str(path)
        self._handles = {}
        self._file_of = {}
        for file in checkpoint_files(path):
            handle = safe_open(str(file), framework="pt")
            self._handles[file] = handle
            self._file_of.update((name, file) for name in handle.keys())

    def __contains__(self, hf_name: str) -> bool:
        return hf_name in self._file_of

    def read(self, hf_name: str) -> torch.Tensor:
        if hf_name not in self._file_of:
            raise ValueError(f"HF checkpoint {self.path!r} lacks weight {hf_name!r}")
        return self._handles[self._file_of[hf_name]].get_tensor(hf_name)


@torch.no_grad()
def load_hf_weights(model_chunks, hf_checkpoint: str | Path, hf_config,
                    given: dict[str, torch.Tensor] | None = None) -> None:
    """Copy an HF checkpoint into this rank's (possibly TP / PP / EP sharded) model chunks; `given` holds full
    tensors of Megatron names that are not the model family's (the critic's value head)."""
    mapping = mapping_for(hf_config)
    checkpoint = LazyHFCheckpoint(hf_checkpoint)
    padded_vocab = model_chunks[0].vocab_size
    given = given or {}
    for param_name, param in named_global_parameters(model_chunks):
        # A stacked expert weight is filled expert by expert: each rank reads only its own experts.
        targets = (unstack_experts(param_name, param, _first_local_expert(model_chunks))
                   if is_stacked_experts(param_name) else [(param_name, param)])
        for name, target in targets:
            if name in given:
                full = given[name]
            else:
                full = mapping.to_megatron(name, checkpoint.read, hf_config, padded_vocab)
            shard = tp_shards.shard_of(full, name, param)
            if shard.shape != target.shape:
                raise ValueError(f"HF checkpoint {str(hf_checkpoint)!r}: {name} has shape {tuple(shard.shape)} "
                                 f"after conversion, the model expects {tuple(target.shape)} (config.json does not "
                                 "match the weights?)")
            target.copy_(shard)
    # The routers' expert biases are buffers (megatron-core keeps them out of the optimizer): they choose the
    # experts, so a checkpoint's must be loaded like a weight (never updated: family_config.py sets the rate 0).
    for name, buffer in named_global_buffers(model_chunks):
        full = mapping.to_megatron(name, checkpoint.read, hf_config, padded_vocab)
        if full.shape != buffer.shape:
            raise ValueError(f"HF checkpoint {str(hf_checkpoint)!r}: {name} has shape {tuple(full.shape)}, the model "
                             f"expects {tuple(buffer.shape)}")
        buffer.copy_(full)


def _num_local_experts(model_chunks) -> int:
    from megatron.core import parallel_state

    num_experts = model_chunks[0].config.num_moe_experts or 0
    return num_experts // parallel_state.get_expert_model_parallel_world_size()


def _first_local_expert(model_chunks) -> int:
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_rank() * _num_local_experts(model_chunks)


def _gather_over_expert_parallel(tensor: torch.Tensor) -> list[torch.Tensor]:
    """`tensor` of every rank of the expert-parallel group, in rank order; collective over that group."""
    from megatron.core import parallel_state

    group = parallel_state.get_expert_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return [tensor]
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, tensor.contiguous(), group=group)
    return gathered


def iter_hf_weights(model_chunks, hf_config, *, dense: bool = True,
                    buffers: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of this rank's pipeline stage: its dense weights gathered over tensor parallelism
    (unless `dense` is False), and every expert of its expert-parallel group, gathered over expert tensor and expert
    parallelism; with `buffers` (a saved checkpoint, not a weight push: the engines keep the bias they loaded) also
    the routers' expert biases. Collective over those groups: every rank of them must iterate in step. The tensors
    may alias parameters at TP=1 (callers that hand them away copy them)."""
    from megatron.core import parallel_state

    mapping = mapping_for(hf_config)
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    num_local_experts = _num_local_experts(model_chunks)
    for name, param in named_global_parameters(model_chunks):
        if not is_expert(param):  # at EP=1 the experts too, all of them on every rank
            if dense:
                full = tp_shards.full_tensor(name, param)
                for dense_name, tensor in (unstack_experts(name, full, 0) if is_stacked_experts(name)
                                           else [(name, full)]):
                    yield from mapping.to_hf(dense_name, tensor, hf_config)
            continue
        for rank, full in enumerate(_gather_over_expert_parallel(tp_shards.full_tensor(name, param))):
            if is_stacked_experts(name):
                experts = unstack_experts(name, full, rank * num_local_experts)
            else:
                experts = [(renumber_expert(name, (rank - ep_rank) * num_local_experts), full)]
            for expert_name, tensor in experts:
                yield from mapping.to_hf(expert_name, tensor, hf_config)
    if dense and buffers:
        for name, buffer in named_global_buffers(model_chunks):
            yield from mapping.to_hf(name, buffer.detach(), hf_config)


def model_hf_weights(model_chunks, hf_config, dtype: torch.dtype | None = None, *, buffers: bool = False
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of the whole model on global rank 0, pipeline stage by stage (copies, in `dtype`
    when given); other ranks take part in the gathers and yield nothing. Collective over all ranks: within each
    stage of the first data-parallel replica the TP peers gather the dense weights, the EP peers of the first expert
    data-parallel replica (other data-parallel ranks among them) the experts, and the stage's TP rank 0 sends each
    tensor to rank 0 (a name message, then the tensor); the other replicas hold the same weights and sit out.
    `buffers`: iter_hf_weights'."""
    from megatron.core import parallel_state

    if parallel_state.get_expert_data_parallel_rank() != 0:
        return
    rank = dist.get_rank()
    in_first_replica = parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    is_stage_sender = in_first_replica and parallel_state.get_tensor_model_parallel_rank() == 0
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    my_stage = parallel_state.get_pipeline_model_parallel_rank()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    for stage in range(pp_size):
        sender = dist.get_global_rank(pp_group, stage)  # the stage's rank in rank 0's pipeline (its TP rank 0)
        if stage == my_stage:
            for hf_name, tensor in iter_hf_weights(model_chunks, hf_config, dense=in_first_replica, buffers=buffers):
                if rank == 0:
                    yield hf_name, tensor.to(dtype or tensor.dtype, copy=True)
                elif is_stage_sender:
                    tensor = tensor.to(dtype or tensor.dtype, copy=True)
                    dist.send_object_list([(hf_name, tensor.shape, tensor.dtype)], dst=0)
                    dist.send(tensor, dst=0)
            if is_stage_sender and rank != 0:
                dist.send_object_list([None], dst=0)
        elif rank == 0:
            while True:
                header = [None]
                dist.recv_object_list(header, src=sender)
                if header[0] is None:
                    break
                hf_name, shape, tensor_dtype = header[0]
                tensor = torch.empty(shape, dtype=tensor_dtype, device=next(model_chunks[0].parameters()).device)
                dist.recv(tensor, src=sender)
                yield hf_name, tensor


def save_hf_checkpoint(model_chunks, hf_config, out_dir: str | Path, source_checkpoint: str | Path) -> None:
    """Write an HF safetensors folder (weights, config and tokenizer files of `source_checkpoint`); collective."""
    from safetensors.torch import save_file

    state = {name: tensor.cpu() for name, tensor in model_hf_weights(model_chunks, hf_config, buffers=True)}
    if dist.get_rank() != 0:
        return
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    copy_hf_extra_files(source_checkpoint, out_dir)
