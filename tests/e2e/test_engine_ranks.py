"""train.py on the CPU with `--rollout-num-gpus-per-engine 2`: the built-in engine runs each engine as two gloo rank
processes (real Ray, the real router). Colocated, trainer rank r feeds engine rank r (FSDP: each trainer rank sends
its own handle; Megatron TP=2: rank 0 sends both); disaggregated, trainer rank 0 sends each engine rank its handle.
After every push the engine computes the trainer's log-probs (train/train_rollout_logprob_abs_diff), and the
quickstart's held-out accuracy rises with a two-rank engine under both trainers (slow)."""

import json
import subprocess
import sys

import pytest

from tests.e2e.test_train import REPO, read_metrics, run_train

pytestmark = pytest.mark.e2e
MEGATRON_TP2 = ("--train-backend", "megatron", "--tensor-model-parallel-size", "2")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from examples.quickstart.task import build_task

    return build_task(tmp_path_factory.mktemp("task"), seed=0)


def grpo_argv(task, out, *extra):
    return ["--hf-checkpoint", str(task["model"]), "--prompt-data", str(task["train"]), "--input-key", "prompt",
            "--label-key", "label", "--apply-chat-template", "--rm-type", "math", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "4", "--num-rollout", "2", "--rollout-max-response-len", "8", "--lr", "1e-3",
            "--actor-num-gpus-per-node", "2", "--rollout-num-gpus-per-engine", "2", "--eval-prompt-data", "arith",
            str(task["eval"]), "--eval-interval", "2", "--eval-max-response-len", "8", "--output-dir", str(out),
            "--no-progress", *extra]


def check_run(out, num_engines: int) -> None:
    args = json.loads((out / "args.json").read_text())
    assert (args["rollout_backend"], args["rollout_num_engines"]) == ("slime", num_engines)
    for engine in range(num_engines):
        assert json.loads((out / f"engine_{engine}.json").read_text())["engine"]["tp_size"] == 2
    rows = read_metrics(out)
    assert [r["rollout_id"] for r in rows] == [0, 1]
    for row in rows:
        assert row["rollout/num_samples"] == 16
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-3  # both engine ranks hold the pushed weights
    assert "eval/arith" in rows[1]


@pytest.mark.parametrize("layout", [
    pytest.param(("--colocate",), id="fsdp_colocated"),
    pytest.param(("--rollout-num-gpus", "2"), id="fsdp_disaggregated", marks=pytest.mark.slow),
    pytest.param(("--colocate", *MEGATRON_TP2), id="megatron_tp2_colocated", marks=pytest.mark.slow),
])
def test_grpo_with_an_engine_of_two_ranks(task, tmp_path, layout):
    if "megatron" in layout:
        pytest.importorskip("megatron.core")
    out = tmp_path / "run"
    run_train(grpo_argv(task, out, *layout), timeout=900)
    check_run(out, num_engines=1)


@pytest.mark.slow  # the quickstart (SFT warm start, then 80 GRPO rollouts) with an engine of two ranks: FSDP 12 min, Megatron TP=2 10 min on 2 cores
@pytest.mark.parametrize("backend", [(), ("--train-backend", "megatron", "--tensor-model-parallel-size", "2")],
                         ids=["fsdp", "megatron_tp2"])
def test_quickstart_with_an_engine_of_two_ranks_raises_held_out_accuracy(tmp_path, backend):
    if backend:
        pytest.importorskip("megatron.core")
    result = subprocess.run(
        [sys.executable, str(REPO / "examples/quickstart/run.py"), "--out-dir", str(tmp_path),
         "--rollout-num-gpus-per-engine", "2", *backend],
        cwd=REPO, capture_output=True, text=True, timeout=5400)
    assert result.returncode == 0, result.stderr[-6000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    args = json.loads((tmp_path / "grpo_run" / "args.json").read_text())
    assert (args["rollout_num_gpus_per_engine"], args["rollout_num_engines"], args["colocate"]) == (2, 1, True)
    assert summary["eval_accuracy_after_rl"] > summary["eval_accuracy_before_rl"]
