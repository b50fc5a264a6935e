"""Where a decode step's time goes: the engine on W1 (Qwen3-0.6B shape, 256 x 256 in, --output-len out), once with
the plain step loop and once with overlapped scheduling. For each: prefill time, decode wall time per step, and,
from a torch profiler trace of 16 decode steps, the GPU's busy time per step (the union of its kernels' intervals)
and so how long the GPU sat idle waiting for the host. Then the kernels of the plain loop's steps by GPU time, and
the plain loop's `Engine.step` split into schedule / launch (forward + sampling, synchronised) / collect /
postprocess / the rest (outputs, stop rules), timed with GPU synchronisation.

    python benchmarks/profile_engine.py [--output-len 96] [--num-prompts 256]
    python benchmarks/profile_engine.py --shape smollm-135m --num-prompts 512   # W5's model and batch
    python benchmarks/profile_engine.py --prefill [--max-num-batched-tokens 16384]  # the prefill phase instead

`--prefill`: the run's first step (one chunk of prefill only) and then the whole prefill phase (every step until
each request has its first token), each under the profiler: wall time against GPU busy time, the kernels by GPU
time, the longest GPU idle gaps, and the host's share of each step (schedule, input building, launch, the wait for
the results, postprocess).

A diagnosis tool, not a benchmark: the profiler and the timers slow the host down.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_checkpoints import QWEN3_06B_SHAPE, SMOLLM_135M_SHAPE, build_checkpoint, make_prompts
from benchmarks.gpu_trace import busy_microseconds, idle_gaps, log_triton_compiles

SHAPES = {"qwen3-0.6b": QWEN3_06B_SHAPE, "smollm-135m": SMOLLM_135M_SHAPE}
PROFILED_STEPS = 16
UNPROFILED_STEPS = 32


def timed(owner, name: str, totals: dict, synchronize: bool) -> None:
    """Replace `owner.name` by a wrapper that adds its wall time to totals[name]."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = inner(*args, **kwargs)
        if synchronize:
            torch.cuda.synchronize()
        totals[name] += time.perf_counter() - start
        return result

    setattr(owner, name, wrapper)


def make_engine(model_path: str, args, overlap: bool):
    from slime.engine.engine import Engine

    return Engine(model_path, device="cuda", dtype="bfloat16", max_num_seqs=args.num_prompts,
                  max_model_len=args.input_len + args.output_len + 16, overlap_schedule=overlap,
                  max_num_batched_tokens=args.max_num_batched_tokens)


def print_trace(label: str, prof, wall_ms: float, num_steps: int) -> None:
    """Wall vs GPU busy time of a traced stretch, its kernels by GPU time and its longest GPU idle gaps."""
    busy_us, num_kernels = busy_microseconds(prof)
    print(f"\n{label}: {num_steps} steps, wall {wall_ms:.1f} ms, GPU busy {busy_us / 1000:.1f} ms "
          f"({1 - busy_us / 1000 / wall_ms:.0%} idle), {num_kernels} device events")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20))
    print("longest GPU idle gaps (us, kernel before -> kernel after):")
    for gap, before, after in idle_gaps(prof):
        print(f"  {gap:9.0f}  {before} -> {after}")


def profile_prefill(model_path: str, prompts, args) -> None:
    """Three passes over the prefill phase on one engine (overlapped loop, as served), each from a flushed cache:
    step by step (synchronised after each step; step 1 traced alone), the whole phase traced, and the whole phase
    with host sections timed (synchronised around the launch, so `launch` holds the GPU time too)."""
    from slime.engine.sampling_params import SamplingParams

    engine = make_engine(model_path, args, overlap=True)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.output_len, ignore_eos=True)
    engine.generate(prompts[:4], SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True))
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    totals: dict[str, float] = defaultdict(float)
    for mode in ("steps", "traced", "sections"):
        engine.abort_all()
        engine.flush_cache()
        for prompt in prompts:
            engine.add_request(prompt, params, incremental=False)
        if mode == "sections":
            timed(engine.scheduler, "schedule", totals, False)
            timed(engine.model_runner, "prepare_inputs", totals, False)
            timed(engine.model_runner, "launch", totals, True)
            timed(engine.model_runner, "collect", totals, False)
            timed(engine.scheduler, "postprocess", totals, False)
        torch.cuda.synchronize()
        step_ms, num_steps = [], 0
        with torch.profiler.profile(activities=activities) if mode == "traced" else contextlib.nullcontext() as prof:
            started = time.perf_counter()
            while any(seq.num_completion_tokens == 0 for seq in engine.requests.values()):
                traced = mode == "steps" and num_steps == 1
                with torch.profiler.profile(activities=activities) if traced else contextlib.nullcontext() as one:
                    step_started = time.perf_counter()
                    engine.step()
                    if mode == "steps":
                        torch.cuda.synchronize()
                    step_ms.append(1000 * (time.perf_counter() - step_started))
                if traced:  # step 0 launches chunk 1; step 1 waits for it and runs chunk 2 (beside 1's decodes)
                    print_trace("prefill step 1 (waits for chunk 1, runs chunk 2)", one, step_ms[-1], 1)
                num_steps += 1
            torch.cuda.synchronize()
            wall_ms = 1000 * (time.perf_counter() - started)
        print(f"\nprefill phase ({mode}): {num_steps} steps, {wall_ms:.1f} ms, max_num_batched_tokens "
              f"{engine.config.max_num_batched_tokens}; steps (ms): " + " ".join(f"{t:.1f}" for t in step_ms))
        if mode == "traced":
            print_trace("whole prefill phase", prof, wall_ms, num_steps)
        for name, total in totals.items():
            print(f"  {name:15s} {1000 * total / num_steps:7.2f} ms/step")


def profile_mode(model_path: str, prompts, args, overlap: bool) -> dict:
    from slime.engine.sampling_params import SamplingParams

    engine = make_engine(model_path, args, overlap)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.output_len, ignore_eos=True)
    engine.generate(prompts[:4], SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True))
    for prompt in prompts:
        engine.add_request(prompt, params, incremental=False)
    torch.cuda.synchronize()
    started = time.perf_counter()
    prefill_steps = []
    while any(seq.num_completion_tokens == 0 for seq in engine.requests.values()):
        step_started = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        prefill_steps.append(time.perf_counter() - step_started)
    prefill_seconds = time.perf_counter() - started
    print(f"{'overlap' if overlap else 'plain'}: prefill steps (ms): " + " ".join(f"{1000 * t:.0f}" for t in prefill_steps))
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(UNPROFILED_STEPS):
        engine.step()
    torch.cuda.synchronize()
    step_ms = 1000 * (time.perf_counter() - started) / UNPROFILED_STEPS
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        for _ in range(PROFILED_STEPS):
            engine.step()
        torch.cuda.synchronize()
        profiled_ms = 1000 * (time.perf_counter() - started) / PROFILED_STEPS
    busy_us, num_kernels = busy_microseconds(prof)
    totals: dict[str, float] = defaultdict(float)
    if not overlap:
        timed(engine.scheduler, "schedule", totals, False)
        timed(engine.model_runner, "launch", totals, True)  # synchronised: the forward and sampling's GPU time
        timed(engine.model_runner, "collect", totals, False)
        timed(engine.scheduler, "postprocess", totals, False)
    num_steps, started = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        num_steps += 1
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    return dict(prof=prof, prefill_s=prefill_seconds, profiled_ms=profiled_ms, busy_ms=busy_us / 1000 / PROFILED_STEPS,
                kernels=num_kernels / PROFILED_STEPS, step_ms=step_ms, totals=totals,
                num_steps=num_steps, elapsed=elapsed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192,
                        help="the engine's token budget per step (prefill chunk size)")
    parser.add_argument("--prefill", action="store_true", help="profile the prefill phase instead of decode")
    args = parser.parse_args()
    log_triton_compiles()
    with tempfile.TemporaryDirectory(prefix="profile_engine_") as tmp:
        shape = SHAPES[args.shape]
        model_path = str(build_checkpoint(Path(tmp) / "model", shape, torch.bfloat16, "cuda", 0))
        prompts = make_prompts(args.num_prompts, args.input_len, shape["vocab_size"], 0)
        if args.prefill:
            return profile_prefill(model_path, prompts, args)
        results = {mode: profile_mode(model_path, prompts, args, mode == "overlap") for mode in ("plain", "overlap")}
    events = results["plain"]["prof"].key_averages()
    print(events.table(sort_by="cuda_time_total", row_limit=30))
    plain = results["plain"]
    print(f"plain loop, timed with synchronisation ({plain['num_steps']} steps, batch {args.num_prompts}):")
    for name, total in plain["totals"].items():
        print(f"  {name:12s} {1000 * total / max(plain['num_steps'], 1):7.2f} ms/step")
    rest = plain["elapsed"] - sum(plain["totals"].values())
    print(f"  {'rest':12s} {1000 * rest / max(plain['num_steps'], 1):7.2f} ms/step (outputs, stop rules, bookkeeping)")
    print("\n| loop | prefill s | decode ms/step (unprofiled) | profiled ms/step | GPU busy ms/step | GPU idle | "
          "kernels/step |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        idle = 1 - r["busy_ms"] / r["profiled_ms"]
        print(f"| {mode} | {r['prefill_s']:.3f} | {r['step_ms']:.2f} | {r['profiled_ms']:.2f} | {r['busy_ms']:.2f} | "
              f"{idle:.0%} | {r['kernels']:.0f} |")


if __name__ == "__main__":
    main()
