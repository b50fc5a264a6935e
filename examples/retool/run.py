"""ReTool style tool-integrated math, end to end on a tiny local model: build the task, warm-start the model with
SFT through train.py on conversations that call a sandboxed Python interpreter, then run GRPO through train.py with
the built-in multi-turn rollout (qwen `<tool_call>` format; each call runs in `sandbox.py`).

    python examples/retool/run.py [--out-dir runs/retool] [--num-rollout 3]

The last stdout line is JSON: {"turns_per_sample", "tool_calls_per_sample", "tool_errors_per_sample", "reward",
"run_dir"}, each the mean over the GRPO rollouts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.retool.task import build_task  # noqa: E402
from examples.run_steps import REPO_ROOT, run_train, sft_argv, summarize  # noqa: E402
from slime.utils.checkpoint_state import latest_checkpoint  # noqa: E402

TOOL = "examples.retool.python_tool.python"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--sft-rollouts", type=int, default=24, help="SFT rollouts (2 optimizer steps each)")
    parser.add_argument("--num-rollout", type=int, default=3, help="GRPO rollouts")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    opts = parser.parse_args()

    run_dir = Path(opts.out_dir or REPO_ROOT / "runs" / f"retool-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    paths = build_task(run_dir / "task", seed=opts.seed)
    common = ["--actor-num-gpus-per-node", "2", "--seed", str(opts.seed), "--micro-batch-size", "8", "--no-progress"]
    run_train(common + sft_argv(paths["model"], paths["sft"], run_dir, input_key="messages",
                                rollout_function="slime.rollout.sft_rollout.generate_rollout",
                                num_rollout=opts.sft_rollouts, lr="3e-3"), "retool", "SFT")
    grpo_dir = run_dir / "grpo_run"
    run_train(common + [
        "--hf-checkpoint", str(latest_checkpoint(run_dir / "sft")), "--prompt-data", str(paths["train"]),
        "--input-key", "prompt", "--label-key", "label", "--rollout-shuffle",
        "--max-turns", str(opts.max_turns), "--tool-functions-path", TOOL, "--tool-call-parser", "qwen",
        "--tool-timeout", "20", "--custom-rm-path", "examples.retool.reward.boxed_answer",
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--num-rollout", str(opts.num_rollout),
        "--rollout-max-response-len", "128", "--rollout-temperature", "1.0", "--global-batch-size", "32",
        "--lr", "1e-4", "--output-dir", str(grpo_dir),
        "--save-debug-rollout-data", str(grpo_dir / "rollout_{rollout_id}.json"),
    ], "retool", "GRPO")
    print(json.dumps({**summarize(grpo_dir / "metrics.jsonl"), "run_dir": str(run_dir)}))


if __name__ == "__main__":
    main()
