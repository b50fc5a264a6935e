"""Megatron-LM's checkpoint folder layout, as slime's Megatron saves it and slime's tools/convert_hf_to_torch_dist.py
writes it: a root holding `latest_checkpointed_iteration.txt` (an iteration number, or `release`) and one folder per
checkpoint, `iter_%07d` (or `release`), which is a torch_dist checkpoint (`metadata.json` naming the torch_dist
backend, `common.pt`, `.metadata`, `*.distcp`).

Which folder a path and an optional step (--ckpt-step / --ref-ckpt-step / --opd-teacher-ckpt-step) name, and
whether a folder is a torch_dist checkpoint. Pure Python (no torch), so the driver checks these paths before any
process starts. Not the reading or writing of the tensors (backends/megatron_utils/checkpoint.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE_DIR = "release"
DIST_METADATA_FILE = "metadata.json"  # dist_checkpointing's: {"sharded_backend": "torch_dist", ...}
_ITER_RE = re.compile(r"^iter_(\d{7})$")


class MegatronLayoutError(ValueError):
    """A Megatron-LM checkpoint path that does not lead to a checkpoint folder."""


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def folder_iteration(folder: str | Path) -> int | None:
    """The iteration an `iter_%07d` folder holds; 0 for `release` (Megatron-LM's rule); None for other names."""
    name = Path(folder).name
    if name == RELEASE_DIR:
        return 0
    match = _ITER_RE.match(name)
    return int(match[1]) if match else None


def is_torch_dist_folder(folder: str | Path) -> bool:
    """Whether `folder` is a torch_dist checkpoint (megatron-core's dist_checkpointing wrote it)."""
    meta = Path(folder) / DIST_METADATA_FILE
    if not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text()).get("sharded_backend") == "torch_dist"
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return False


def read_tracker(root: str | Path) -> tuple[int, bool]:
    """(iteration, release) of `{root}/latest_checkpointed_iteration.txt` (release: iteration 0)."""
    tracker = Path(root) / TRACKER_FILE
    text = tracker.read_text().strip()
    if text == RELEASE_DIR:
        return 0, True
    try:
        return int(text), False
    except ValueError:
        raise MegatronLayoutError(f"{tracker} holds {text!r}; Megatron-LM writes an iteration number or "
                                  "'release' there") from None


def is_megatron_root(path: str | Path) -> bool:
    return (Path(path) / TRACKER_FILE).is_file()


def is_megatron_checkpoint(path: str | Path) -> bool:
    """A Megatron-LM root (its tracker file) or one of its `iter_%07d` / `release` torch_dist folders."""
    path = Path(path)
    return is_megatron_root(path) or (folder_iteration(path) is not None and is_torch_dist_folder(path))


def _saved_iterations(root: Path) -> str:
    names = sorted(p.name for p in root.iterdir() if p.is_dir() and folder_iteration(p) is not None)
    return ", ".join(names) or "none"


def checkpoint_folder(path: str | Path, step: int | None = None, flag: str = "--load") -> Path:
    """The torch_dist folder that `path` (a Megatron-LM root or one of its checkpoint folders) and `step` name:
    with a step, `iter_{step:07d}` of the root (slime's --ckpt-step rule); without, the folder the tracker file
    names. Raises MegatronLayoutError naming the tracker file and the iteration when that folder is missing."""
    path = Path(path)
    if not is_megatron_root(path):
        if folder_iteration(path) is None or not is_torch_dist_folder(path):
            raise MegatronLayoutError(f"{flag} {path}: not a Megatron checkpoint (no {TRACKER_FILE}, and not an "
                                      "iter_<7 digits> or release folder holding a torch_dist checkpoint)")
        if step is not None and step != folder_iteration(path):
            return checkpoint_folder(path.parent, step, flag)
        return path
    tracker = path / TRACKER_FILE
    if step is not None:
        folder, source = iteration_dir(path, step), f"the step {step} that the step flag asks for"
    else:
        iteration, release = read_tracker(path)
        folder = path / RELEASE_DIR if release else iteration_dir(path, iteration)
        source = f"{tracker} (it names {'release' if release else f'iteration {iteration}'})"
    if not folder.is_dir():
        raise MegatronLayoutError(f"{flag} {path}: the checkpoint folder {folder.name} of {source} does not exist "
                                  f"(the folder holds: {_saved_iterations(path)}); fix {TRACKER_FILE} or pass an "
                                  "existing step")
    if not is_torch_dist_folder(folder):
        raise MegatronLayoutError(f"{flag} {path}: {folder} (from {source}) is not a torch_dist checkpoint (no "
                                  f"{DIST_METADATA_FILE} naming the torch_dist backend); it is incomplete or of "
                                  "another checkpoint format")
    return folder


def write_tracker(root: str | Path, value: str) -> None:
    """Point `{root}/latest_checkpointed_iteration.txt` at an iteration (or `release`) atomically."""
    import os

    tracker = Path(root) / TRACKER_FILE
    tmp = tracker.with_name(TRACKER_FILE + ".tmp")
    tmp.write_text(value)
    os.replace(tmp, tracker)
