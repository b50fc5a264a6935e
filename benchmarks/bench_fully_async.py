"""Samples per second of synchronous (train.py), one-step-off (train_async.py) and fully async
(train_async.py --fully-async) training on the same task, with long-tailed response lengths
(benchmarks/long_tail_generate.py: Pareto, a few responses 30x the median), in one call, plus the trainer's and the
engines' idle fractions. Engine and trainer on their own devices (disaggregated), so the modes differ only in where
they wait.

    python benchmarks/bench_fully_async.py OUT_DIR --shape tiny                  # CPU: the quickstart model
    python benchmarks/bench_fully_async.py OUT_DIR --shape tiny-4k --rollout-batch-size 4 \
        --max-response-len 2048                                                  # CPU, generation-bound
    python benchmarks/bench_fully_async.py OUT_DIR                               # two GPUs: Qwen3-0.6B shape

Per mode, over the steady rollouts (the first `--warmup-rollouts` are dropped): samples/s = trained samples / the
sum of `perf/step_time`; trainer idle = 1 - `perf/train_time` / step time; engine idle = the share of the step with
no request on the engines (fully async: measured by the stream, `perf/engine_idle_fraction`; the other modes:
1 - `perf/rollout_time` / step time, generation being one block there). Prints a table and the ratios against
synchronous; JSON last line.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu_grpo_smoke import make_parser, read_metrics, train_command  # noqa: E402

MODES = {
    "sync": (False, []),
    "one_step_off": (True, []),
    "fully_async": (True, ["--fully-async", "--use-tis"]),
}


def mode_summary(rows: list[dict], mode: str, num_samples: int, warmup: int) -> dict:
    steady = [r for r in rows if r["rollout_id"] >= warmup]
    if not steady:
        return {"mode": mode, "error": "no steady rollout"}
    step_time = sum(r["perf/step_time"] for r in steady)
    trainer_idle = [1 - r["perf/train_time"] / r["perf/step_time"] for r in steady]
    if mode == "fully_async":
        engine_idle = [r["perf/engine_idle_fraction"] for r in steady]
    else:
        engine_idle = [max(0.0, 1 - r["perf/rollout_time"] / r["perf/step_time"]) for r in steady]
    summary = {"mode": mode, "num_steady_rollouts": len(steady), "samples_per_s": num_samples * len(steady) / step_time,
               "step_time_median_s": statistics.median(r["perf/step_time"] for r in steady),
               "trainer_idle_fraction": statistics.mean(trainer_idle),
               "engine_idle_fraction": statistics.mean(engine_idle)}
    if mode == "fully_async":
        summary["staleness_max"] = max(r["rollout/staleness_max"] for r in steady)
        summary["staleness_mean"] = statistics.mean(r["rollout/staleness_mean"] for r in steady)
    return summary


def main() -> int:
    parser = make_parser()
    parser.set_defaults(placement="disaggregated", num_rollout=8, rollout_batch_size=16, n_samples_per_prompt=4,
                        max_response_len=512)
    parser.add_argument("--max-weight-staleness", type=int, default=2)
    parser.add_argument("--warmup-rollouts", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    base_train_args = args.train_args
    results = []
    for mode in args.modes.split(","):
        use_async, flags = MODES[mode]
        if mode == "fully_async":
            flags = [*flags, "--max-weight-staleness", str(args.max_weight_staleness)]
        args.use_async = use_async
        args.train_args = " ".join([base_train_args, "--custom-generate-function-path",
                                    "benchmarks.long_tail_generate.generate", *flags])
        if args.task_dir is None:
            args.task_dir = args.out_dir / "task"  # built once, shared by the modes
        run_dir = args.out_dir / mode
        cmd, _ = train_command(args, run_dir)
        print(f"\n[{mode}] {' '.join(cmd)}", flush=True)
        started = time.perf_counter()
        rc = subprocess.run(cmd, cwd=REPO).returncode
        rows = read_metrics(run_dir)
        summary = mode_summary(rows, mode, args.rollout_batch_size * args.n_samples_per_prompt, args.warmup_rollouts)
        summary.update(rc=rc, wall_s=time.perf_counter() - started)
        results.append(summary)
    base = next((r for r in results if r["mode"] == "sync" and "samples_per_s" in r), None)
    print("\nmode | samples/s | vs sync | step median s | trainer idle | engine idle | staleness max/mean")
    for r in results:
        if "samples_per_s" not in r:
            print(f"{r['mode']} | {r.get('error')} (rc {r['rc']})")
            continue
        ratio = r["samples_per_s"] / base["samples_per_s"] if base else float("nan")
        stale = f"{r['staleness_max']} / {r['staleness_mean']:.2f}" if "staleness_max" in r else "-"
        print(f"{r['mode']} | {r['samples_per_s']:.3f} | {ratio:.2f}x | {r['step_time_median_s']:.2f} | "
              f"{r['trainer_idle_fraction']:.2f} | {r['engine_idle_fraction']:.2f} | {stale}")
    import json

    print(json.dumps({"shape": args.shape, "placement": args.placement, "batch": [args.rollout_batch_size,
                      args.n_samples_per_prompt], "max_response_len": args.max_response_len, "results": results}))
    return 0 if all(r.get("rc") == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
