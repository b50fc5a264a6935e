"""The GRPO loop's overhead as one number: the smoke run of `gpu_grpo_smoke.py` (train.py, colocated on one GPU by
default), then, in the same call, each phase's standalone floor on the same work:

- rollout: the engine alone (Python API: no HTTP, router, rollout function or reward) generating exactly the loop's
  samples of each rollout (its prompt ids, each sample's response length, EOS ignored, same temperature);
- log-prob and train: train.py again with `--debug-train-only` on the loop's own rollouts (saved with
  `--save-debug-rollout-data`): no engine, no weight sync, no memory hand-over;
- the colocated hand-over (`perf/hand_over_to_train_time`: engine release, trainer onload; `update_weights_time`:
  engine resume, weight push, trainer offload) and whatever no phase timer covers: floor 0, pure loop overhead.

Prints each rollout's step time, then, per phase, the loop's median over the steady rollouts (the first
`--warmup-rollouts`, default 1, are warm-up: rollout 0 pays CUDA-graph capture and `--compile-model`'s compile), the
floor's, and their ratio, then `loop step / sum of floors` and the rollout phase's throughput as a fraction of the
engine's; JSON last line.

    python benchmarks/bench_loop.py OUT_DIR                  # one GPU: Qwen3-0.6B shape, 32 x 8 samples x 256
    python benchmarks/bench_loop.py OUT_DIR --shape tiny     # CPU: the quickstart model, a quick check
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu_grpo_smoke import make_parser, read_metrics, train_command  # noqa: E402

TIMED_PHASES = ["perf/rollout_time", "perf/hand_over_to_train_time", "perf/log_prob_time", "perf/actor_train_time",
                "perf/update_weights_time"]

# Inside the phases: the rollout function's and the manager's own timers, and each part of the hand-over.
PHASE_PARTS = ["perf/rollout_first_group_time", "perf/rollout_last_group_time", "perf/rollout_postprocess_time",
               "perf/engine_release_time", "perf/train_onload_time", "perf/engine_resume_weights_time",
               "perf/weight_push_time", "perf/train_offload_time", "perf/engine_resume_kv_time",
               "perf/train_onload_beside_release",  # 1: the onload ran during the engines' release
               "perf/train_data_wait_time"]  # the manager's postprocess beyond the hand-over it runs beside


def engine_floor(model_path: str, rollout_files: list[Path], device: str, temperature: float) -> list[dict]:
    """The engine alone on each rollout's samples: seconds and output tokens per rollout (after one warm-up)."""
    from slime.engine.engine import Engine
    from slime.engine.sampling_params import SamplingParams
    from slime.utils.types import Sample

    rollouts = []
    for path in rollout_files:
        samples = [Sample.from_dict(d) for d in json.loads(path.read_text())["samples"]]
        rollouts.append([(s.tokens[: len(s.tokens) - s.response_length], s.response_length) for s in samples])
    engine = Engine(model_path, device=device, max_num_seqs=max(map(len, rollouts)))
    engine.generate(rollouts[0][0][0], SamplingParams(temperature=temperature, max_new_tokens=4, ignore_eos=True))
    results = []
    for requests in rollouts:
        engine.flush_cache()  # each loop rollout starts cold too: its weights changed, so did its prefix cache
        started = time.perf_counter()
        engine.generate([prompt for prompt, _ in requests],
                        [SamplingParams(temperature=temperature, max_new_tokens=length, ignore_eos=True)
                         for _, length in requests])
        results.append({"seconds": time.perf_counter() - started,
                        "output_tokens": sum(length for _, length in requests)})
    return results


def steady(rows: list[dict], key: str, warmup: int) -> float:
    values = [row[key] for row in rows if row["rollout_id"] >= warmup and row.get(key) is not None]
    return statistics.median(values) if values else float("nan")


def main() -> int:
    parser = make_parser()
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--warmup-rollouts", type=int, default=1,
                        help="rollouts left out of the medians (at least 1: rollout 0 captures and compiles)")
    args = parser.parse_args()
    if not 1 <= args.warmup_rollouts < args.num_rollout:
        raise ValueError(f"--warmup-rollouts {args.warmup_rollouts}: must be at least 1 and below --num-rollout "
                         f"({args.num_rollout}), so some rollout is measured")
    if args.use_async:
        raise ValueError("--async: the loop benchmark measures train.py (its phases add up to a step)")
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    rollouts_dir = out / "rollouts"
    loop_cmd, paths = train_command(args, out / "loop")
    loop_cmd += ["--save-debug-rollout-data", str(rollouts_dir / "rollout_{rollout_id}.json")]
    print(" ".join(loop_cmd), flush=True)
    loop_rc = subprocess.run(loop_cmd, cwd=REPO).returncode
    loop_rows = read_metrics(out / "loop")
    if loop_rc != 0 or not loop_rows:
        print(f"loop run failed (rc {loop_rc})")
        return 1

    warmup = args.warmup_rollouts
    # The loop's own numbers first: a call cut off during the floors' runs still reports them.
    print("step time per rollout (s): " + ", ".join(f"{row['rollout_id']}: {row['perf/step_time']:.3f}"
                                                    for row in loop_rows))
    loop_medians = {key: steady(loop_rows, key, warmup) for key in TIMED_PHASES + PHASE_PARTS + ["perf/step_time"]}
    print("loop medians (s): " + ", ".join(f"{k.removeprefix('perf/')} {v:.3f}" for k, v in loop_medians.items()),
          flush=True)

    train_cmd, _ = train_command(args, out / "train_only")
    train_cmd += ["--debug-train-only", "--load-debug-rollout-data", str(rollouts_dir / "rollout_{rollout_id}.json")]
    train_rc = subprocess.run(train_cmd, cwd=REPO).returncode
    train_rows = read_metrics(out / "train_only")

    on_gpu = args.shape != "tiny"
    steady_ids = [row["rollout_id"] for row in loop_rows if row["rollout_id"] >= warmup]
    engine = engine_floor(str(paths["model"]), [rollouts_dir / f"rollout_{i}.json" for i in steady_ids],
                          "cuda" if on_gpu else "cpu", temperature=1.0)
    engine_seconds = statistics.median(r["seconds"] for r in engine)
    engine_tok_s = statistics.median(r["output_tokens"] / r["seconds"] for r in engine)

    loop = {key: steady(loop_rows, key, warmup)
            for key in TIMED_PHASES + ["perf/step_time", "perf/rollout_tokens_per_sec"]}
    loop["rest of the step (not in a phase timer)"] = loop["perf/step_time"] - sum(loop[key] for key in TIMED_PHASES)

    def train_floor(key: str) -> float:
        return steady(train_rows, key, warmup) if train_rc == 0 else float("nan")

    floors = {"perf/rollout_time": engine_seconds, "perf/hand_over_to_train_time": 0.0,
              "perf/log_prob_time": train_floor("perf/log_prob_time"),
              "perf/actor_train_time": train_floor("perf/actor_train_time"),
              "perf/update_weights_time": 0.0, "rest of the step (not in a phase timer)": 0.0}
    floor_step = sum(floors.values())
    print(f"\n| phase (median of rollouts {steady_ids[0]}-{steady_ids[-1]}) | loop s | floor s | loop / floor |")
    print("|---|---|---|---|")
    for key, floor in floors.items():
        ratio = f"{loop[key] / floor:.2f}" if floor else "overhead"
        print(f"| {key.removeprefix('perf/')} | {loop[key]:.3f} | {floor:.3f} | {ratio} |")
    overhead = loop["perf/step_time"] / floor_step
    rollout_fraction = loop["perf/rollout_tokens_per_sec"] / engine_tok_s
    print(f"| step | {loop['perf/step_time']:.3f} | {floor_step:.3f} | **{overhead:.2f}** |")
    print(f"loop overhead ratio (step / sum of floors): {overhead:.2f}; rollout phase at "
          f"{loop['perf/rollout_tokens_per_sec']:,.0f} tok/s = {rollout_fraction:.1%} of the engine alone "
          f"({engine_tok_s:,.0f} tok/s on the same samples)")
    inside = {key: steady(loop_rows, key, warmup) for key in PHASE_PARTS}
    print("inside the phases (medians, s): " + ", ".join(f"{k.removeprefix('perf/')} {v:.3f}"
                                                              for k, v in inside.items()))
    print(json.dumps({"benchmark": "loop_vs_floors", "phase_parts": inside, "shape": args.shape, "placement": args.placement,
                      "loop": loop, "floors": floors, "floor_step": floor_step, "overhead_ratio": overhead,
                      "engine_floor_tok_s": engine_tok_s, "rollout_fraction_of_engine": rollout_fraction,
                      "engine_floor_runs": engine, "train_only_rc": train_rc, "warmup_rollouts": warmup,
                      "step_time_per_rollout": [row["perf/step_time"] for row in loop_rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
