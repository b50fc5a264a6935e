"""train.py / train_async.py end to end on the CPU for the algorithm surface, two runs of two rollouts that must
finish with finite metrics: train.py with PPO and its critic (plus KL in the reward, DAPO-style dynamic sampling
with over-sampling and partial rollout); train_async.py with GSPO, a trainer-side OPD teacher, Dr.GRPO's constant
normaliser, sequence-masked TIS and --keep-old-actor."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_train import read_metrics

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from examples.quickstart.task import build_task

    return build_task(tmp_path_factory.mktemp("task"), seed=0)


def run(script, task, out, *extra, timeout=300):
    argv = ["--hf-checkpoint", str(task["model"]), "--prompt-data", str(task["train"]), "--input-key", "prompt",
            "--label-key", "label", "--apply-chat-template", "--rollout-batch-size", "4", "--n-samples-per-prompt",
            "4", "--rollout-max-response-len", "8", "--num-rollout", "2", "--lr", "1e-3", "--output-dir", str(out),
            "--no-progress", *map(str, extra)]
    result = subprocess.run([sys.executable, str(REPO / script), *argv], cwd=REPO, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{script} failed:\nSTDOUT:\n{result.stdout[-3000:]}\nSTDERR:\n{result.stderr[-6000:]}"
    rows = read_metrics(out)
    assert [r["rollout_id"] for r in rows] == [0, 1]
    for row in rows:
        for key, value in row.items():
            if isinstance(value, float):
                assert math.isfinite(value), (key, value)
    return rows


def test_ppo_critic_with_reward_kl_dynamic_sampling_and_partial_rollout(task, tmp_path):
    rows = run("train.py", task, tmp_path / "run", "--advantage-estimator", "ppo", "--num-critic-only-steps", "1",
               "--kl-coef", "0.01", "--ref-load", task["model"], "--gamma", "0.99", "--lambd", "0.95",
               "--custom-rm-path", "tests.helpers.e2e_rewards.response_hash_parity",
               "--dynamic-sampling-filter-path", "slime.rollout.filter_hub.check_reward_nonzero_std",
               "--over-sampling-batch-size", "8", "--partial-rollout", "--save", tmp_path / "ckpt")
    critic_only, both = rows
    assert "critic/value_loss" in critic_only and "train/pg_loss" not in critic_only
    assert "critic/value_loss" in both and "train/pg_loss" in both
    assert both["critic/value_loss"] > 0
    assert both["rollout/num_samples"] == 16  # the filter kept only groups whose rewards vary, 4 of them
    assert (tmp_path / "ckpt" / "critic" / "latest").is_file() and (tmp_path / "ckpt" / "latest").is_file()


def test_train_async_gspo_with_opd_teacher_dr_grpo_masked_tis_and_keep_old_actor(task, tmp_path):
    from examples.quickstart.task import build_task

    teacher = build_task(tmp_path / "teacher_task", seed=1)["model"]
    rows = run("train_async.py", task, tmp_path / "run", "--advantage-estimator", "gspo", "--rm-type", "math",
               "--use-opd", "--opd-teacher-load", teacher, "--opd-kl-coef", "0.5",
               "--disable-grpo-std-normalization", "--loss-agg-mode", "constant",
               "--use-tis", "--tis-mode", "mask_sequence", "--tis-clip-low", "0.5", "--keep-old-actor")
    for row in rows:
        for key in ("train/pg_loss", "train/opd_reverse_kl", "train/tis_abs", "train/grad_norm",
                    "perf/wait_rollout_time"):
            assert key in row, (key, sorted(row))
        assert row["train/opd_reverse_kl"] != 0.0  # a different model: the teacher's log-probs differ
        # old log-probs come from the weights that generated the data, so they match the engine's even though
        # rollout 1 was generated before the trainer's first update was pushed
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-3
    assert rows[1]["train/ppo_kl"] != 0.0  # ...and differ from the current weights
