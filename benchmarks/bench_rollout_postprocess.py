"""The rollout manager's postprocess (`RolloutManager.generate` after the samples are back) on one rollout's worth of
recorded-shape Samples, part by part: `samples_to_train_data`, `rollout_metrics`, `split_train_data`, one
`ray.put` per data-parallel rank, and the `--save-debug-rollout-data` dump as the step waits for it (the
background writer's copy of the samples) against writing it on the spot (`save_samples`, in the same run, with
the ratio). Also `Sample.to_dict` against the deep copy it replaces.

    python benchmarks/bench_rollout_postprocess.py      # 256 samples x 256 prompt x 512 response tokens, GRPO

Prints a table (milliseconds per rollout, median of --repeats, the two dump paths alternated) and a JSON last line.
No engine, no HTTP: bench_rollout_io.py has the response path, bench_loop.py the whole rollout phase.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray

from slime.ray.train_data import assign_rollout_ids, rollout_metrics, samples_to_train_data, split_train_data
from slime.utils.debug_dump import BackgroundDumpWriter, save_samples
from slime.utils.types import Sample

VOCAB_SIZE = 151_936


def recorded_samples(num_samples: int, group_size: int, prompt_len: int, response_len: int, seed: int) -> list[Sample]:
    """Finished GRPO samples shaped like the loop's: random token ids, per-token log-probs, 0 / 1 rewards."""
    rng = random.Random(seed)
    samples = []
    for index in range(num_samples):
        tokens = [rng.randrange(VOCAB_SIZE) for _ in range(prompt_len + response_len)]
        samples.append(Sample(group_index=index // group_size, index=index, prompt="w " * prompt_len, tokens=tokens,
                              response="w " * response_len, response_length=response_len, label="3",
                              reward=float(rng.random() < 0.3), weight_versions=["1"],
                              rollout_log_probs=[-rng.expovariate(1.0) for _ in range(response_len)],
                              status=Sample.Status.TRUNCATED))
    assign_rollout_ids(samples)
    return samples


def train_args(data_parallel_size: int) -> SimpleNamespace:
    """The flags the postprocess reads, at their defaults (GRPO with std normalisation, no custom hooks)."""
    return SimpleNamespace(custom_reward_post_process_path=None, custom_convert_samples_to_train_data_path=None,
                           advantage_estimator="grpo", rewards_normalization=True, grpo_std_normalization=True,
                           reward_key=None, eval_reward_key=None, data_parallel_size=data_parallel_size,
                           num_steps_per_rollout=1, balance_data=False, balance_by_flops=False,
                           tensor_model_parallel_size=1, context_parallel_size=1, log_passrate=False,
                           log_reward_category=None, log_correct_samples=False)


def median_ms(fn, repeats: int, after=None) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
        if after is not None:
            after()
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-samples", type=int, default=256)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=512)
    parser.add_argument("--data-parallel-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    samples = recorded_samples(opts.num_samples, opts.group_size, opts.prompt_len, opts.response_len, opts.seed)
    args = train_args(opts.data_parallel_size)
    data = samples_to_train_data(args, samples)
    per_rank, _ = split_train_data(args, data, 0)
    writer = BackgroundDumpWriter()
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_rollout_postprocess_") as tmp:
        dump = Path(tmp) / "0.pt"
        parts = {
            "samples_to_train_data": {"same": lambda: samples_to_train_data(args, samples)},
            "rollout_metrics": {"same": lambda: rollout_metrics(args, samples, data["raw_reward"])},
            "split_train_data": {"same": lambda: split_train_data(args, data, 0)},
            "ray.put per rank": {"same": lambda: [ray.put(rank_data) for rank_data in per_rank]},
            "Sample.to_dict": {"deepcopy": lambda: [copy.deepcopy(s.__dict__) for s in samples],
                               "list copies": lambda: [s.to_dict() for s in samples]},
            "debug dump (waited for)": {"save_samples": lambda: save_samples(dump, 0, samples),
                                        "background": lambda: writer.save(dump, 0, samples)},
        }
        for part, paths in parts.items():
            timings = {path: [] for path in paths}
            for _ in range(3):  # alternated, so that load from other processes falls on both alike
                for path, fn in paths.items():
                    timings[path].append(median_ms(fn, opts.repeats, after=writer.flush))
            results[part] = {path: round(statistics.median(values), 2) for path, values in timings.items()}
    ray.shutdown()
    print(f"rollout postprocess, {opts.num_samples} samples x {opts.prompt_len} prompt x {opts.response_len} response "
          f"tokens, {opts.data_parallel_size} data-parallel rank(s) (milliseconds per rollout, median)")
    print(f"{'part':26s} {'before':>10s} {'after':>10s} {'ratio':>7s}   (before / after: two paths, or the same code)")
    total_before = total_after = 0.0
    for part, timing in results.items():
        before, after = list(timing.values())[0], list(timing.values())[-1]
        if part != "Sample.to_dict":  # inside the dump's time
            total_before, total_after = total_before + before, total_after + after
        ratio = f"{before / after:.1f}x" if len(timing) > 1 else ""
        print(f"{part:26s} {before:10.2f} {after:10.2f} {ratio:>7s}")
    print(f"{'total on the step':26s} {total_before:10.2f} {total_after:10.2f} {total_before / total_after:6.1f}x")
    print(json.dumps({"benchmark": "rollout_postprocess", "num_samples": opts.num_samples,
                      "prompt_len": opts.prompt_len, "response_len": opts.response_len,
                      "data_parallel_size": opts.data_parallel_size, "ms_per_rollout": results,
                      "total_ms_before": round(total_before, 2), "total_ms_after": round(total_after, 2),
                      "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}))


if __name__ == "__main__":
    main()
