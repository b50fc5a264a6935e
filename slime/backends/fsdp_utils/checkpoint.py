"""Trainer checkpoints: `{save}/rollout_{id}/` holds a Hugging Face model (fp32 safetensors + config + tokenizer
files copied from --hf-checkpoint, loadable by transformers and by the engine), `optimizer.pt` (full optimizer and
LR-scheduler state, re-shardable to any number of ranks), `rng/rank_{r}.pt` and `meta.json` (the rollout id and the
files a resume reads, which checkpoint_state.py checks before loading). The folder is written under a temporary name
and renamed when complete; `{save}/latest` (the folder's name) is written last.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from slime.backends.checkpoint_files import (
    barrier,
    copy_hf_extra_files,
    publish_checkpoint,
    rng_state,
    set_rng_state,
    torch_load,
)
from slime.backends.fsdp_utils.expert_weights import per_expert_tensors
from slime.backends.fsdp_utils.model import hf_name
from slime.backends.lora_adapter import ADAPTER_SUBDIR, is_lora_name
from slime.utils.checkpoint_state import (
    META_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RUN_STATE_FILE,
    checkpoint_dir,
    checkpoint_files,
    latest_checkpoint,
)

__all__ = ["checkpoint_dir", "latest_checkpoint", "save_checkpoint", "load_training_state"]


def save_checkpoint(save_root: str, rollout_id: int, model, optimizer, scheduler, *, hf_checkpoint: str,
                    tie_word_embeddings: bool, rank: int, save_optim: bool = True,
                    run_state: dict | None = None, write_adapter=None) -> Path:
    """Collective: every rank calls it. Returns the final folder. `run_state` (the driver's data-source state)
    is written inside the same atomic folder, so weights, optimizer and data order always match. With
    `write_adapter(folder, adapter)` (LoRA): the adapter tensors {HF name: tensor} go to `adapter/` in PEFT's format
    (lora_adapter.save_adapters), the model file keeps the frozen base."""
    from safetensors.torch import save_file

    final = checkpoint_dir(save_root, rollout_id)
    tmp = final.with_name(final.name + ".tmp")
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options) if save_optim else None
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    barrier()
    torch.save(rng_state(), tmp / "rng" / f"rank_{rank}.pt")
    if rank == 0:
        tensors, adapter = {}, {}
        for key, value in model_state.items():
            if is_lora_name(hf_name(key)):
                adapter[hf_name(key)] = value
                continue
            for name, tensor in per_expert_tensors(hf_name(key), value):  # MoE experts: the checkpoint's layout
                tensors[name] = tensor.contiguous() if name == hf_name(key) else tensor.clone()
        if tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        save_file(tensors, str(tmp / MODEL_FILE), metadata={"format": "pt"})
        if write_adapter is not None:
            write_adapter(tmp / ADAPTER_SUBDIR, adapter)
        copy_hf_extra_files(hf_checkpoint, tmp)
        if optim_state is not None:
            torch.save({"optimizer": optim_state, "scheduler": scheduler.state_dict()}, tmp / OPTIMIZER_FILE)
        num_ranks = dist.get_world_size() if dist.is_initialized() else 1
        files = checkpoint_files(num_ranks, optimizer=optim_state is not None, run_state=run_state is not None)
        (tmp / META_FILE).write_text(json.dumps({"rollout_id": rollout_id, "hf_checkpoint": str(hf_checkpoint),
                                                 "files": files}))
        if run_state is not None:
            (tmp / RUN_STATE_FILE).write_text(json.dumps(run_state))
    publish_checkpoint(tmp, final, save_root, rank)
    return final


def save_hf_folder(folder: str, named_tensors, hf_checkpoint: str, rank: int, tie_word_embeddings: bool) -> None:
    """Collective (the tensors are gathered): an HF folder of `named_tensors` (--save-hf with LoRA: the merged
    weights), written by rank 0."""
    from safetensors.torch import save_file

    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in named_tensors}
    if rank == 0:
        if tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        Path(folder).mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(Path(folder) / MODEL_FILE), metadata={"format": "pt"})
        copy_hf_extra_files(hf_checkpoint, Path(folder))
    barrier()


def load_training_state(ckpt: Path, model, optimizer, scheduler, rank: int) -> int:
    """Restore optimizer, scheduler and this rank's RNG from `ckpt` (model weights are loaded with the model).
    Returns the saved rollout id. A file that fails to load raises CheckpointError naming it."""
    meta = json.loads((ckpt / META_FILE).read_text())
    if OPTIMIZER_FILE in meta["files"]:
        state = torch_load(ckpt, ckpt / OPTIMIZER_FILE)
        set_optimizer_state_dict(model, optimizer, state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
        scheduler.load_state_dict(state["scheduler"])
    rng_file = ckpt / "rng" / f"rank_{rank}.pt"
    if rng_file.is_file():  # a resume on more ranks than were saved: the new ranks keep their seeded state
        set_rng_state(torch_load(ckpt, rng_file))
    return int(meta["rollout_id"])
