"""The engine's host-side time per decode step (`bench_engine.py --workload host`): 512 sequences on a tiny CPU
model whose decode forward and sampler are replaced by trivial functions, so each step's time is scheduling, input
preparation, output bookkeeping and stop checks (wall time, and the stepping thread's CPU time). Runs the overlapped step loop (the CUDA default) unless told
otherwise. Measures no device work.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.engine_checkpoints import TINY_SHAPE, build_checkpoint, make_prompts


def bench_host_step(seed: int, num_seqs: int = 512, input_len: int = 256, output_len: int = 512,
                    overlap_schedule: bool = True, incremental: bool = False) -> dict:
    """Host-side ms per decode step: the engine steps `num_seqs` sequences on a tiny CPU model whose decode
    forward (the CUDA-graph path, faked) and sampler return at once, so what is timed is scheduling, input
    preparation, output bookkeeping and stop checks. `incremental`: the requests ask for every step's output
    (streaming consumers); otherwise only for the finished one, as the default rollout's requests do."""
    import slime.engine.model_runner as model_runner_module
    from slime.engine.engine import Engine
    from slime.engine.sampling_params import SamplingParams

    class InstantDecodeGraphs:
        def __init__(self, model, max_num_seqs, *_, **__):
            self.max_batch_size = max_num_seqs
            self.hidden = torch.zeros(max_num_seqs, model.config.hidden_size)

        def run(self, token_inputs, block_tables, input_tokens=None, input_rows=None):
            return self.hidden[: block_tables.shape[0]]

    generator = torch.Generator().manual_seed(seed)

    def instant_sample(logits, batch):
        return torch.randint(3, TINY_SHAPE["vocab_size"], (logits.shape[0],), generator=generator), logits[:, 0]

    saved = model_runner_module.DecodeGraphs, model_runner_module.sample
    model_runner_module.DecodeGraphs, model_runner_module.sample = InstantDecodeGraphs, instant_sample
    try:
        with tempfile.TemporaryDirectory(prefix="bench_engine_host_") as tmp:
            path = build_checkpoint(Path(tmp) / "model", TINY_SHAPE, torch.float32, "cpu", seed)
            engine = Engine(str(path), device="cpu", max_num_seqs=num_seqs, max_model_len=input_len + output_len + 16,
                            max_num_batched_tokens=max(8192, num_seqs), seed=seed, overlap_schedule=overlap_schedule)
            engine.model_runner.use_cuda_graphs = True
            engine.model_runner.model.compute_logits = lambda hidden, upcast=True: hidden[:, :8].float()
            for prompt in make_prompts(num_seqs, input_len, TINY_SHAPE["vocab_size"], seed):
                # One SamplingParams per request, as the HTTP server parses them from each request's JSON.
                params = SamplingParams(temperature=1.0, max_new_tokens=output_len, ignore_eos=True)
                engine.add_request(prompt, params, incremental=incremental)
            step_seconds, step_cpu_seconds = [], []
            while engine.has_unfinished_requests():
                is_decode = not engine.scheduler.waiting and all(
                    seq.num_computed_tokens == len(seq) - 1 for seq in engine.scheduler.running
                )
                started, cpu_started = time.perf_counter(), time.thread_time()
                engine.step()
                if is_decode:
                    step_seconds.append(time.perf_counter() - started)
                    step_cpu_seconds.append(time.thread_time() - cpu_started)
    finally:
        model_runner_module.DecodeGraphs, model_runner_module.sample = saved
    step_ms = np.array(step_seconds) * 1e3
    cpu_ms = np.array(step_cpu_seconds) * 1e3
    return {
        "benchmark": "engine_host_step",
        "num_seqs": num_seqs, "input_len": input_len, "output_len": output_len,
        "overlap_schedule": overlap_schedule, "incremental": incremental,
        "num_decode_steps": len(step_ms),
        "host_ms_per_step_mean": round(float(step_ms.mean()), 3),
        "host_ms_per_step_median": round(float(np.median(step_ms)), 3),
        "host_ms_per_step_first_64": round(float(step_ms[:64].mean()), 3),
        "host_ms_per_step_last_64": round(float(step_ms[-64:].mean()), 3),
        # CPU time of the stepping thread: what the host work costs, less exposed to other processes on the cores.
        "host_cpu_ms_per_step_median": round(float(np.median(cpu_ms)), 3),
        "host_cpu_ms_per_step_mean": round(float(cpu_ms.mean()), 3),
    }
