"""examples/vl_shapes through train.py: the SFT warm start on the PIL-drawn shapes task with a tiny random
Qwen2.5-VL. The smoke run checks the loop end to end (images -> processor -> packed VL training -> an HF checkpoint
with its image processor that transformers generates from); the slow run checks that it learns (held-out accuracy
from 0 to >= 0.5; measured 0.75 after 40 rollouts, benchmarks/RESULTS.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.vl_shapes.evaluate import accuracy
from examples.vl_shapes.task import build_task
from slime.utils.tiny_vl_model import build_tiny_vl_model

REPO = Path(__file__).resolve().parents[2]


def _sft(tmp_path: Path, num_rollout: int, num_train: int) -> tuple[Path, Path]:
    files = build_task(tmp_path / "data", num_train=num_train, num_test=24)
    model = build_tiny_vl_model(tmp_path / "model", arch="qwen2_5_vl")
    argv = ["--hf-checkpoint", model, "--prompt-data", files["train"], "--input-key", "prompt", "--label-key", "label",
            "--apply-chat-template", "--multimodal-keys", '{"image": "images"}',
            "--custom-rm-path", "examples.vl_shapes.reward.reward",
            "--rollout-function-path", "examples.vl_shapes.sft_rollout.generate_rollout", "--loss-type", "sft_loss",
            "--calculate-per-token-loss", "--debug-train-only", "--rollout-batch-size", "32", "--global-batch-size",
            "32", "--rollout-shuffle", "--num-rollout", str(num_rollout), "--lr", "3e-3", "--lr-warmup-iters", "5",
            "--save", tmp_path / "sft", "--save-interval", str(num_rollout), "--output-dir", tmp_path / "run",
            "--actor-num-gpus-per-node", "1", "--micro-batch-size", "32", "--seed", "1", "--no-progress"]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "train.py", *map(str, argv)], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return tmp_path / "sft" / f"rollout_{num_rollout - 1}", files["test"]


@pytest.mark.e2e
def test_vl_sft_smoke_run_saves_a_checkpoint_transformers_generates_from(tmp_path):
    checkpoint, test_file = _sft(tmp_path, num_rollout=2, num_train=64)
    assert (checkpoint / "preprocessor_config.json").is_file()  # the image processor travels with the weights
    assert 0.0 <= accuracy(checkpoint, test_file, max_new_tokens=2) <= 1.0


@pytest.mark.slow
def test_vl_sft_learns_the_shapes_task(tmp_path):
    before = accuracy(build_tiny_vl_model(tmp_path / "base", arch="qwen2_5_vl"), build_task(tmp_path / "d0")["test"])
    checkpoint, test_file = _sft(tmp_path, num_rollout=40, num_train=240)
    after = accuracy(checkpoint, test_file)
    assert before <= 0.1 and after >= 0.5, (before, after)
