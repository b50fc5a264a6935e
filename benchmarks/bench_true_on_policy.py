"""What --true-on-policy-mode costs and changes, each part measured with and without the mode in the same run:

    python benchmarks/bench_true_on_policy.py engine            # engine output tok/s (the quickstart's model, CPU)
    python benchmarks/bench_true_on_policy.py step OUT_DIR      # a GRPO step through train.py (gpu_grpo_smoke.py)
    python benchmarks/bench_true_on_policy.py curve OUT_DIR     # the quickstart's held-out accuracy, TIS off
    python benchmarks/bench_true_on_policy.py engine --shape qwen3-0.6b --dtype bfloat16   # on a GPU

Each part prints a table (baseline, mode, ratio) and a JSON last line. The mode's contract (exactly 0.0 train/rollout
mismatch) is checked by tests, not here; the step and curve parts report the mismatch they saw.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu_grpo_smoke import SHAPES  # noqa: E402


def engine_tokens_per_second(model: str, true_on_policy: bool, num_prompts: int, prompt_len: int, new_tokens: int,
                             dtype: str, device: str) -> float:
    from slime.engine.engine import Engine

    engine = Engine(model, device=device, dtype=dtype, true_on_policy=true_on_policy)
    prompts = [[(7 * i + 3 * j) % 200 + 10 for j in range(prompt_len)] for i in range(num_prompts)]
    params = [{"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True, "sampling_seed": i}
              for i in range(num_prompts)]
    engine.generate(prompts[:2], params[:2])  # warm-up
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    engine.shutdown()
    return sum(len(o["output_ids"]) for o in outputs) / elapsed


def engine_part(opts) -> dict:
    import examples.quickstart.task as task_mod

    with tempfile.TemporaryDirectory() as folder:
        task_mod.MODEL_SHAPE = SHAPES[opts.shape]
        model = str(task_mod.build_task(Path(folder))["model"])
        import torch

        threads = torch.get_num_threads()
        results = {}
        # On the CPU the mode runs single-threaded (contract.pin_cpu_threads): the baseline is measured both with
        # torch's default threads and with one thread, so the ratio is not the thread count's.
        for name, mode, num_threads in (("baseline", False, threads), ("baseline_1_thread", False, 1),
                                        ("true_on_policy", True, 1)):
            torch.set_num_threads(num_threads)
            results[name] = engine_tokens_per_second(model, mode, opts.num_prompts, opts.prompt_len, opts.new_tokens,
                                                     opts.dtype, opts.device)
        torch.set_num_threads(threads)
    summary = {"part": "engine", "shape": opts.shape, "default_threads": threads, **results}
    for name in ("baseline", "baseline_1_thread"):
        summary[f"ratio_vs_{name}"] = results["true_on_policy"] / results[name]
    print(f"engine output tok/s ({opts.shape}, {opts.num_prompts} prompts x {opts.prompt_len} in, {opts.new_tokens} "
          f"out, {opts.dtype} on {opts.device}): " + " | ".join(f"{k} {v:,.1f}" for k, v in results.items())
          + f" | mode / baseline {summary['ratio_vs_baseline']:.3f}, / baseline 1 thread "
          f"{summary['ratio_vs_baseline_1_thread']:.3f}")
    return summary


def run_smoke(out: Path, opts, extra: str) -> list[dict]:
    cmd = [sys.executable, str(REPO / "benchmarks/gpu_grpo_smoke.py"), str(out), "--shape", opts.shape,
           "--num-rollout", str(opts.num_rollout), "--rollout-batch-size", str(opts.rollout_batch_size),
           "--n-samples-per-prompt", str(opts.n_samples_per_prompt), "--max-response-len", str(opts.max_response_len),
           "--task-dir", str(out.parent / "task"), f"--train-args={extra}"]
    subprocess.run(cmd, cwd=REPO, check=True)
    return [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]


def step_part(opts) -> dict:
    keys = ["perf/step_time", "perf/rollout_time", "perf/log_prob_time", "perf/actor_train_time"]
    runs = {name: run_smoke(opts.out_dir / name, opts, extra)
            for name, extra in (("baseline", ""), ("true_on_policy", "--true-on-policy-mode"))}
    summary = {"part": "step", "shape": opts.shape}
    for key in keys:
        # rollout 0 includes warm-up
        values = {name: statistics.median(r[key] for r in rows[1:]) for name, rows in runs.items()}
        summary[key] = values | {"ratio": values["true_on_policy"] / values["baseline"]}
        print(f"{key}: baseline {values['baseline']:.3f} s | true-on-policy {values['true_on_policy']:.3f} s | "
              f"ratio {summary[key]['ratio']:.3f}")
    summary["mismatch"] = {name: [r["train/train_rollout_logprob_abs_diff"] for r in rows] for name, rows in runs.items()}
    print("train/rollout mismatch per rollout:", summary["mismatch"])
    return summary


def curve_part(opts) -> dict:
    series = {}
    for name, extra in (("baseline", []), ("true_on_policy", ["--true-on-policy-mode"])):
        out = opts.out_dir / name
        cmd = [sys.executable, str(REPO / "examples/quickstart/run.py"), "--out-dir", str(out), "--num-rollout",
               str(opts.num_rollout), "--seed", str(opts.seed), *extra]
        start = time.perf_counter()
        subprocess.run(cmd, cwd=REPO, check=True)
        rows = [json.loads(line) for line in (out / "grpo_run" / "metrics.jsonl").read_text().splitlines()]
        series[name] = {"eval": [(r["rollout_id"], r["eval/arith"]) for r in rows if "eval/arith" in r],
                        "reward": [r["rollout/raw_reward"] for r in rows],
                        "mismatch": [r["train/train_rollout_logprob_abs_diff"] for r in rows],
                        "wall_s": time.perf_counter() - start}
        print(f"{name}: eval {series[name]['eval']}, max mismatch {max(series[name]['mismatch']):.3g}, "
              f"{series[name]['wall_s']:.0f} s")
    return {"part": "curve", **series}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=["engine", "step", "curve"])
    parser.add_argument("out_dir", type=Path, nargs="?", default=Path("/tmp/bench_true_on_policy"))
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--num-rollout", type=int, default=4)
    parser.add_argument("--rollout-batch-size", type=int, default=8)
    parser.add_argument("--n-samples-per-prompt", type=int, default=8)
    parser.add_argument("--max-response-len", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    opts = parser.parse_args()
    summary = {"engine": engine_part, "step": step_part, "curve": curve_part}[opts.part](opts)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
