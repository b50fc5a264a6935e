"""When to save, what a complete checkpoint is, and which folder `--load` resumes from.

A checkpoint folder is written atomically by the trainer: the FSDP backend's `{save}/rollout_{id}/`, named by
`{save}/latest`; the Megatron backend's `{save}/iter_{id:07d}/` in Megatron-LM's layout, named by
`{save}/latest_checkpointed_iteration.txt` (megatron_layout.py), so slime reads it and this project reads slime's.
The driver's run state (the data source's state) is saved inside it as `run_state.json`, so model,
optimizer and data order always come from the same rollout. `meta.json` lists the files a resume reads; a folder
missing one of them, or holding a truncated one, is an error naming the file and the previous checkpoint to
`--load` instead, never a silent fresh start. Pure Python (no torch), so the driver checks `--load` before any
process starts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import re
import shutil
import struct
import zipfile
from pathlib import Path

from slime.utils import megatron_layout

RUN_STATE_FILE = "run_state.json"
META_FILE = "meta.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
CRITIC_SUBDIR = "critic"
_FOLDER_RE = re.compile(r"^(?:rollout_(\d+)|iter_(\d{7}))$")


class CheckpointError(ValueError):
    """A `--load` folder that cannot be resumed from."""


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where that is not available."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    errno = ctypes.get_errno()
    if errno in (38, 22, 95):  # ENOSYS, EINVAL, EOPNOTSUPP: the kernel or file system cannot exchange
        return False
    raise OSError(errno, os.strerror(errno), str(a))


def publish_folder(tmp: Path, final: Path) -> None:
    """Move the complete folder `tmp` to `final` so that a kill at any moment leaves `final` either the old
    complete folder or the new one, never missing or half-written: when `final` exists the two are exchanged
    atomically and the old one (now at `tmp`) removed. (Where the exchange is not available, `final` is missing
    between two renames for an instant.)"""
    if final.exists():
        if _exchange(tmp, final):
            shutil.rmtree(tmp)
            return
        stale = final.with_name(final.name + ".stale.tmp")
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(final, stale)
        os.replace(tmp, final)
        shutil.rmtree(stale)
        return
    os.replace(tmp, final)


def write_pointer(root: Path, folder_name: str) -> None:
    """Point `{root}/latest` at `folder_name` atomically (write a temporary file, rename it over)."""
    pointer = Path(root) / "latest"
    pointer_tmp = pointer.with_name("latest.tmp")
    pointer_tmp.write_text(folder_name)
    os.replace(pointer_tmp, pointer)


def checkpoint_dir(root: str | Path, rollout_id: int) -> Path:
    return Path(root) / f"rollout_{rollout_id}"


def _folder_id(match: re.Match) -> int:
    return int(match[1] if match[1] is not None else match[2])


def is_foreign_megatron_checkpoint(folder: Path) -> bool:
    """A Megatron-LM checkpoint folder another program wrote (slime's Megatron, its converter): torch_dist weights
    without this project's meta.json and run state."""
    return not (folder / META_FILE).is_file() and megatron_layout.is_torch_dist_folder(folder)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The folder `{root}/latest` (or Megatron-LM's tracker file) names, or None when there is none (no
    completeness check: see resume_dir)."""
    pointer = Path(root) / "latest"
    if pointer.is_file():
        path = Path(root) / pointer.read_text().strip()
        return path if path.is_dir() else None
    if megatron_layout.is_megatron_root(root):
        try:
            return megatron_layout.checkpoint_folder(root)
        except megatron_layout.MegatronLayoutError:
            return None
    return None


def checkpoint_files(num_ranks: int, *, optimizer: bool, run_state: bool) -> list[str]:
    """The files of a checkpoint folder that resuming reads; meta.json lists them."""
    files = [MODEL_FILE, "config.json", *(f"rng/rank_{rank}.pt" for rank in range(num_ranks))]
    if optimizer:
        files.append(OPTIMIZER_FILE)
    if run_state:
        files.append(RUN_STATE_FILE)
    return files


def _safetensors_problem(path: Path) -> str | None:
    """Whether the file's size matches its header (a truncated copy does not); None when it does."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        raw = handle.read(8)
        if len(raw) < 8:
            return "truncated (no header)"
        (header_size,) = struct.unpack("<Q", raw)
        if 8 + header_size > size:
            return "truncated (header cut off)"
        try:
            header = json.loads(handle.read(header_size))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return "corrupt (unreadable header)"
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    expected = 8 + header_size + max(ends, default=0)
    return None if expected == size else f"truncated or corrupt ({size} bytes, the header describes {expected})"


def _file_problem(path: Path) -> str | None:
    """A cheap integrity check by format: safetensors header vs size, torch.save zip directory, JSON parse."""
    if path.suffix == ".safetensors":
        return _safetensors_problem(path)
    if path.suffix == ".pt":
        try:
            zipfile.ZipFile(path).close()
        except zipfile.BadZipFile:
            return "truncated or corrupt (not a complete torch.save archive)"
        return None
    if path.suffix == ".json":
        try:
            json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return "corrupt (not valid JSON)"
    return None


def _problems(folder: Path, required: tuple[str, ...]) -> list[str]:
    """What keeps `folder` from being resumed from (empty when it is complete)."""
    meta_path = folder / META_FILE
    if is_foreign_megatron_checkpoint(folder):
        return []  # its weights are all a run reads from it (megatron_utils/checkpoint.py)
    if not meta_path.is_file():
        return [f"{meta_path} is missing"]
    try:
        meta = json.loads(meta_path.read_text())
        files = list(meta["files"])
        int(meta["rollout_id"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError):
        return [f"{meta_path} is corrupt (needs 'rollout_id' and 'files')"]
    problems = []
    for name in dict.fromkeys(files + list(required)):
        path = folder / name
        problem = "missing" if not path.is_file() else _file_problem(path)
        if problem:
            problems.append(f"{path} is {problem}")
    return problems


def previous_checkpoint(root: Path, before_id: int | None, required: tuple[str, ...] = ()) -> Path | None:
    """The newest complete `rollout_{id}` folder under `root` with id < before_id (any id when None)."""
    candidates = []
    for folder in root.iterdir() if root.is_dir() else ():
        match = _FOLDER_RE.match(folder.name)
        if match and folder.is_dir() and (before_id is None or _folder_id(match) < before_id):
            candidates.append((_folder_id(match), folder))
    for _, folder in sorted(candidates, reverse=True):
        if not _problems(folder, required):
            return folder
    return None


def _suggestion(folder: Path, required: tuple[str, ...]) -> str:
    match = _FOLDER_RE.match(folder.name)
    previous = previous_checkpoint(folder.parent, _folder_id(match) if match else None, required)
    if previous is None:
        return f"no earlier complete checkpoint under {folder.parent}; start fresh without --load"
    return f"resume from the previous checkpoint with --load {previous}"


def check_checkpoint(folder: Path, required: tuple[str, ...] = ()) -> None:
    """Raise CheckpointError when a file of `folder` (its meta.json's list plus `required`) is missing or
    truncated; the message names the files and the previous checkpoint to resume from."""
    problems = _problems(folder, required)
    if problems:
        raise CheckpointError(f"--load: checkpoint {folder} is incomplete: {'; '.join(problems)}. "
                              f"{_suggestion(folder, required)}")


def corrupt_file_error(folder: Path, path: Path, exc: Exception) -> CheckpointError:
    """The error for a file of checkpoint `folder` that failed to load: names it and the previous checkpoint."""
    return CheckpointError(f"--load: {path} is truncated or corrupt ({type(exc).__name__}: {exc}). "
                           f"{_suggestion(folder, ())}")


def find_checkpoint(load: str | None, *, load_if_exists: bool = False, step: int | None = None) -> Path | None:
    """The checkpoint folder `--load` names: a save root (through its `latest` or Megatron-LM's tracker file; with
    `step`, slime's --ckpt-step, that step's folder instead) or one checkpoint folder. None without --load, and with
    --load-if-exists when the folder is absent or empty. Not checked complete."""
    if not load:
        return None
    root = Path(load)
    if step is not None and root.is_dir():
        return _step_folder(root, step)
    # `*.tmp` entries are unfinished saves (a crash during the first one), never resumable.
    if not root.exists() or (root.is_dir() and all(p.name.endswith(".tmp") for p in root.iterdir())):
        if load_if_exists:
            return None
        state = "does not exist" if not root.exists() else "is empty"
        raise CheckpointError(f"--load {load}: the folder {state}, so there is no checkpoint to resume from; fix the "
                              "path, or add --load-if-exists to start fresh while it holds no checkpoint yet")
    pointer = root / "latest"
    if pointer.is_file():
        folder = root / pointer.read_text().strip()
        if not folder.is_dir():
            raise CheckpointError(f"--load {load}: {pointer} names {folder.name}, which does not exist. "
                                  f"{_suggestion(folder, (RUN_STATE_FILE,))}")
        return folder
    if megatron_layout.is_megatron_checkpoint(root):
        try:
            return megatron_layout.checkpoint_folder(root, flag="--load")
        except megatron_layout.MegatronLayoutError as exc:
            raise CheckpointError(str(exc)) from None
    if (root / META_FILE).is_file():
        return root
    hint = ""
    if list(root.glob("*.safetensors")):
        hint = " It holds model weights only: to start training from them pass the folder as --hf-checkpoint."
    raise CheckpointError(f"--load {load}: not a checkpoint (no 'latest' file, no "
                          f"{megatron_layout.TRACKER_FILE} and no {META_FILE}); give a --save folder or one of its "
                          f"rollout_<id> / iter_<7 digits> folders.{hint}")


def _step_folder(root: Path, step: int) -> Path:
    """--ckpt-step: checkpoint `step` of the save root `root` (either backend's layout)."""
    if megatron_layout.is_megatron_checkpoint(root):
        try:
            return megatron_layout.checkpoint_folder(root, step, "--ckpt-step")
        except megatron_layout.MegatronLayoutError as exc:
            raise CheckpointError(str(exc)) from None
    folder = checkpoint_dir(root, step)
    if not folder.is_dir():
        raise CheckpointError(f"--ckpt-step {step}: --load {root} has no checkpoint {folder.name}; give the step of "
                              "a saved checkpoint")
    return folder


def resume_dir(load: str | None, *, load_if_exists: bool = False, step: int | None = None) -> Path | None:
    """The complete actor checkpoint (run state included) that `--load` resumes from, or None to start fresh."""
    folder = find_checkpoint(load, load_if_exists=load_if_exists, step=step)
    if folder is not None and not is_foreign_megatron_checkpoint(folder):
        check_checkpoint(folder, required=(RUN_STATE_FILE,))
    return folder


def weights_at_step(load: str, step: int | None, flag: str) -> str:
    """slime's --ref-ckpt-step / --opd-teacher-ckpt-step: the checkpoint of step `step` of the --save root `load`
    (--ref-load / --opd-teacher-load), whose weights are loaded: a Megatron-LM root's `iter_{step:07d}` (without a
    step the one its tracker file names), else the complete `rollout_{step}`; `load` itself when `step` is None."""
    if megatron_layout.is_megatron_checkpoint(load):
        try:
            return str(megatron_layout.checkpoint_folder(load, step, flag))
        except megatron_layout.MegatronLayoutError as exc:
            raise CheckpointError(str(exc)) from None
    if step is None:
        return load
    folder = checkpoint_dir(load, step)
    if not folder.is_dir():
        saved = sorted(p.name for p in Path(load).glob("rollout_*") if _FOLDER_RE.match(p.name))
        raise CheckpointError(f"{flag} {step}: {load} has no checkpoint {folder.name} (it has: "
                              f"{', '.join(saved) or 'none'}); give the step of one of them")
    problems = _problems(folder, ())
    if problems:
        raise CheckpointError(f"{flag} {step}: checkpoint {folder} is incomplete: {'; '.join(problems)}")
    return str(folder)


def initial_weights(args) -> str:
    """The weights a run without a checkpoint to resume starts its policy from: --hf-checkpoint's, or, when
    --ref-load is a Megatron checkpoint, that checkpoint's (at --ref-ckpt-step) as slime starts its recipes (--ref-load
    the converted model, --load the empty save folder)."""
    if args.ref_load and megatron_layout.is_megatron_checkpoint(args.ref_load):
        return weights_at_step(args.ref_load, args.ref_ckpt_step, "--ref-ckpt-step")
    return args.hf_checkpoint


def critic_checkpoint(actor_dir: Path) -> Path:
    """The complete critic checkpoint saved with the actor's `{save}/rollout_{id}`: `{save}/critic/rollout_{id}`."""
    folder = actor_dir.parent / CRITIC_SUBDIR / actor_dir.name
    if not folder.is_dir():
        raise CheckpointError(f"--load: resuming ppo needs the critic checkpoint {folder} next to the actor's "
                              f"{actor_dir}; {_suggestion(actor_dir, (RUN_STATE_FILE,))}")
    check_checkpoint(folder)
    return folder


def should_save(args, rollout_id: int, num_rollout: int) -> bool:
    if not args.save:
        return False
    if rollout_id == num_rollout - 1 or args.release_train:  # released train processes come back from --save
        return True
    return bool(args.save_interval) and (rollout_id + 1) % args.save_interval == 0


def starts_fresh_without_checkpoint(args) -> bool:
    """Whether an absent or empty `--load` folder means "start from --hf-checkpoint": with --load-if-exists, or when
    --load and --save name one folder (slime's recipes resume from their own save folder that way, and start fresh
    while it holds nothing). A lone --load with nothing there stays an error: it is most likely a wrong path."""
    same_folder = args.load is not None and args.save is not None and Path(args.load).resolve() == Path(
        args.save).resolve()
    return bool(args.load_if_exists) or same_folder


def load_run_state(args) -> dict | None:
    """The driver's run state saved with the checkpoint `--load` resumes from; None when starting fresh."""
    folder = resume_dir(args.load, load_if_exists=starts_fresh_without_checkpoint(args), step=args.ckpt_step)
    if folder is None or is_foreign_megatron_checkpoint(folder):  # weights only: the data starts from the top
        return None
    return json.loads((folder / RUN_STATE_FILE).read_text())
