"""An agent written against the official `openai` client, trained by slime, end to end on a tiny local model: build
the weather task, warm-start the model with SFT through train.py on conversations that call `get_weather` (qwen
`<tool_call>` format, role "tool" results, loss on the assistant turns only), then run GRPO through train.py with
`--custom-generate-function-path examples.openai_agent.generate.generate`: every episode is agent.py's tool loop
talking to slime's OpenAIAdapter through `openai.AsyncOpenAI`.

    python examples/openai_agent/run.py [--out-dir runs/openai_agent] [--sft-rollouts 30] [--num-rollout 12]

GRPO samples at --temperature 0.6: at 1.0 more and more of the tool calls came out as broken JSON as RL went on, and
the reward barely rose (README).

It prints the reward before RL (rollout 0, the warm-started policy's) and after (the mean of the last three
rollouts). The last stdout line is JSON with those two ("reward_before_rl", "reward_after_rl") and the GRPO rollouts'
means: turns and tool calls per Sample, tool errors, reward
(first and last rollout too), the trainer's vs the engine's log-probs on the trained tokens, Samples per episode
(> 1 when a history re-rendered differently forked a sibling), and per Sample the response tokens trained (the
model's own) and masked out (template and tool results); "run_dir".
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.openai_agent.task import build_task
from examples.run_steps import (
    MULTI_TURN_METRICS,
    common_argv,
    example_parser,
    metric_rows,
    reward_before_after,
    run_folder,
    run_train,
    sft_argv,
)
from examples.run_steps import summarize as summarize_metrics
from slime.utils.checkpoint_state import latest_checkpoint

GENERATE = "examples.openai_agent.generate.generate"
REWARD = "examples.openai_agent.reward.final_answer_reward"
METRICS = {**MULTI_TURN_METRICS, "train_rollout_logprob_abs_diff": "train/train_rollout_logprob_abs_diff"}


def summarize(grpo_dir: Path) -> dict:
    """Means over the GRPO rollouts of metrics.jsonl's multi-turn metrics and of the rollout dumps' token counts."""
    rows = metric_rows(grpo_dir / "metrics.jsonl")
    if not rows:
        sys.exit(f"openai_agent: no rollout metrics in {grpo_dir / 'metrics.jsonl'}")
    summary = summarize_metrics(grpo_dir / "metrics.jsonl", METRICS)
    summary["reward_first_rollout"], summary["reward_last_rollout"] = (rows[0][METRICS["reward"]],
                                                                       rows[-1][METRICS["reward"]])
    samples = [s for path in sorted(grpo_dir.glob("rollout_*.json"))
               for s in json.loads(path.read_text())["samples"]]
    episodes = {(s["index"], s["session_id"]) for s in samples}
    summary["samples_per_episode"] = len(samples) / len(episodes)
    summary["trained_tokens_per_sample"] = statistics.fmean(sum(s["loss_mask"]) for s in samples)
    summary["masked_tokens_per_sample"] = statistics.fmean(len(s["loss_mask"]) - sum(s["loss_mask"])
                                                           for s in samples)
    return summary


def main() -> None:
    parser = example_parser(__doc__, sft_rollouts=30, num_rollout=12, max_turns=3,
                            sft_help="SFT rollouts (4 optimizer steps each)")
    parser.add_argument("--grpo-lr", type=float, default=2e-4)
    parser.add_argument("--temperature", type=float, default=0.6, help="GRPO sampling temperature")
    opts = parser.parse_args()

    run_dir = run_folder(opts.out_dir, "openai_agent")
    paths = build_task(run_dir / "task", seed=opts.seed)
    common = common_argv(opts.seed)
    run_train(common + sft_argv(paths["model"], paths["sft"], run_dir, input_key="messages",
                                rollout_function="slime.rollout.sft_rollout.generate_rollout",
                                num_rollout=opts.sft_rollouts, lr="1e-3", global_batch_size=16),
              "openai_agent", "SFT")
    grpo_dir = run_dir / "grpo_run"
    run_train(common + [
        "--hf-checkpoint", str(latest_checkpoint(run_dir / "sft")), "--prompt-data", str(paths["train"]),
        "--input-key", "prompt", "--label-key", "label", "--rollout-shuffle",
        "--custom-generate-function-path", GENERATE, "--max-turns", str(opts.max_turns), "--tool-call-parser", "qwen",
        "--router-policy", "manual", "--custom-rm-path", REWARD,
        "--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--num-rollout", str(opts.num_rollout),
        "--rollout-max-response-len", "48", "--rollout-temperature", str(opts.temperature),
        "--global-batch-size", "128",
        "--lr", str(opts.grpo_lr), "--output-dir", str(grpo_dir),
        "--save-debug-rollout-data", str(grpo_dir / "rollout_{rollout_id}.json"),
    ], "openai_agent", "GRPO")
    print(json.dumps({**reward_before_after(grpo_dir / "metrics.jsonl"), **summarize(grpo_dir),
                      "run_dir": str(run_dir)}))


if __name__ == "__main__":
    main()
