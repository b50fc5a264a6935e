"""When to save, and the run state (data-source position) that travels with each checkpoint.

A checkpoint folder is `{save}/rollout_{id}/` written atomically by the trainer; `{save}/latest` names the newest
complete one. The driver's run state (the data source's state) is saved inside it as `run_state.json`, so model,
optimizer and data order always come from the same rollout.
"""

from __future__ import annotations

import json
from pathlib import Path

RUN_STATE_FILE = "run_state.json"


def checkpoint_dir(root: str | Path, rollout_id: int) -> Path:
    return Path(root) / f"rollout_{rollout_id}"


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None when there is none."""
    pointer = Path(root) / "latest"
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    return path if path.is_dir() else None


def should_save(args, rollout_id: int, num_rollout: int) -> bool:
    if not args.save:
        return False
    if rollout_id == num_rollout - 1:
        return True
    return bool(args.save_interval) and (rollout_id + 1) % args.save_interval == 0


def load_run_state(args) -> dict | None:
    if not args.load:
        return None
    path = latest_checkpoint(args.load)
    if path is None or not (path / RUN_STATE_FILE).is_file():
        return None
    return json.loads((path / RUN_STATE_FILE).read_text())
