"""train.py under --true-on-policy-mode on the CPU (real Ray, engine, router, two FSDP2 trainer processes): the
engine's log-probs of every trained token equal the trainer's bit for bit in every rollout (mean |diff| exactly 0.0,
every token's two log-probs the same bits), for a single-turn task, a multi-turn tool task, a partial-rollout run
across weight updates, the Megatron backend at TP=1, a Qwen3-MoE with routing replay R3 and a LoRA adapter on FSDP; and two --deterministic-mode runs give identical rollout
dumps and metrics."""

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

    return build_task(tmp_path_factory.mktemp("task"), seed=0)


def run_train(argv, timeout=900):
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *argv], cwd=REPO, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, f"train.py failed:\nSTDOUT:\n{result.stdout[-4000:]}\nSTDERR:\n{result.stderr[-6000:]}"
    return result


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def quickstart_flags(task, out: Path, *extra) -> list[str]:
    return ["--hf-checkpoint", str(task["model"]), "--prompt-data", str(task["train"]), "--input-key", "prompt",
            "--label-key", "label", "--apply-chat-template", "--rm-type", "math", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "4", "--rollout-max-response-len", "12", "--rollout-temperature", "0.9",
            "--actor-num-gpus-per-node", "2", "--lr", "1e-3", "--no-progress", "--output-dir", str(out),
            "--true-on-policy-mode", *extra]


def assert_exact_zero(rows: list[dict], num_rollouts: int) -> None:
    assert [row["rollout_id"] for row in rows] == list(range(num_rollouts))
    for row in rows:
        assert row["train/train_rollout_logprob_abs_diff"] == 0.0, row
        assert row["train/train_rollout_logprob_exact_fraction"] == 1.0, row


def test_dense_run_has_zero_mismatch_in_every_rollout(task, tmp_path):
    out = tmp_path / "run"
    run_train(quickstart_flags(task, out, "--num-rollout", "3", "--num-steps-per-rollout", "2", "--use-kl-loss",
                               "--kl-loss-coef", "0.01", "--ref-load", str(task["model"])))
    assert_exact_zero(read_metrics(out), 3)


@pytest.mark.slow
def test_two_deterministic_runs_are_identical(task, tmp_path):
    runs = []
    for name in ("first", "second"):
        out = tmp_path / name
        run_train(quickstart_flags(task, out, "--num-rollout", "2", "--deterministic-mode",
                                   "--save-debug-rollout-data", str(out / "rollout_{rollout_id}.json")))
        rows = [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in read_metrics(out)]
        dumps = [json.loads((out / f"rollout_{i}.json").read_text()) for i in range(2)]
        runs.append((rows, dumps))
    (rows_a, dumps_a), (rows_b, dumps_b) = runs
    assert_exact_zero(rows_a, 2)
    assert rows_a == rows_b
    assert dumps_a == dumps_b
    tokens = [s["tokens"] for dump in dumps_a for s in dump["samples"]]
    assert len(set(map(tuple, tokens))) > len(tokens) // 2  # the seeds differ per sample: not one sequence 16 times


async def short_groups(args, sample, sampling_params):
    """Every other group stops after 2 tokens: those finish the rollout while the others are still generating, so
    the others are aborted mid-response and continue (--partial-rollout) after the weight update."""
    from slime.rollout.sglang_rollout import generate

    if sample.group_index % 2 == 0:
        sampling_params = {**sampling_params, "max_new_tokens": 2}
    return await generate(args, sample, sampling_params)


@pytest.mark.slow
def test_partial_rollout_across_weight_updates_has_zero_mismatch(task, tmp_path):
    out = tmp_path / "run"
    run_train(quickstart_flags(
        task, out, "--num-rollout", "3", "--rollout-batch-size", "2", "--over-sampling-batch-size", "6",
        "--rollout-max-response-len", "48", "--partial-rollout", "--mask-offpolicy-in-partial-rollout",
        "--custom-generate-function-path", f"{__name__}.short_groups",
        "--save-debug-rollout-data", str(out / "rollout_{rollout_id}.json")))
    assert_exact_zero(read_metrics(out), 3)
    resumed = [s for i in range(3) for s in json.loads((out / f"rollout_{i}.json").read_text())["samples"]
               if s["metadata"].get("start_rollout_id", i) < i]
    assert resumed, "no sample continued across a weight update"
    # its tokens from before the update are masked out; those after it trained with the exact log-probs
    assert any(0 in s["loss_mask"] and 1 in s["loss_mask"] for s in resumed)


@pytest.mark.slow
def test_multi_turn_tool_task_has_zero_mismatch(tmp_path):
    from tests.helpers.agent_tool_task import RESPONSE_TEMPLATE, build_task

    task = build_task(tmp_path / "task")
    out = tmp_path / "run"
    run_train([
        "--hf-checkpoint", str(task["model"]), "--prompt-data", str(task["train"]), "--input-key", "prompt",
        "--label-key", "label", "--apply-chat-template", "--custom-rm-path", "tests.helpers.agent_tool_task.reward",
        "--max-turns", "2", "--tool-functions-path", "tests.helpers.agent_tool_task.lookup",
        "--tool-call-parser", "tests.helpers.agent_tool_task.parse_call", "--tool-response-template",
        RESPONSE_TEMPLATE, "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--num-rollout", "2",
        "--rollout-max-response-len", "16", "--actor-num-gpus-per-node", "2", "--lr", "1e-3", "--no-progress",
        "--output-dir", str(out), "--true-on-policy-mode",
        "--save-debug-rollout-data", str(out / "rollout_{rollout_id}.json"),
    ])
    assert_exact_zero(read_metrics(out), 2)
    samples = [s for i in range(2) for s in json.loads((out / f"rollout_{i}.json").read_text())["samples"]]
    assert any(s["metadata"]["multi_turn"]["turns"] > 1 for s in samples), "no sample took a second turn"


@pytest.mark.slow
def test_megatron_backend_at_tp1_has_zero_mismatch(task, tmp_path):
    pytest.importorskip("megatron.core")
    out = tmp_path / "run"
    run_train(quickstart_flags(task, out, "--train-backend", "megatron", "--num-rollout", "2",
                               "--num-steps-per-rollout", "2"))
    assert_exact_zero(read_metrics(out), 2)


@pytest.mark.slow
def test_moe_with_rollout_routing_replay_has_zero_mismatch(task, tmp_path):
    from slime.utils.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "moe_model", arch="qwen3_moe", vocab_size=300, seed=0, num_hidden_layers=2,
                             initializer_range=0.3)
    out = tmp_path / "run"
    flags = quickstart_flags(task, out, "--num-rollout", "2", "--num-steps-per-rollout", "2",
                             "--use-rollout-routing-replay")
    flags[flags.index("--hf-checkpoint") + 1] = str(model)
    run_train(flags)
    assert_exact_zero(read_metrics(out), 2)


@pytest.mark.slow
def test_lora_run_has_zero_mismatch_in_every_rollout(task, tmp_path):
    """The adapter (B starts at zero) trains and is pushed every rollout: the later rollouts sample with a non-zero
    adapter, the reference pass runs with it disabled."""
    from tests.helpers.lora_helpers import LORA_FLAGS

    out = tmp_path / "run"
    run_train(quickstart_flags(task, out, "--num-rollout", "3", "--num-steps-per-rollout", "2", *LORA_FLAGS,
                               "--use-kl-loss", "--kl-loss-coef", "0.01", "--ref-load", str(task["model"])))
    rows = read_metrics(out)
    assert_exact_zero(rows, 3)
    assert rows[-1]["train/kl_loss"] != 0.0  # the adapter moved the policy away from the reference


@pytest.mark.gpu
def test_bf16_colocated_qwen3_06b_shape_has_zero_mismatch(tmp_path):
    """On one GPU, colocated, bf16, the Qwen3-0.6B shape (benchmarks/gpu_grpo_smoke.py's default run)."""
    result = subprocess.run([sys.executable, str(REPO / "benchmarks/gpu_grpo_smoke.py"), str(tmp_path),
                             "--num-rollout", "2", "--rollout-batch-size", "8", "--max-response-len", "64",
                             "--train-args=--true-on-policy-mode"], cwd=REPO, capture_output=True, text=True,
                            timeout=1800)
    assert result.returncode == 0, result.stderr[-6000:]
    assert_exact_zero(read_metrics(tmp_path / "run"), 2)
