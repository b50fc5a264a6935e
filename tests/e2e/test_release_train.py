"""--release-train end to end (slime's tests/e2e/test_release_train.py, on the CPU): train.py with the Megatron backend
and disk weight sync ends its train processes after every weight push and starts new ones from the latest --save
checkpoint before the next train step. Trained on the same samples (a second run replays the first one's rollouts
with --load-debug-rollout-data, its engines still getting every push), a run without it has the same losses and
gradient norms at every rollout: weights, optimizer state and RNG came back exactly, in new processes each rollout.
The engine's log-probs equal the trainer's after every disk push."""

import pytest

from tests.config.test_flag_status import base  # noqa: F401  (the fixture: a minimal run's flags over a config-only model)
from tests.e2e.test_train import read_metrics, run_train

pytestmark = pytest.mark.e2e
pytest.importorskip("megatron.core")

NUM_ROLLOUT = 3


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from examples.quickstart.task import build_task

    return build_task(tmp_path_factory.mktemp("task"), seed=0)


def grpo_argv(task, run, *extra):
    return ["--train-backend", "megatron", "--actor-num-gpus-per-node", "1", "--hf-checkpoint", str(task["model"]),
            "--prompt-data", str(task["train"]), "--input-key", "prompt", "--label-key", "label",
            "--apply-chat-template", "--custom-rm-path", "tests.helpers.e2e_rewards.sample_index_parity",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
            "--num-rollout", str(NUM_ROLLOUT), "--rollout-max-response-len", "8", "--lr", "1e-3",
            "--update-weight-transport", "disk", "--update-weight-disk-dir", str(run / "weights"),
            "--save", str(run / "ckpt"), "--save-interval", "1", "--output-dir", str(run / "out"), "--no-progress",
            *extra]


def test_released_train_processes_come_back_exactly(task, tmp_path):
    rollouts = str(tmp_path / "rollouts" / "rollout_{rollout_id}.json")
    run_train(grpo_argv(task, tmp_path / "released", "--release-train", "--save-debug-rollout-data", rollouts))
    run_train(grpo_argv(task, tmp_path / "kept", "--load-debug-rollout-data", rollouts))
    runs = {name: read_metrics(tmp_path / name / "out") for name in ("released", "kept")}
    # new train processes before every rollout's training (released after the first push and every later one)
    assert all(row["perf/train_recreate_time"] > 0 for row in runs["released"])
    assert not any("perf/train_recreate_time" in row for row in runs["kept"])
    for rollout_id in range(NUM_ROLLOUT):
        row, reference = runs["released"][rollout_id], runs["kept"][rollout_id]
        assert row["train/loss"] == pytest.approx(reference["train/loss"], rel=1e-5, abs=1e-7)
        assert row["train/grad_norm"] == pytest.approx(reference["train/grad_norm"], rel=1e-4)
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-3  # the engines loaded the trained weights
    assert all(row["train/grad_norm"] > 0 for row in runs["kept"])  # it trained: the comparison can fail


def test_release_train_rules_name_the_flag(base, tmp_path):
    from slime.config.arguments import parse_args

    base = [*base, "--release-train", "--output-dir", str(tmp_path)]
    disk = ["--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path / "w")]
    cases = [
        (base + disk + ["--save", str(tmp_path / "c")], "--train-backend megatron"),
        (base + disk + ["--train-backend", "megatron"], "needs --save"),
        (base + ["--train-backend", "megatron", "--save", str(tmp_path / "c")], "--update-weight-transport disk"),
        (base + disk + ["--train-backend", "megatron", "--save", str(tmp_path / "c"), "--use-fault-tolerance"],
         "--use-fault-tolerance"),
        (base + disk + ["--train-backend", "megatron", "--save", str(tmp_path / "c"), "--keep-old-actor"],
         "--keep-old-actor"),
    ]
    for argv, expected in cases:
        with pytest.raises(ValueError, match=expected.replace("-", r"\-")):
            parse_args(argv)
