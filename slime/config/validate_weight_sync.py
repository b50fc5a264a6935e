"""The rules of slime's weight-sync flags (docs/concepts/weight-sync.md), slime's own: disk needs its folder; delta needs
the disk transport and the engines' local checkpoint folder, and is not for --colocate; the disk-only flags need
the disk transport. Derived: the two folders become absolute paths (trainer and engine processes may not share a
working directory). `check_release_train`: --release-train's rules (slime's, and one more). `validate_args` calls
both; each rule raises `ArgumentError` naming the flag and the fix.

Not the external-engine rules (validate_args' cluster rules), not the sync (slime/backends/weight_sender.py).
"""

from __future__ import annotations

from pathlib import Path

from slime.config.errors import cli_flag, require
from slime.utils import weight_delta


def check_weight_sync_flags(args) -> None:
    require(args.update_weight_transport != "disk" or args.update_weight_disk_dir,
             "--update-weight-transport disk needs --update-weight-disk-dir: a folder the trainer writes and every "
             "engine can read")
    if args.update_weight_mode == "delta":
        require(args.update_weight_transport == "disk", "--update-weight-mode delta needs --update-weight-transport "
                                                         f"disk, got {args.update_weight_transport!r}")
        require(not args.colocate, "--update-weight-mode delta is not for --colocate: colocated engines get the "
                                    "weights by handle, no bytes travel that a delta could save")
        require(args.update_weight_local_checkpoint_dir, "--update-weight-mode delta needs "
                 "--update-weight-local-checkpoint-dir: the engines' host-local checkpoint the deltas apply to")
        missing = " ".join(weight_delta.missing_packages(args.update_weight_delta_checksum))
        require(not missing, f"--update-weight-mode delta with --update-weight-delta-checksum "
                              f"{args.update_weight_delta_checksum} needs: pip install {missing} (scripts/setup.sh "
                              "installs zstandard and xxhash; blake3 is not installed by default)")
    for dest in ("update_weight_local_checkpoint_dir", "custom_update_weight_post_write_path",
                 "update_weight_disk_keep_files"):
        require(not getattr(args, dest) or args.update_weight_transport == "disk",
                 f"{cli_flag(dest)} is only used with --update-weight-transport disk")
    for dest in ("update_weight_disk_dir", "update_weight_local_checkpoint_dir"):
        if getattr(args, dest):  # absolute: the engine servers and trainer processes may not share a cwd
            setattr(args, dest, str(Path(getattr(args, dest)).absolute()))


def check_release_train(args) -> None:
    """slime's --release-train rules: the Megatron actor alone (no critic, no --keep-old-actor: its host copies
    would die with the processes), a --save folder to come back from (a save every rollout), full weights on disk;
    colocated, the rollout is offloaded and the trainer is released rather than offloaded. Here also: not with
    --use-fault-tolerance, whose restarted engines get their weights from the (then released) trainer."""
    if not args.release_train:
        return
    require(args.train_backend == "megatron", "--release-train needs --train-backend megatron (as in slime)")
    require(not args.use_critic, "--release-train does not train a critic (--advantage-estimator ppo), as in slime")
    require(not args.keep_old_actor, "--release-train cannot --keep-old-actor: the kept weights live in the train "
                                      "processes it ends")
    require(args.save, "--release-train needs --save: the train processes come back from its latest checkpoint")
    require(args.update_weight_mode == "full" and args.update_weight_transport == "disk",
             "--release-train needs --update-weight-transport disk (and --update-weight-mode full): the engines "
             "load the weights from disk after the train processes are gone")
    require(not args.use_fault_tolerance, "--release-train with --use-fault-tolerance: an engine restarted during "
                                           "a rollout gets its weights from the train processes, which are released "
                                           "then; drop one of the two")
    if args.colocate:
        args.offload_train, args.offload_rollout = False, True
