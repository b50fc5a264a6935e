"""GRPO through train.py on tiny GLM-4 (Glm4ForCausalLM) and GLM-4.5 (Glm4MoeForCausalLM: a leading dense layer,
biased sigmoid router with 4 groups / 2 kept, a shared expert) checkpoints: real Ray, the built-in engine behind
sglang-router, the FSDP trainer. GLM-4.5 runs with R3 (--use-rollout-routing-replay): the engine returns its routing
in SGLang's every-layer layout and the trainer replays the MoE layers' rows. Both keep the trainer's and the
engine's log-probs of the same tokens together (fp32 on both sides, the same weights after every sync): the ratio
exp(train - rollout) within 1e-4 of 1 from its 1st to its 99th percentile, also after training moved the weights
(rewards by sample parity: every group has a non-zero advantage)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.slow]
TINY = {"glm4": {}, "glm4_moe": dict(n_group=4, topk_group=2)}


def run_grpo(tmp_path: Path, arch: str, *extra) -> list[dict]:
    from examples.quickstart.task import build_task
    from slime.utils.tiny_model import build_tiny_model

    paths = build_task(tmp_path / "task", seed=0)
    model = build_tiny_model(tmp_path / "model", arch=arch, vocab_size=300, seed=0, initializer_range=0.1, **TINY[arch])
    out = tmp_path / "out"
    argv = ["--hf-checkpoint", str(model), "--prompt-data", str(paths["train"]), "--input-key", "prompt",
            "--label-key", "label", "--apply-chat-template", "--rollout-batch-size", "2",
            "--custom-rm-path", "tests.helpers.e2e_rewards.sample_index_parity",
            "--n-samples-per-prompt", "4", "--num-rollout", "2", "--rollout-max-response-len", "8",
            "--actor-num-gpus-per-node", "1", "--lr", "1e-3", "--get-mismatch-metrics", "--output-dir", str(out),
            "--no-progress", *extra]
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *argv], cwd=REPO, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, (f"train.py failed:\nSTDOUT:\n{result.stdout[-4000:]}\n"
                                    f"STDERR:\n{result.stderr[-6000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _check_rows(rows: list[dict]) -> None:
    assert [row["rollout_id"] for row in rows] == [0, 1]
    for row in rows:
        assert row["train/grad_norm"] > 0
        assert max(row["train/mismatch_ratio_p99"] - 1, 1 - row["train/mismatch_ratio_p1"]) < 1e-4, row


def test_glm4_grpo(tmp_path):
    _check_rows(run_grpo(tmp_path, "glm4"))


def test_glm4_moe_grpo_with_rollout_routing_replay(tmp_path):
    rows = run_grpo(tmp_path, "glm4_moe", "--use-rollout-routing-replay")
    _check_rows(rows)
    for row in rows:
        assert row["train/router_agreement"] > 0.9  # same weights, fp32: the trainer's own choice agrees
