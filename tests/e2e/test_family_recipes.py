"""A tiny CPU equivalent of slime's recipe for each GLM-4.5 / DeepSeek-V3-family model (scripts/run-glm4.7-355B-A32B.sh,
run-glm4.7-30B-A3B.sh, run-deepseek-r1.sh, run-kimi-k2-Instruct.sh, run-moonlight-16B-A3B.sh): a tiny checkpoint of
the family (tests/helpers/family_checkpoints.py), converted to a Megatron checkpoint the way slime's recipes expect
(tools/convert_hf_to_torch_dist.py, HF files removed as slime's converter leaves none), then train.py with the
preset's flags scaled down to it and the recipe's GRPO, optimizer and checkpoint flags: --ref-load the converted
checkpoint, --load = --save, routing replay from the rollout (R3). Two rollouts on the built-in engine and the
Megatron backend; the trainer's log-probs equal the engine's (R3), and the save is a Megatron-LM checkpoint.

Needs the families in the engine and the Megatron backend (GLM-4.5, GLM-4.7-Flash's and DeepSeek-V3's MLA): slow."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_train import read_metrics, run_train
from tests.helpers.family_checkpoints import build_family_checkpoint, scaled_preset_flags

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # 80-130 s each on 2 cores (with the families' branches merged)
pytest.importorskip("megatron.core")
REPO = Path(__file__).resolve().parents[2]

# The recipes' algorithm flags (GRPO_ARGS, OPTIMIZER_ARGS of slime's run scripts; the Adam offload flags left out).
RECIPE_GRPO = ["--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type",
               "low_var_kl", "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28"]
RECIPE_OPTIMIZER = ["--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
                    "--adam-beta1", "0.9", "--adam-beta2", "0.98"]
RECIPES = {"run-glm4.7-355B-A32B.sh": "glm4.5", "run-glm4.7-30B-A3B.sh": "glm4.7-flash",
           "run-deepseek-r1.sh": "deepseek-v3", "run-kimi-k2-Instruct.sh": "kimi-k2",
           "run-moonlight-16B-A3B.sh": "moonlight"}


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from examples.quickstart.task import build_task

    return build_task(tmp_path_factory.mktemp("family_task"), seed=0)


def _slime_torch_dist(hf: Path, root: Path, family: str) -> Path:
    result = subprocess.run([sys.executable, "tools/convert_hf_to_torch_dist.py", "--hf-checkpoint", str(hf),
                             "--save", str(root), *scaled_preset_flags(family)], cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]
    for path in (root / "release").iterdir():
        if path.suffix == ".json" and path.name != "metadata.json" or path.name.endswith(".jinja"):
            path.unlink()
    assert not (root / "release" / "config.json").exists()
    return root


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_tiny_family_recipe_runs(task, tmp_path, recipe):
    assert (REPO / "scripts" / recipe).is_file()
    family = RECIPES[recipe]
    hf = build_family_checkpoint(tmp_path / family, family, task["model"])
    torch_dist = _slime_torch_dist(hf, tmp_path / f"{family}_torch_dist", family)
    save, out = tmp_path / f"{family}_slime", tmp_path / "run"
    run_train([
        "--train-backend", "megatron", "--actor-num-gpus-per-node", "1", *scaled_preset_flags(family),
        "--hf-checkpoint", str(hf), "--ref-load", str(torch_dist), "--load", str(save), "--save", str(save),
        "--save-interval", "1",
        "--prompt-data", str(task["train"]), "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--rollout-shuffle", "--rm-type", "math", "--num-rollout", "2",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8",
        "--rollout-temperature", "1", "--use-rollout-routing-replay", *RECIPE_GRPO, *RECIPE_OPTIMIZER,
        "--output-dir", str(out), "--no-progress",
    ], timeout=1200)
    rows = read_metrics(out)
    assert [row["rollout_id"] for row in rows] == [0, 1]
    for row in rows:
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-4  # R3: the trainer routes as the engine did
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert (save / "iter_0000001" / "metadata.json").is_file()
    shutil.rmtree(tmp_path / family)
