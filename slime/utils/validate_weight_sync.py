"""The rules of slime's weight-sync flags (docs/weight-sync.md), slime's own: disk needs its folder; delta needs
the disk transport and the engines' local checkpoint folder, and is not for --colocate; the disk-only flags need
the disk transport. Derived: the two folders become absolute paths (trainer and engine processes may not share a
working directory). `validate_args` calls it; each rule raises `ArgumentError` naming the flag and the fix.

Not the external-engine rules (validate_args' cluster rules), not the sync (slime/backends/weight_sender.py).
"""

from __future__ import annotations

from pathlib import Path

from slime.utils import weight_delta
from slime.utils.validate_args import _flag, _require


def check_weight_sync_flags(args) -> None:
    _require(args.update_weight_transport != "disk" or args.update_weight_disk_dir,
             "--update-weight-transport disk needs --update-weight-disk-dir: a folder the trainer writes and every "
             "engine can read")
    if args.update_weight_mode == "delta":
        _require(args.update_weight_transport == "disk", "--update-weight-mode delta needs --update-weight-transport "
                                                         f"disk, got {args.update_weight_transport!r}")
        _require(not args.colocate, "--update-weight-mode delta is not for --colocate: colocated engines get the "
                                    "weights by handle, no bytes travel that a delta could save")
        _require(args.update_weight_local_checkpoint_dir, "--update-weight-mode delta needs "
                 "--update-weight-local-checkpoint-dir: the engines' host-local checkpoint the deltas apply to")
        missing = " ".join(weight_delta.missing_packages(args.update_weight_delta_checksum))
        _require(not missing, f"--update-weight-mode delta with --update-weight-delta-checksum "
                              f"{args.update_weight_delta_checksum} needs: pip install {missing} (scripts/setup.sh "
                              "installs zstandard and xxhash; blake3 is not installed by default)")
    for dest in ("update_weight_local_checkpoint_dir", "custom_update_weight_post_write_path",
                 "update_weight_disk_keep_files"):
        _require(not getattr(args, dest) or args.update_weight_transport == "disk",
                 f"{_flag(dest)} is only used with --update-weight-transport disk")
    for dest in ("update_weight_disk_dir", "update_weight_local_checkpoint_dir"):
        if getattr(args, dest):  # absolute: the engine servers and trainer processes may not share a cwd
            setattr(args, dest, str(Path(getattr(args, dest)).absolute()))
