"""train.py with --lora-rank, disaggregated on two GPUs (trainer on one, the built-in engine on the other: the
weight sender's "distributed" mode): every adapter push goes over the NCCL weight-update group
(/load_lora_adapter_from_distributed, `perf/lora_push_broadcast_gb` in metrics.jsonl), carries the adapter alone,
and the engine serves it (its log-probs match the trainer's). The CPU tests of the route:
tests/backends/test_lora_push_distributed.py."""

import pytest
import torch

from tests.e2e.test_train import read_metrics, run_train

pytestmark = [pytest.mark.e2e, pytest.mark.gpu]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from examples.quickstart.task import build_task

    return build_task(tmp_path_factory.mktemp("task"), seed=0)


def test_disaggregated_lora_run_pushes_the_adapter_over_the_weight_update_group(task, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (the trainer's and the engine's)")
    out = tmp_path / "run"
    run_train([
        "--device", "cuda", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
        "--hf-checkpoint", str(task["model"]), "--prompt-data", str(task["train"]), "--input-key", "prompt",
        "--label-key", "label", "--apply-chat-template", "--rollout-batch-size", "4",
        "--custom-rm-path", "tests.helpers.e2e_rewards.sample_index_parity",
        "--n-samples-per-prompt", "4", "--num-rollout", "3", "--rollout-max-response-len", "8",
        "--lora-rank", "8", "--lora-alpha", "16", "--target-modules", "all-linear", "--lr", "2e-2",
        "--output-dir", str(out), "--no-progress",
    ])
    rows = read_metrics(out)
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert row["perf/lora_push_broadcast_gb"] == pytest.approx(row["perf/weight_push_gb"])  # the group's route
        assert 0 < row["perf/weight_push_gb"] < 0.01  # the adapter alone
        assert row["train/train_rollout_logprob_abs_diff"] < 2e-2  # the engine served the trainer's adapter (bf16)
