"""examples/vl_shapes through train.py: the SFT warm start and GRPO on the PIL-drawn shapes task with a tiny random
Qwen2.5-VL. The smoke run checks the loop end to end (images -> processor -> packed VL training -> an HF checkpoint
with its image processor that transformers generates from -> GRPO rollouts on the engine with image_data); the slow
run checks that it learns (SFT: held-out accuracy from 0 to >= 0.5, measured 0.75; GRPO: the engine-sampled held-out
accuracy up, measured 0.69 -> 0.84; benchmarks/RESULTS.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.vl_shapes.evaluate import accuracy
from examples.vl_shapes.task import build_task
from slime.utils.tiny_vl_model import build_tiny_vl_model

REPO = Path(__file__).resolve().parents[2]


DATA_FLAGS = ["--input-key", "prompt", "--label-key", "label", "--apply-chat-template", "--multimodal-keys",
              '{"image": "images"}', "--custom-rm-path", "examples.vl_shapes.reward.reward",
              "--actor-num-gpus-per-node", "1", "--seed", "1", "--no-progress"]


def _train(argv: list) -> None:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "train.py", *map(str, argv + DATA_FLAGS)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _sft(tmp_path: Path, num_rollout: int, num_train: int) -> tuple[Path, dict]:
    files = build_task(tmp_path / "data", num_train=num_train, num_test=24 if num_train < 100 else 48)
    model = build_tiny_vl_model(tmp_path / "model", arch="qwen2_5_vl")
    _train(["--hf-checkpoint", model, "--prompt-data", files["train"],
            "--rollout-function-path", "examples.vl_shapes.sft_rollout.generate_rollout", "--loss-type", "sft_loss",
            "--calculate-per-token-loss", "--debug-train-only", "--rollout-batch-size", "32", "--global-batch-size",
            "32", "--rollout-shuffle", "--num-rollout", str(num_rollout), "--lr", "3e-3", "--lr-warmup-iters", "5",
            "--save", tmp_path / "sft", "--save-interval", str(num_rollout), "--output-dir", tmp_path / "run",
            "--micro-batch-size", "32"])
    return tmp_path / "sft" / f"rollout_{num_rollout - 1}", files


def _grpo(tmp_path: Path, checkpoint: Path, files: dict, num_rollout: int, batch: list[str]) -> list[float]:
    """The README's GRPO command; returns the engine-sampled held-out accuracy at each eval."""
    _train(["--hf-checkpoint", checkpoint, "--prompt-data", files["train"], "--rollout-shuffle", *batch,
            "--num-rollout", str(num_rollout), "--rollout-max-response-len", "4", "--rollout-temperature", "1.0",
            "--lr", "5e-4", "--lr-warmup-iters", "8", "--adam-beta2", "0.98", "--weight-decay", "0",
            "--lr-decay-style", "constant", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096",
            "--eval-prompt-data", "shapes", files["test"], "--eval-interval", "10", "--n-samples-per-eval-prompt", "8",
            "--eval-max-response-len", "4", "--output-dir", tmp_path / "grpo_run"])
    rows = [json.loads(line) for line in (tmp_path / "grpo_run" / "metrics.jsonl").read_text().splitlines()]
    return [row["eval/shapes"] for row in rows if "eval/shapes" in row]


def test_sft_rollout_trains_on_the_answer_after_the_encoded_image(tmp_path):
    from examples.vl_shapes.sft_rollout import build_sample
    from slime.config.arguments import parse_args
    from slime.rollout.dataset import PromptFormat, load_prompt_samples, load_tokenizer
    from slime.utils.image_policy import image_token_counts, load_vl_processor

    files = build_task(tmp_path / "data", num_train=4, num_test=1)
    model = build_tiny_vl_model(tmp_path / "model", arch="qwen2_5_vl")
    args = parse_args(["--hf-checkpoint", str(model), "--rollout-batch-size", "1", "--num-rollout", "1",
                       *DATA_FLAGS])
    fmt = PromptFormat(input_key="prompt", label_key="label", apply_chat_template=True,
                       multimodal_keys={"image": "images"})
    tokenizer = load_tokenizer(model)
    samples, _ = load_prompt_samples(str(files["train"]), fmt, tokenizer)
    processor = load_vl_processor(model)
    for sample in samples:
        build_sample(args, tokenizer, sample)
        answer = tokenizer.decode(sample.tokens[-sample.response_length:])
        assert answer == f"{sample.label}<|im_end|>" and sample.loss_mask == [1] * sample.response_length
        grids = sample.multimodal_train_inputs["image_grid_thw"]
        assert sample.tokens.count(processor.image_token_id) == sum(image_token_counts(grids, 2)) == 4


@pytest.mark.e2e
def test_vl_grpo_smoke_run(tmp_path):
    """One GRPO rollout through train.py: the engine samples with image_data, the trainer steps on the images, and
    the saved checkpoint (with its image processor) generates in transformers."""
    files = build_task(tmp_path / "data", num_train=16, num_test=4)
    model = build_tiny_vl_model(tmp_path / "model", arch="qwen2_5_vl")
    _train(["--hf-checkpoint", model, "--prompt-data", files["train"], "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "4", "--global-batch-size", "16", "--num-rollout", "1",
            "--rollout-max-response-len", "4", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096",
            "--save", tmp_path / "grpo", "--save-interval", "1", "--output-dir", tmp_path / "grpo_run"])
    rows = [json.loads(line) for line in (tmp_path / "grpo_run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and 0.0 <= rows[0]["rollout/raw_reward"] <= 1.0
    checkpoint = tmp_path / "grpo" / "rollout_0"
    assert (checkpoint / "preprocessor_config.json").is_file()  # the image processor travels with the weights
    assert 0.0 <= accuracy(checkpoint, files["test"], max_new_tokens=2) <= 1.0


@pytest.mark.slow
def test_vl_sft_and_grpo_learn_the_shapes_task(tmp_path):
    before = accuracy(build_tiny_vl_model(tmp_path / "base", arch="qwen2_5_vl"), build_task(tmp_path / "d0")["test"])
    checkpoint, files = _sft(tmp_path, num_rollout=40, num_train=240)
    after = accuracy(checkpoint, files["test"])
    assert before <= 0.1 and after >= 0.5, (before, after)
    evals = _grpo(tmp_path, checkpoint, files, num_rollout=30,
                  batch=["--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--global-batch-size", "64"])
    assert evals[-1] >= evals[0] + 0.05, evals
