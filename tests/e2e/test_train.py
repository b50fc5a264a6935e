"""train.py end to end on the CPU: real Ray, the built-in engine behind the real sglang-router, two FSDP2 trainer
processes, rewards, eval, checkpoints, and a resumed run that continues exactly where the first one stopped."""

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


def run_train(argv, timeout=600):
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *argv], cwd=REPO, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, f"train.py failed:\nSTDOUT:\n{result.stdout[-4000:]}\nSTDERR:\n{result.stderr[-6000:]}"
    return result


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_grpo_run(task, tmp_path):
    out = tmp_path / "run"
    run_train([
        "--hf-checkpoint", str(task["model"]), "--ref-load", str(task["model"]),
        "--prompt-data", str(task["train"]), "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--rm-type", "math", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--num-rollout", "2", "--rollout-max-response-len", "8", "--actor-num-gpus-per-node", "2",
        "--use-kl-loss", "--kl-loss-coef", "0.01", "--lr", "1e-3", "--eval-prompt-data", "arith", str(task["eval"]),
        "--eval-interval", "2", "--eval-max-response-len", "8", "--save", str(tmp_path / "ckpt"),
        "--use-tensorboard", "--output-dir", str(out), "--no-progress", "--dump-details", str(tmp_path / "dump"),
    ])
    rows = read_metrics(out)
    assert [r["rollout_id"] for r in rows] == [0, 1]
    for row in rows:
        for key in ("rollout/raw_reward", "train/loss", "train/kl_loss", "train/grad_norm", "perf/rollout_time",
                    "perf/train_time", "perf/update_weights_time", "perf/weight_push_time", "perf/weight_push_gb",
                    "perf/log_prob_time", "perf/actor_train_time", "train/train_rollout_logprob_abs_diff",
                    "rollout/prefix_cache_hit_rate"):  # returned by the rollout function with its samples
            assert key in row, (key, sorted(row))
        assert not {"seconds", "bytes", "num_buckets"} & set(row)  # every metric carries its prefix
        # the rollout's inner timers: groups come back inside the rollout phase, postprocess after it
        assert 0 < row["perf/rollout_first_group_time"] <= row["perf/rollout_last_group_time"] <= row["perf/rollout_time"]
        assert row["perf/rollout_postprocess_time"] > 0
        # the engine's log-probs and the trainer's of the same tokens agree (same weights after every sync)
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-3
    assert rows[0]["train/kl_loss"] == 0.0  # first step: policy == reference exactly
    assert "eval/arith" in rows[0] and "eval/arith" in rows[1]
    assert (out / "curves.png").is_file() and any((out / "tensorboard").iterdir())
    # The run's own engine admin key: sent by the trainer and rollout (the run worked), never written in clear.
    assert json.loads((out / "args.json").read_text())["sglang_admin_api_key"] == "<redacted>"
    assert (out / "engine_0.json").stat().st_mode & 0o777 == 0o600

    from transformers import AutoModelForCausalLM

    from slime.utils.checkpoint_state import latest_checkpoint

    model = AutoModelForCausalLM.from_pretrained(latest_checkpoint(tmp_path / "ckpt"))
    assert model.config.num_hidden_layers == 4
    _check_dump_details(tmp_path / "dump")


def _check_dump_details(dump: Path) -> None:
    """slime's --dump-details: each rollout's samples, and its train data gathered from both data-parallel ranks
    with the trainer's log-probs, in the same sample order."""
    import torch

    for rollout_id in (0, 1):
        rollout = torch.load(dump / "rollout_data" / f"{rollout_id}.pt", weights_only=True)
        train = torch.load(dump / "train_data" / f"{rollout_id}.pt", weights_only=True)
        assert train["rollout_id"] == rollout["rollout_id"] == rollout_id
        assert sorted({s["data_parallel_rank"] for s in train["samples"]}) == [0, 1]
        by_index = {s["index"]: s for s in rollout["samples"]}
        assert sorted(s["sample_index"] for s in train["samples"]) == sorted(by_index)
        for sample in train["samples"]:
            assert sample["tokens"] == by_index[sample["sample_index"]]["tokens"]
            assert sample["ref_log_probs"].shape == (sample["response_lengths"],)


def sft_argv(task, out: Path, num_rollout: int, save: Path, *extra):
    return ["--hf-checkpoint", str(task["model"]), "--prompt-data", str(task["sft"]), "--input-key", "messages",
            "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout", "--loss-type", "sft_loss",
            "--debug-train-only", "--rollout-batch-size", "8", "--rollout-shuffle", "--num-rollout", str(num_rollout),
            "--lr", "1e-3", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--actor-num-gpus-per-node", "2",
            "--save", str(save), "--save-interval", "1", "--output-dir", str(out), "--no-progress",
            "--save-debug-rollout-data", str(out / "rollout_{rollout_id}.json"), *extra]


def test_resume_continues_exactly(task, tmp_path):
    run_train(sft_argv(task, tmp_path / "full", 3, tmp_path / "ckpt_full"))
    run_train(sft_argv(task, tmp_path / "part1", 2, tmp_path / "ckpt_part"))
    run_train(sft_argv(task, tmp_path / "part2", 3, tmp_path / "ckpt_part", "--load", str(tmp_path / "ckpt_part")))
    full, resumed = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "part2")
    assert [r["rollout_id"] for r in resumed] == [2]  # the resumed run starts at the next rollout id
    dump = lambda run: json.loads((tmp_path / run / "rollout_2.json").read_text())["samples"]
    assert [s["tokens"] for s in dump("full")] == [s["tokens"] for s in dump("part2")]  # same data order
    assert resumed[0]["train/loss"] == pytest.approx(full[2]["train/loss"], rel=1e-5)
    assert resumed[0]["train/grad_norm"] == pytest.approx(full[2]["train/grad_norm"], rel=1e-4)
