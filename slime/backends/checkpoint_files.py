"""Checkpoint pieces both training backends share: the HF files copied beside new weights, where --load points,
per-rank RNG state, and the atomic publish of a finished checkpoint folder."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from slime.utils.checkpoint_state import (
    check_checkpoint,
    corrupt_file_error,
    find_checkpoint,
    publish_folder,
    write_pointer,
)

HF_EXTRA_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja", "tokenizer.model",
                  "preprocessor_config.json", "processor_config.json")  # a VL model's image processor


def copy_hf_extra_files(hf_checkpoint, out_dir) -> None:
    """The config and tokenizer files of an HF folder (those it has) into `out_dir`, beside new weights."""
    for name in HF_EXTRA_FILES:
        if (Path(hf_checkpoint) / name).is_file():
            shutil.copy2(Path(hf_checkpoint) / name, Path(out_dir) / name)


def barrier():
    if dist.is_initialized():
        dist.barrier()


def resolve_load_dir(load: str | None, step: int | None = None) -> Path | None:
    """The checkpoint folder --load refers to (a save root, via its `latest` or Megatron-LM's tracker file, that
    root's checkpoint `step` with --ckpt-step, or one checkpoint folder), checked complete; None without --load or
    when the folder holds no checkpoint yet (the driver allowed that only with --load-if-exists). Anything else
    that is not a checkpoint raises CheckpointError."""
    folder = find_checkpoint(load, load_if_exists=True, step=step)
    if folder is not None:
        check_checkpoint(folder)
    return folder


def torch_load(ckpt: Path, path: Path):
    """torch.load of a file of checkpoint `ckpt`; any failure is reported as a truncated or corrupt file, named,
    with the previous checkpoint to resume from."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
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


def publish_checkpoint(tmp: Path, final: Path, save_root: str, rank: int) -> None:
    """Collective, after every rank wrote its part of `tmp`: rename it to `final`, then point `latest` at it, both
    atomic (a crash leaves the previous checkpoint as the latest)."""
    barrier()
    if rank == 0:
        publish_folder(tmp, final)  # a kill at any point leaves `latest` naming a complete folder
        write_pointer(Path(save_root), final.name)
    barrier()


VALUE_HEAD_KEY = "value_head.weight"
