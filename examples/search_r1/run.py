"""Search-R1 style multi-turn search, end to end on a tiny local model: build the task, start the BM25 retrieval
server on loopback, warm-start the model with SFT through train.py on trajectories that search, then run GRPO
through train.py with the built-in multi-turn rollout (`<search>` calls answered inline by `<information>`).

    python examples/search_r1/run.py [--out-dir runs/search_r1] [--num-rollout 12]
    python examples/search_r1/run.py --fully-async   # GRPO through train_async.py --fully-async

It prints the reward before RL (rollout 0, the warm-started policy's) and after (the mean of the last three
rollouts). The last stdout line is JSON: {"reward_before_rl", "reward_after_rl", "turns_per_sample",
"tool_calls_per_sample", "tool_errors_per_sample", "reward" (those four the means over the GRPO rollouts), "run_dir"}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.run_steps import (
    REPO_ROOT,
    add_fully_async_option,
    common_argv,
    example_parser,
    grpo_script,
    reward_before_after,
    run_folder,
    run_train,
    sft_argv,
    summarize,
)
from examples.search_r1.search_tool import URL_ENV
from examples.search_r1.task import build_task
from slime.utils.checkpoint_state import latest_checkpoint

SERVER_START_TIMEOUT_S = 60
TOOL = "examples.search_r1.search_tool.search"


def start_retrieval_server(corpus: Path, run_dir: Path) -> tuple[subprocess.Popen, str]:
    ready_file = run_dir / "retrieval_server.json"
    ready_file.unlink(missing_ok=True)
    log = open(run_dir / "retrieval_server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "examples.search_r1.retrieval_server", "--corpus", str(corpus),
                               "--port", "0", "--ready-file", str(ready_file)], cwd=REPO_ROOT, stdout=log,
                              stderr=subprocess.STDOUT)
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while not ready_file.exists():
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            sys.exit(f"search_r1: the retrieval server did not start; see {run_dir / 'retrieval_server.log'}")
        time.sleep(0.1)
    return server, json.loads(ready_file.read_text())["url"]


def main() -> None:
    parser = example_parser(__doc__, sft_rollouts=80, num_rollout=12, max_turns=3,
                            sft_help="SFT rollouts (2 optimizer steps each)")
    parser.add_argument("--grpo-lr", type=float, default=2e-4)
    add_fully_async_option(parser)
    opts = parser.parse_args()

    run_dir = run_folder(opts.out_dir, "search_r1")
    paths = build_task(run_dir / "task", seed=opts.seed)
    server, url = start_retrieval_server(paths["corpus"], run_dir)
    os.environ[URL_ENV] = url  # inherited by train.py, its local Ray cluster and the rollout's tool calls
    print(f"search_r1: retrieval server at {url}", flush=True)
    common = common_argv(opts.seed)
    try:
        run_train(common + sft_argv(paths["model"], paths["sft"], run_dir, input_key="prompt",
                                    rollout_function="examples.search_r1.inline_sft_rollout.generate_rollout",
                                    num_rollout=opts.sft_rollouts, lr="3e-3"), "search_r1", "SFT")
        grpo_dir = run_dir / "grpo_run"
        script, mode_flags = grpo_script(opts.fully_async)
        run_train(common + mode_flags + [
            "--hf-checkpoint", str(latest_checkpoint(run_dir / "sft")), "--prompt-data", str(paths["train"]),
            "--input-key", "prompt", "--label-key", "label", "--rollout-shuffle",
            "--max-turns", str(opts.max_turns), "--tool-functions-path", TOOL, "--tool-call-parser", "xml_tags",
            "--tool-timeout", "5",
            "--custom-rm-path", "examples.search_r1.reward.exact_match",
            "--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--num-rollout", str(opts.num_rollout),
            "--rollout-max-response-len", "96", "--rollout-temperature", "0.6", "--global-batch-size", "128",
            "--lr", str(opts.grpo_lr), "--output-dir", str(grpo_dir),
            "--save-debug-rollout-data", str(grpo_dir / "rollout_{rollout_id}.json"),
        ], "search_r1", "GRPO", script)
    finally:
        server.terminate()
        server.wait(timeout=10)
    print(json.dumps({**reward_before_after(grpo_dir / "metrics.jsonl"), **summarize(grpo_dir / "metrics.jsonl"),
                      "run_dir": str(run_dir)}))


if __name__ == "__main__":
    main()
