"""Checkpoints stay loadable under SIGKILL: a process that saves trainer checkpoints back to back (each rollout id
twice, so a save also replaces the folder `latest` names) is killed at random moments; after every kill `--load`
of the save root must find a complete checkpoint whose every tensor is the one that save wrote, no older than the
last save the process reported finished."""

import json
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
MAX_KILLS = 40

SAVER = textwrap.dedent("""
    import itertools, sys
    import torch
    from transformers import AutoModelForCausalLM
    from slime.backends.fsdp_utils.checkpoint import save_checkpoint

    model_dir, root, first = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()  # the optimizer has state to save
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    print("ready", flush=True)
    for save in itertools.count(first):
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(float(save))
        save_checkpoint(root, save // 2, model, optimizer, scheduler, hf_checkpoint=model_dir,
                        tie_word_embeddings=bool(model.config.tie_word_embeddings), rank=0, run_state={"save": save})
        print(save, flush=True)
""")


def start_saver(model_dir, root: Path, first: int) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", SAVER, str(model_dir), str(root), str(first)], cwd=REPO,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    return process


def test_checkpoint_killed_at_random_points_always_loads(tiny_qwen3, tmp_path):
    from safetensors.torch import load_file

    from slime.backends.fsdp_utils.checkpoint import load_training_state
    from slime.utils.checkpoint_state import MODEL_FILE, RUN_STATE_FILE, resume_dir

    root, rng, next_save, last_finished = tmp_path / "ckpt", random.Random(0), 0, None
    num_kills_inside_a_save = 0
    # At least 5 kills, and more until one has landed inside a save: where saves are quick, a kill at a random
    # moment often falls between two (MAX_KILLS bounds the search; a kill inside a save is most of the loop's time).
    for num_kills in range(MAX_KILLS):
        if num_kills >= 5 and num_kills_inside_a_save:
            break
        saver = start_saver(tiny_qwen3, root, next_save)
        time.sleep(rng.uniform(0.2, 1.5))
        saver.send_signal(signal.SIGKILL)
        saver.wait()
        finished = [int(line) for line in saver.stdout.read().split()]
        last_finished = finished[-1] if finished else last_finished
        num_kills_inside_a_save += any(p.name.endswith(".tmp") for p in root.iterdir()) if root.is_dir() else 0

        folder = resume_dir(str(root), load_if_exists=True)  # what --load resolves and checks
        if last_finished is None:
            assert folder is None or folder.name == "rollout_0"
            continue
        assert folder is not None
        save = json.loads((folder / RUN_STATE_FILE).read_text())["save"]
        assert save >= last_finished and folder.name == f"rollout_{save // 2}"
        tensors = load_file(str(folder / MODEL_FILE))
        assert tensors and all(bool((t == float(save)).all()) for t in tensors.values())  # one save's, complete
        next_save = save + 1
    assert last_finished is not None and num_kills_inside_a_save >= 1  # the kills did land in the middle of saves

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    assert load_training_state(folder, model, optimizer, scheduler, rank=0) == save // 2


@pytest.mark.parametrize("exists", [False, True])
def test_publish_folder_replaces_atomically(tmp_path, exists):
    from slime.utils.checkpoint_state import publish_folder

    final, tmp = tmp_path / "rollout_3", tmp_path / "rollout_3.tmp"
    if exists:
        final.mkdir()
        (final / "model.safetensors").write_text("old")
    tmp.mkdir()
    (tmp / "model.safetensors").write_text("new")
    publish_folder(tmp, final)
    assert (final / "model.safetensors").read_text() == "new" and not tmp.exists()
