"""ReTool style tool-integrated math, end to end on a tiny local model: build the task, warm-start the model with
SFT through train.py on conversations that call a sandboxed Python interpreter, then run GRPO through train.py with
the built-in multi-turn rollout (qwen `<tool_call>` format; each call runs in `sandbox.py`).

    python examples/retool/run.py [--out-dir runs/retool] [--num-rollout 12]

It prints the reward before RL (rollout 0, the warm-started policy's) and after (the mean of the last three
rollouts). The last stdout line is JSON: {"reward_before_rl", "reward_after_rl", "turns_per_sample",
"tool_calls_per_sample", "tool_errors_per_sample", "reward" (those four the means over the GRPO rollouts), "run_dir"}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.retool.task import build_task
from examples.run_steps import (
    common_argv,
    example_parser,
    reward_before_after,
    run_folder,
    run_train,
    sft_argv,
    summarize,
)
from slime.utils.checkpoint_state import latest_checkpoint

TOOL = "examples.retool.python_tool.python"


def main() -> None:
    parser = example_parser(__doc__, sft_rollouts=40, num_rollout=12, max_turns=3,
                            sft_help="SFT rollouts (2 optimizer steps each)")
    parser.add_argument("--grpo-lr", type=float, default=2e-4)
    opts = parser.parse_args()

    run_dir = run_folder(opts.out_dir, "retool")
    paths = build_task(run_dir / "task", seed=opts.seed)
    common = common_argv(opts.seed)
    run_train(common + sft_argv(paths["model"], paths["sft"], run_dir, input_key="messages",
                                rollout_function="slime.rollout.sft_rollout.generate_rollout",
                                num_rollout=opts.sft_rollouts, lr="3e-3"), "retool", "SFT")
    grpo_dir = run_dir / "grpo_run"
    run_train(common + [
        "--hf-checkpoint", str(latest_checkpoint(run_dir / "sft")), "--prompt-data", str(paths["train"]),
        "--input-key", "prompt", "--label-key", "label", "--rollout-shuffle",
        "--max-turns", str(opts.max_turns), "--tool-functions-path", TOOL, "--tool-call-parser", "qwen",
        "--tool-timeout", "20", "--custom-rm-path", "examples.retool.reward.boxed_answer",
        "--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--num-rollout", str(opts.num_rollout),
        "--rollout-max-response-len", "128", "--rollout-temperature", "0.6", "--global-batch-size", "128",
        "--lr", str(opts.grpo_lr), "--output-dir", str(grpo_dir),
        "--save-debug-rollout-data", str(grpo_dir / "rollout_{rollout_id}.json"),
    ], "retool", "GRPO")
    print(json.dumps({**reward_before_after(grpo_dir / "metrics.jsonl"), **summarize(grpo_dir / "metrics.jsonl"),
                      "run_dir": str(run_dir)}))


if __name__ == "__main__":
    main()
