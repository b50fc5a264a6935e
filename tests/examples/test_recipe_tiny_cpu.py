"""scripts/run-tiny-cpu.sh, the CPU equivalent of slime's Qwen3-4B recipe (same flag groups, the quickstart's tiny
model), run as a user runs it: `bash scripts/run-tiny-cpu.sh`, which builds the task when missing and starts
train.py (real Ray, one colocated engine and trainer, the sglang-router); with two processes, the 4B recipe's layout
of one engine of two ranks. The slow variant resumes the recipe from its own --save folder, as slime's recipes do
(`--load DIR --save DIR`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def run_recipe(task_dir: Path, out: Path, num_rollout: int, num_gpus: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO),
           "TASK_DIR": str(task_dir), "NUM_ROLLOUT": str(num_rollout), "NUM_GPUS": str(num_gpus)}
    result = subprocess.run(["bash", str(REPO / "scripts/run-tiny-cpu.sh"), "--output-dir", str(out), "--no-progress"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"STDOUT:\n{result.stdout[-3000:]}\nSTDERR:\n{result.stderr[-5000:]}"
    return result


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tiny_cpu_recipe_runs_two_rollouts(tmp_path):
    result = run_recipe(tmp_path / "task", tmp_path / "run", num_rollout=2, num_gpus=1)
    assert (tmp_path / "task/model/config.json").is_file()  # the recipe built the task it names
    args = json.loads((tmp_path / "run/args.json").read_text())
    # every group's flags arrived: a sample of each (the recipe's values, not the defaults)
    assert (args["num_layers"], args["kv_channels"], args["train_backend"], args["colocate"]) == (4, 32, "fsdp", True)
    assert (args["rollout_batch_size"], args["n_samples_per_prompt"], args["global_batch_size"]) == (4, 4, 16)
    assert (args["eps_clip_high"], args["kl_loss_type"], args["adam_beta2"], args["lr"]) == (0.28, "low_var_kl", 0.98,
                                                                                            5e-4)
    assert args["eval_interval"] == 20 and args["sglang_mem_fraction_static"] == 0.7
    assert "--attention-backend: no effect here" in result.stderr + result.stdout  # reported, once
    assert (result.stderr + result.stdout).count("--attention-backend: no effect here") == 1
    rows = metrics(tmp_path / "run")
    assert [row["rollout_id"] for row in rows] == [0, 1]
    for row in rows:
        assert row["rollout/num_samples"] == 16 and "train/loss" in row and "train/grad_norm" in row
        # the colocated engine samples with the trainer's weights after every offload / reload cycle
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-3
    assert "eval/arith" in rows[0]
    # the recipe saves into its --load folder at the last rollout, so running it again resumes there
    assert (tmp_path / "task/ckpt/latest").read_text().strip() == "rollout_1"


@pytest.mark.slow  # ~75 s on 2 cores; test_engine_ranks.py runs this layout in CI
def test_tiny_cpu_recipe_runs_the_4b_layout_of_two_devices_per_engine(tmp_path):
    """NUM_GPUS=2: the Qwen3-4B recipe's layout, two trainer processes colocated with one built-in engine of two
    ranks (--rollout-num-gpus-per-engine 2), trainer rank r feeding engine rank r."""
    run_recipe(tmp_path / "task", tmp_path / "run", num_rollout=2, num_gpus=2)
    args = json.loads((tmp_path / "run/args.json").read_text())
    assert (args["rollout_num_gpus_per_engine"], args["rollout_num_engines"], args["colocate"]) == (2, 1, True)
    assert json.loads((tmp_path / "run/engine_0.json").read_text())["engine"]["tp_size"] == 2
    rows = metrics(tmp_path / "run")
    assert [row["rollout_id"] for row in rows] == [0, 1]
    for row in rows:  # both engine ranks sample with the trainer's weights after every push
        assert row["rollout/num_samples"] == 16 and row["train/train_rollout_logprob_abs_diff"] < 1e-3


@pytest.mark.slow
def test_tiny_cpu_recipe_resumes_from_its_save_folder(tmp_path):
    run_recipe(tmp_path / "task", tmp_path / "first", num_rollout=2, num_gpus=2)
    run_recipe(tmp_path / "task", tmp_path / "second", num_rollout=4, num_gpus=2)
    assert [row["rollout_id"] for row in metrics(tmp_path / "second")] == [2, 3]
    assert (tmp_path / "task/ckpt/latest").read_text().strip() == "rollout_3"
