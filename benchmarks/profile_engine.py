"""Where a decode step's time goes: the engine on W1 (Qwen3-0.6B shape, 256 x 256 in, --output-len out), each
`Engine.step` split into schedule / model run (forward + sampling + the one host sync) / postprocess / the rest
(outputs, stop rules), then a torch profiler table of the GPU kernels of 8 decode steps.

    python benchmarks/profile_engine.py [--output-len 64] [--num-prompts 256]

A diagnosis tool, not a benchmark: the timers synchronise the GPU, so steps run slower than in bench_engine.py.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_checkpoints import QWEN3_06B_SHAPE, build_checkpoint, make_prompts  # noqa: E402


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    from slime.engine.engine import Engine
    from slime.engine.sampling_params import SamplingParams

    with tempfile.TemporaryDirectory(prefix="profile_engine_") as tmp:
        model_path = build_checkpoint(Path(tmp) / "model", QWEN3_06B_SHAPE, torch.bfloat16, "cuda", 0)
        prompts = make_prompts(args.num_prompts, args.input_len, 151936, 0)
        engine = Engine(str(model_path), device="cuda", dtype="bfloat16", max_num_seqs=args.num_prompts,
                        max_model_len=args.input_len + args.output_len + 16)
        params = SamplingParams(temperature=1.0, max_new_tokens=args.output_len, ignore_eos=True)
        engine.generate(prompts[:4], SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True))
        for prompt in prompts:
            engine.add_request(prompt, params)
        while any(seq.num_completion_tokens == 0 for seq in engine.requests.values()):  # prefill, untimed
            engine.step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(8):
                engine.step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        print(events.table(sort_by="cuda_time_total", row_limit=25))
        gpu_ms = sum(e.device_time_total for e in events) / 1000 / 8
        print(f"kernels per decode step: {sum(e.count for e in events) / 8:.0f}; GPU busy per step: {gpu_ms:.2f} ms")
        totals: dict[str, float] = defaultdict(float)
        timed(engine.scheduler, "schedule", totals, False)
        timed(engine.model_runner, "run", totals, True)
        timed(engine.scheduler, "postprocess", totals, False)
        num_steps, started = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            num_steps += 1
        elapsed = time.perf_counter() - started
    step_ms = 1000 * elapsed / max(num_steps, 1)
    print(f"decode steps timed: {num_steps}, batch {args.num_prompts}, {step_ms:.2f} ms per step")
    for name, total in totals.items():
        print(f"  {name:12s} {1000 * total / max(num_steps, 1):7.2f} ms/step")
    rest = elapsed - sum(totals.values())
    print(f"  {'rest':12s} {1000 * rest / max(num_steps, 1):7.2f} ms/step (outputs, stop rules, bookkeeping)")


if __name__ == "__main__":
    main()
