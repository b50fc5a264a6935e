"""Trainer checkpoints: `{save}/rollout_{id}/` holds a Hugging Face model (fp32 safetensors + config + tokenizer
files copied from --hf-checkpoint, loadable by transformers and by the engine), `optimizer.pt` (full optimizer and
LR-scheduler state, re-shardable to any number of ranks), `rng/rank_{r}.pt` and `meta.json` (the rollout id and the
files a resume reads, which checkpoint_state.py checks before loading). The folder is written under a temporary name
and renamed when complete; `{save}/latest` (the folder's name) is written last.
"""

from __future__ import annotations

import json
import random
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

from slime.backends.fsdp_utils.expert_weights import per_expert_tensors
from slime.backends.fsdp_utils.model import hf_name
from slime.utils.checkpoint_state import (
    META_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RUN_STATE_FILE,
    check_checkpoint,
    checkpoint_dir,
    checkpoint_files,
    corrupt_file_error,
    find_checkpoint,
    latest_checkpoint,
    publish_folder,
    write_pointer,
)

__all__ = ["checkpoint_dir", "latest_checkpoint", "resolve_load_dir", "save_checkpoint", "load_training_state"]

HF_EXTRA_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja", "tokenizer.model")


def copy_hf_extra_files(hf_checkpoint, out_dir) -> None:
    """The config and tokenizer files of an HF folder (those it has) into `out_dir`, beside new weights."""
    for name in HF_EXTRA_FILES:
        if (Path(hf_checkpoint) / name).is_file():
            shutil.copy2(Path(hf_checkpoint) / name, Path(out_dir) / name)


def barrier():
    if dist.is_initialized():
        dist.barrier()


def resolve_load_dir(load: str | None) -> Path | None:
    """The checkpoint folder --load refers to (a save root, via its `latest`, or a `rollout_{id}` folder), checked
    complete; None without --load or when the folder holds no checkpoint yet (the driver allowed that only with
    --load-if-exists). Anything else that is not a checkpoint raises CheckpointError."""
    folder = find_checkpoint(load, load_if_exists=True)
    if folder is not None:
        check_checkpoint(folder)
    return folder


def torch_load(ckpt: Path, path: Path):
    """torch.load of a file of checkpoint `ckpt`; any failure is reported as a truncated or corrupt file, named,
    with the previous checkpoint to resume from."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - torch.load fails with EOFError, RuntimeError, UnpicklingError, ...
        raise corrupt_file_error(ckpt, path, exc) from exc


def rng_state() -> dict:
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(save_root: str, rollout_id: int, model, optimizer, scheduler, *, hf_checkpoint: str,
                    tie_word_embeddings: bool, rank: int, save_optim: bool = True,
                    run_state: dict | None = None) -> Path:
    """Collective: every rank calls it. Returns the final folder. `run_state` (the driver's data-source state)
    is written inside the same atomic folder, so weights, optimizer and data order always match."""
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
        tensors = {}
        for key, value in model_state.items():
            for name, tensor in per_expert_tensors(hf_name(key), value):  # MoE experts: the checkpoint's layout
                tensors[name] = tensor.contiguous() if name == hf_name(key) else tensor.clone()
        if tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        save_file(tensors, str(tmp / MODEL_FILE), metadata={"format": "pt"})
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


def publish_checkpoint(tmp: Path, final: Path, save_root: str, rank: int) -> None:
    """Collective, after every rank wrote its part of `tmp`: rename it to `final`, then point `latest` at it, both
    atomic (a crash leaves the previous checkpoint as the latest)."""
    barrier()
    if rank == 0:
        publish_folder(tmp, final)  # a kill at any point leaves `latest` naming a complete folder
        write_pointer(Path(save_root), final.name)
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
