"""Megatron-LM's checkpoint folder layout (slime/utils/megatron_layout.py) and the driver's checks over it
(checkpoint_state.py): which folder a save root, a checkpoint folder and a step name; what each wrong layout says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime.utils import megatron_layout as layout
from slime.utils.checkpoint_state import CheckpointError, find_checkpoint, latest_checkpoint, resume_dir


def _torch_dist(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    return folder


@pytest.fixture
def root(tmp_path) -> Path:
    for name in ("iter_0000003", "iter_0000010", "release"):
        _torch_dist(tmp_path / "save" / name)
    (tmp_path / "save" / layout.TRACKER_FILE).write_text("10")
    return tmp_path / "save"


def test_the_tracker_names_the_folder_and_a_step_picks_another(root):
    assert layout.checkpoint_folder(root) == root / "iter_0000010"
    assert layout.checkpoint_folder(root, 3) == root / "iter_0000003"
    assert layout.checkpoint_folder(root / "iter_0000010", 3) == root / "iter_0000003"  # a sibling iteration
    assert layout.checkpoint_folder(root / "release") == root / "release"
    (root / layout.TRACKER_FILE).write_text("release\n")
    assert layout.checkpoint_folder(root) == root / "release" and layout.read_tracker(root) == (0, True)
    assert [layout.folder_iteration(root / n) for n in ("iter_0000010", "release", "rollout_3")] == [10, 0, None]


def test_wrong_layouts_name_the_file_the_iteration_and_what_exists(root, tmp_path):
    (root / layout.TRACKER_FILE).write_text("7")
    with pytest.raises(layout.MegatronLayoutError, match=r"--ref-load .*iter_0000007 of .*latest_checkpointed_"
                                                         r"iteration.txt \(it names iteration 7\) does not exist \(the "
                                                         r"folder holds: iter_0000003, iter_0000010, release\)"):
        layout.checkpoint_folder(root, flag="--ref-load")
    with pytest.raises(layout.MegatronLayoutError, match="iter_0000004 of the step 4"):
        layout.checkpoint_folder(root, 4)
    (root / layout.TRACKER_FILE).write_text("latest")
    with pytest.raises(layout.MegatronLayoutError, match="holds 'latest'; Megatron-LM writes an iteration number"):
        layout.checkpoint_folder(root)
    (root / "iter_0000003" / "metadata.json").write_text("{}")  # not torch_dist (another format, or unfinished)
    with pytest.raises(layout.MegatronLayoutError, match="iter_0000003 .* is not a torch_dist checkpoint"):
        layout.checkpoint_folder(root, 3)
    (tmp_path / "plain").mkdir()
    with pytest.raises(layout.MegatronLayoutError, match="not a Megatron checkpoint"):
        layout.checkpoint_folder(tmp_path / "plain")


def test_the_driver_resumes_from_the_tracker_and_the_ckpt_step(root):
    assert latest_checkpoint(root) == root / "iter_0000010"
    assert find_checkpoint(str(root)) == root / "iter_0000010"
    assert find_checkpoint(str(root), step=3) == root / "iter_0000003"
    # another program's checkpoint (no meta.json / run state): its weights are what a resume reads
    assert resume_dir(str(root)) == root / "iter_0000010"
    with pytest.raises(CheckpointError, match="--ckpt-step .*iter_0000005"):
        find_checkpoint(str(root), step=5)


def test_a_checkpoint_of_this_project_in_the_layout_is_checked_complete(root):
    folder = root / "iter_0000010"
    (folder / "meta.json").write_text(json.dumps({"rollout_id": 10, "files": ["metadata.json", "scheduler.pt"]}))
    with pytest.raises(CheckpointError, match=r"iter_0000010 is incomplete: .*scheduler.pt is missing.* resume from "
                                              r"the previous checkpoint with --load .*iter_0000003"):
        resume_dir(str(root))


def test_ckpt_step_picks_a_rollout_folder_of_an_fsdp_save_too(tmp_path):
    for rollout_id in (1, 2):
        (tmp_path / f"rollout_{rollout_id}").mkdir()
    (tmp_path / "latest").write_text("rollout_2")
    assert find_checkpoint(str(tmp_path)) == tmp_path / "rollout_2"
    assert find_checkpoint(str(tmp_path), step=1) == tmp_path / "rollout_1"
    with pytest.raises(CheckpointError, match="--ckpt-step 5: --load .* has no checkpoint rollout_5"):
        find_checkpoint(str(tmp_path), step=5)
