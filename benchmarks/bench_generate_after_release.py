"""The engine alone, in process, on a GRPO rollout's shape (32 prompts x 8 samples x 256 sampled tokens), generating
fresh and right after a colocated release cycle (train.py's: weights discarded and the KV cache freed, the CUDA graphs
kept; weights resumed and pushed, KV cache resumed): does an engine that just came back generate as fast as one that
never left? Splits the loop's rollout gap (bench_loop.py: the rollout phase against this engine alone) into what the
release costs the engine itself and what the HTTP / rollout path adds.

Prints, per run, seconds, tok/s, the first three step times and lazy graph captures; then the medians of each kind
and their ratio; a JSON last line. Not a pass/fail test.

    python benchmarks/bench_generate_after_release.py /tmp/after_release      # the H200: Qwen3-0.6B shape, bf16
    python benchmarks/bench_generate_after_release.py /tmp/after_release --shape tiny-large --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_checkpoints import SHAPES, TINY_LARGE_SHAPE, build_checkpoint
from slime.engine.engine import Engine
from slime.engine.models.weight_loader import iterate_checkpoint
from slime.engine.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--shape", choices=[*sorted(SHAPES), "tiny-large"], default="qwen3-0.6b")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--n-samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--mem-fraction", type=float, default=0.3, help="gpu_memory_utilization (the loop's 0.3)")
    parser.add_argument("--repeats", type=int, default=4)
    cli = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    checkpoint = cli.out_dir / "model"
    checkpoint.mkdir(parents=True, exist_ok=True)
    shape = TINY_LARGE_SHAPE if cli.shape == "tiny-large" else SHAPES[cli.shape]
    build_checkpoint(checkpoint, shape, dtype, device, seed=0)
    weights = [(name, tensor.to(device)) for name, tensor in iterate_checkpoint(checkpoint)]
    engine = Engine(str(checkpoint), device=device, gpu_memory_utilization=cli.mem_fraction,
                    max_num_seqs=cli.num_prompts * cli.n_samples)
    generator = torch.Generator().manual_seed(0)
    vocab = shape["vocab_size"]
    prompts = [torch.randint(10, vocab, (cli.prompt_len,), generator=generator).tolist()
               for _ in range(cli.num_prompts)]
    requests = [prompt for prompt in prompts for _ in range(cli.n_samples)]
    params = SamplingParams(temperature=1.0, max_new_tokens=cli.max_new_tokens, ignore_eos=True)
    runner = engine.model_runner

    def run(kind: str) -> dict:
        engine.flush_cache()
        captures = runner.graph_capture_stats["graphs"]
        step_times, started = [], time.perf_counter()
        for prompt in requests:
            engine.add_request(prompt, params, incremental=False)
        num_tokens = 0
        while engine.has_unfinished_requests():
            step_started = time.perf_counter()
            num_tokens += sum(len(output.output_token_ids) for output in engine.step() if output.finished)
            step_times.append(time.perf_counter() - step_started)
        seconds = time.perf_counter() - started
        row = {"kind": kind, "seconds": seconds, "tok_s": num_tokens / seconds, "num_steps": len(step_times),
               "first_steps_ms": [round(t * 1e3, 2) for t in step_times[:3]],
               "lazy_captures": runner.graph_capture_stats["graphs"] - captures}
        print(json.dumps(row), flush=True)
        return row

    run("warm-up")
    rows = []
    for _ in range(cli.repeats):
        rows.append(run("fresh"))
        engine.release_memory(["weights", "kv_cache"], discard_weights=True)
        engine.resume_memory(["weights"])
        engine.update_weights_from_tensors(weights, weight_version="pushed")
        engine.resume_memory(["kv_cache", "cuda_graph"])
        rows.append(run("after release"))
    medians = {kind: statistics.median(r["seconds"] for r in rows if r["kind"] == kind)
               for kind in ("fresh", "after release")}
    ratio = medians["after release"] / medians["fresh"]
    print(f"median seconds: fresh {medians['fresh']:.3f}, after a release cycle {medians['after release']:.3f} "
          f"(ratio {ratio:.3f})")
    print(json.dumps({"benchmark": "generate_after_release", "shape": cli.shape, "medians_s": medians,
                      "ratio": ratio, "runs": rows}))


if __name__ == "__main__":
    main()
