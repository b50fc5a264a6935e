"""What the agent examples' run scripts share: one train.py phase as a child process, the SFT warm-start flags,
the mean of a run's multi-turn metrics and its reward before and after RL. Not a launcher of its own; each example's
run.py says what it runs."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MULTI_TURN_METRICS = {"turns_per_sample": "rollout/turns_per_sample",
                      "tool_calls_per_sample": "rollout/tool_calls_per_sample",
                      "tool_errors_per_sample": "rollout/tool_errors_per_sample", "reward": "rollout/raw_reward"}


def example_parser(description: str, sft_rollouts: int, num_rollout: int, max_turns: int,
                   sft_help: str) -> argparse.ArgumentParser:
    """The flags every example's run.py takes (--out-dir, --sft-rollouts, --num-rollout, --max-turns, --seed)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--sft-rollouts", type=int, default=sft_rollouts, help=sft_help)
    parser.add_argument("--num-rollout", type=int, default=num_rollout, help="GRPO rollouts")
    parser.add_argument("--max-turns", type=int, default=max_turns)
    parser.add_argument("--seed", type=int, default=1)
    return parser


# The GRPO phase under train_async.py --fully-async: decoupled PPO (--use-tis) and tokens at most one version old.
FULLY_ASYNC_FLAGS = ["--fully-async", "--use-tis", "--max-weight-staleness", "1"]


def add_fully_async_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fully-async", action="store_true",
                        help="run the GRPO phase with train_async.py --fully-async (docs/guides/fully-async.md)")


def grpo_script(fully_async: bool) -> tuple[str, list[str]]:
    """The GRPO phase's entry point and its extra flags."""
    return ("train_async.py", FULLY_ASYNC_FLAGS) if fully_async else ("train.py", [])


def run_folder(out_dir: str | None, example: str) -> Path:
    """--out-dir, or runs/<example>-<timestamp> in the repository."""
    return Path(out_dir or REPO_ROOT / "runs" / f"{example}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()


def common_argv(seed: int) -> list[str]:
    """train.py flags both phases share: two CPU trainer processes, the seed, quiet progress."""
    return ["--actor-num-gpus-per-node", "2", "--seed", str(seed), "--micro-batch-size", "8", "--no-progress"]


def run_train(argv: list[str], example: str, phase: str, script: str = "train.py") -> None:
    """`script` (train.py or train_async.py) with `argv`; exits naming the example and phase when it fails."""
    cmd = [sys.executable, str(REPO_ROOT / script), *argv]
    print(f"\n$ {' '.join(cmd)}\n", flush=True)
    result = subprocess.run(cmd, cwd=REPO_ROOT)
    if result.returncode != 0:
        sys.exit(f"{example}: the {phase} run failed (exit {result.returncode}); see the output above")


def sft_argv(model: Path, data: Path, run_dir: Path, *, input_key: str, rollout_function: str, num_rollout: int,
             lr: str, rollout_batch_size: int = 64, global_batch_size: int = 32) -> list[str]:
    """The SFT warm start's flags (checkpoints in run_dir/sft, its run in run_dir/sft_run). The loss is the mean over
    the batch's tokens: slime's default mean per sample would weigh a short answer's tokens above a long one's, and so
    bend the model's first choice (call a tool or answer at once) away from the demonstrations' share."""
    return ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--input-key", input_key,
            "--rollout-function-path", rollout_function, "--loss-type", "sft_loss", "--calculate-per-token-loss",
            "--debug-train-only",
            "--rollout-batch-size", str(rollout_batch_size), "--global-batch-size", str(global_batch_size),
            "--rollout-shuffle", "--num-rollout", str(num_rollout), "--lr", lr, "--lr-warmup-iters", "10",
            "--save", str(run_dir / "sft"), "--output-dir", str(run_dir / "sft_run")]


def metric_rows(metrics_path: Path) -> list[dict]:
    return [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]


def reward_before_after(metrics_path: Path, num_last: int = 3) -> dict:
    """{"reward_before_rl": rollout 0's mean reward (sampled by the SFT policy, before any RL update),
    "reward_after_rl": the mean over the last `num_last` rollouts (fewer in a shorter run)}, printed and returned."""
    rewards = [row[MULTI_TURN_METRICS["reward"]] for row in metric_rows(metrics_path)]
    if len(rewards) < 2:
        sys.exit(f"expected two rollouts or more in {metrics_path} (before and after RL), got {len(rewards)}")
    num_last = min(num_last, len(rewards) - 1)
    before, after = rewards[0], sum(rewards[-num_last:]) / num_last
    print(f"reward per rollout: {' '.join(f'{r:.2f}' for r in rewards)}\n"
          f"reward before RL (rollout 0) {before:.3f} -> after RL (last {num_last} rollouts) {after:.3f}", flush=True)
    return {"reward_before_rl": before, "reward_after_rl": after}


def summarize(metrics_path: Path, metrics: dict[str, str] = MULTI_TURN_METRICS) -> dict:
    """{name: mean over the run's rollouts of its metric key} (None where the key never appears)."""
    rows = metric_rows(metrics_path)
    summary = {}
    for name, key in metrics.items():
        values = [row[key] for row in rows if key in row]
        summary[name] = sum(values) / len(values) if values else None
    return summary
