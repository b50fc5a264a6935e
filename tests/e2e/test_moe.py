"""GRPO through train.py on a tiny Qwen3-MoE (real Ray, the built-in engine behind sglang-router, two trainer
processes: FSDP2, or Megatron with the experts split over them, --expert-model-parallel-size 2, and grouped as
slime's MoE presets ask, --moe-grouped-gemm): with R3
(--use-rollout-routing-replay) the engines return their routing, the trainer replays it and reports the router
agreement; without it the same run routes freely. All keep the trainer's and the engine's log-probs of the same
tokens together (fp32 on both sides, the same weights after every sync)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from examples.quickstart.task import build_task
    from slime.utils.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("moe_task")
    paths = build_task(root, seed=0)
    paths["model"] = build_tiny_model(root / "moe_model", arch="qwen3_moe", vocab_size=300, seed=0,
                                      num_hidden_layers=2, initializer_range=0.1)
    return paths


def run_grpo(task, out: Path, *extra) -> list[dict]:
    argv = ["--hf-checkpoint", str(task["model"]), "--prompt-data", str(task["train"]), "--input-key", "prompt",
            "--label-key", "label", "--apply-chat-template", "--rm-type", "math", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "4", "--num-rollout", "2", "--rollout-max-response-len", "8",
            "--actor-num-gpus-per-node", "2", "--lr", "1e-3", "--get-mismatch-metrics",
            "--moe-aux-loss-coeff", "1e-3", "--output-dir", str(out), "--no-progress", *extra]
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *argv], cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, (f"train.py failed:\nSTDOUT:\n{result.stdout[-4000:]}\n"
                                    f"STDERR:\n{result.stderr[-6000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _check_rows(rows: list[dict]) -> None:
    assert [row["rollout_id"] for row in rows] == [0, 1]
    for row in rows:
        for key in ("train/loss", "train/grad_norm", "train/moe_aux_loss", "train/moe_load_imbalance",
                    "train/mismatch_ratio_p1", "train/mismatch_ratio_p99"):
            assert key in row, (key, sorted(row))
        assert row["train/mismatch_ratio_p99"] - row["train/mismatch_ratio_p1"] < 2e-3


def _check_agreement(rows: list[dict]) -> None:
    for row in rows:
        # Same weights, both fp32: the trainer's own routing agrees with the engine's but for rare near-ties.
        assert row["train/router_agreement"] > 0.9
        assert row["train/router_agreement_layer_min"] <= row["train/router_agreement_layer_p50"] <= 1.0


def test_grpo_with_rollout_routing_replay(task, tmp_path):
    rows = run_grpo(task, tmp_path / "r3", "--use-rollout-routing-replay")
    _check_rows(rows)
    _check_agreement(rows)


MEGATRON_EP2 = ("--train-backend", "megatron", "--expert-model-parallel-size", "2", "--moe-grouped-gemm")


def test_megatron_ep2_grpo_with_rollout_routing_replay(task, tmp_path):
    rows = run_grpo(task, tmp_path / "megatron_r3", *MEGATRON_EP2, "--use-rollout-routing-replay")
    _check_rows(rows)
    _check_agreement(rows)


@pytest.mark.slow
def test_megatron_ep2_grpo_with_free_routing(task, tmp_path):
    rows = run_grpo(task, tmp_path / "megatron_free", *MEGATRON_EP2)
    _check_rows(rows)
    assert not any("train/router_agreement" in row for row in rows)


@pytest.mark.slow
def test_grpo_with_free_routing(task, tmp_path):
    rows = run_grpo(task, tmp_path / "free")
    _check_rows(rows)
    assert not any("train/router_agreement" in row for row in rows)
