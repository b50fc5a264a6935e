"""The engine's host-side time per decode step (`bench_engine.py --workload host`): 512 sequences on a tiny CPU
model whose decode forward and sampler are replaced by trivial functions, so each step's time is scheduling, input
preparation, output bookkeeping and stop checks (wall time, and the stepping thread's CPU time), with the median of
each part of a step (HOST_STEP_PARTS); and the same for the steps that prefill, whose forward is faked too
(PREFILL_STEP_PARTS). Runs the overlapped step loop (the CUDA default) unless told otherwise. Measures no device
work.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections import defaultdict
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

    class InstantPrefillGraphs:  # the piecewise prefill graphs' replays and attention launches, faked
        def __init__(self, model, max_num_tokens, *_, **__):
            self.hidden = torch.zeros(max_num_tokens, model.config.hidden_size)

        def fits(self, num_tokens):
            return num_tokens <= self.hidden.shape[0]

        def run(self, input_ids, positions, meta):
            return self.hidden[: input_ids.shape[0]]

    generator = torch.Generator().manual_seed(seed)

    def instant_sample(logits, batch):
        tokens = torch.randint(3, TINY_SHAPE["vocab_size"], (logits.shape[0],), generator=generator)
        return tokens, torch.stack([tokens.double(), logits[:, 0].double()])

    saved = (model_runner_module.DecodeGraphs, model_runner_module.PrefillGraphs, model_runner_module.sample_results,
             torch.get_num_threads())
    model_runner_module.DecodeGraphs, model_runner_module.PrefillGraphs = InstantDecodeGraphs, InstantPrefillGraphs
    model_runner_module.sample_results = instant_sample
    # The faked device work (tensor slicing and indexing on the CPU) stays off torch's thread pool: on a loaded
    # 2-core machine, indexing 64+ rows through it took ~7 ms (thread wake-ups), where a GPU queues one kernel.
    torch.set_num_threads(1)
    part_seconds: dict[str, float] = defaultdict(float)  # this step's time in each timed function
    step_parts: list[dict[str, float]] = []
    try:
        timers = contextlib.ExitStack()
        for name, (owner, attribute) in _timed_functions().items():
            timers.enter_context(_timed(owner, attribute, name, part_seconds))
        with tempfile.TemporaryDirectory(prefix="bench_engine_host_") as tmp:
            path = build_checkpoint(Path(tmp) / "model", TINY_SHAPE, torch.float32, "cpu", seed)
            engine = Engine(str(path), device="cpu", max_num_seqs=num_seqs, max_model_len=input_len + output_len + 16,
                            max_num_batched_tokens=max(8192, num_seqs), seed=seed, overlap_schedule=overlap_schedule)
            runner = engine.model_runner
            runner.use_cuda_graphs = True
            runner.use_triton = True  # the CUDA path's attention metadata for eager (prefill) steps
            hidden = torch.zeros(engine.config.max_num_batched_tokens + num_seqs, runner.model.config.hidden_size)
            runner.model.forward = lambda input_ids, positions, meta: hidden[: input_ids.shape[0]]
            runner.model.compute_logits = lambda hidden, upcast=True: hidden[:, :8].float()
            for prompt in make_prompts(num_seqs, input_len, TINY_SHAPE["vocab_size"], seed):
                # One SamplingParams per request, as the HTTP server parses them from each request's JSON.
                params = SamplingParams(temperature=1.0, max_new_tokens=output_len, ignore_eos=True)
                engine.add_request(prompt, params, incremental=incremental)
            step_seconds, step_cpu_seconds, prefill_parts, finishing_seconds = [], [], [], []
            while engine.has_unfinished_requests():
                is_decode = not engine.scheduler.waiting and all(
                    seq.num_computed_tokens == len(seq) - 1 for seq in engine.scheduler.running
                )
                part_seconds.clear()
                started, cpu_started = time.perf_counter(), time.thread_time()
                num_finished = sum(output.finished for output in engine.step())
                if num_finished:
                    finishing_seconds.append((time.perf_counter() - started, num_finished))
                if is_decode:
                    step_seconds.append(time.perf_counter() - started)
                    step_cpu_seconds.append(time.thread_time() - cpu_started)
                    step_parts.append(_step_parts(part_seconds, step_seconds[-1]))
                else:
                    prefill_parts.append(_prefill_step_parts(part_seconds, time.perf_counter() - started))
    finally:
        timers.close()
        (model_runner_module.DecodeGraphs, model_runner_module.PrefillGraphs, model_runner_module.sample_results,
         num_threads) = saved
        torch.set_num_threads(num_threads)
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
        # Median wall ms of each part over the decode steps (the medians need not add up to the step's median).
        "host_ms_per_step_parts": _median_ms(step_parts, HOST_STEP_PARTS),
        # The steps that prefill (a chunk of new prompts beside the decode rows of those already in), with their
        # forward faked too: host work that the overlapped loop does not hide (it schedules ahead only decode steps).
        # The steps in which requests finished, (wall ms, number finished): their texts are left to the consumer.
        "host_ms_finishing_steps": [(round(seconds * 1e3, 3), count) for seconds, count in finishing_seconds],
        "num_prefill_steps": len(prefill_parts),
        "prefill_host_ms_per_step_median": _median_ms(prefill_parts, ["step"])["step"],
        "prefill_host_ms_per_step_parts": _median_ms(prefill_parts, PREFILL_STEP_PARTS),
    }


def _median_ms(step_parts: list[dict[str, float]], names) -> dict[str, float]:
    return {name: round(float(np.median([parts[name] for parts in step_parts])) * 1e3, 3) for name in names}


# The parts of a decode step: what each covers (the timed function, less the parts timed inside it).
HOST_STEP_PARTS = {
    "look_ahead": "Scheduler.look_ahead: the next step scheduled on placeholders (overlapped loop)",
    "decode_rows": "DecodeRows.update: the batch's block tables and per-row sampling values",
    "sampling_inputs": "DecodeSampling.build: the sampler's per-row tensors",
    "forward_inputs": "the decode forward's token inputs (positions, slots), the faked graph replay",
    "launch_rest": "the rest of ModelRunner.launch: the faked sampler, the results' host copy",
    "collect": "ModelRunner.collect: the sampled tokens as Python lists",
    "postprocess": "Scheduler.postprocess: tokens appended, token-level stops, finishes",
    "outputs": "the rest of Engine._complete: stop strings, RequestOutputs, detokenization",
    "step_rest": "the rest of Engine.step (schedule() when not scheduled ahead)",
}


PREFILL_STEP_PARTS = {
    "schedule": "Scheduler.schedule: admissions (prefix matching, blocks), chunking, a ScheduledSequence per row",
    "prepare_inputs": "ModelRunner.prepare_inputs: the flat token batch and attention metadata",
    "prepare_sampling": "prepare_sampling: the sampling rows' tensors, from each row's SamplingParams",
    "postprocess": "Scheduler.postprocess",
    "rest": "the rest of the step (the faked forward and sampler, collect, outputs)",
}


def _timed_functions() -> dict[str, tuple[object, str]]:
    import slime.engine.model_runner as model_runner_module
    from slime.engine.decode_rows import DecodeRows
    from slime.engine.engine import Engine
    from slime.engine.model_runner import ModelRunner
    from slime.engine.overlap import SchedulerLookAhead
    from slime.engine.sampling_inputs import DecodeSampling
    from slime.engine.scheduler import Scheduler

    return {
        "look_ahead": (SchedulerLookAhead, "look_ahead"), "decode_rows": (DecodeRows, "update"),
        "sampling_inputs": (DecodeSampling, "build"),
        "forward_inputs": (ModelRunner, "_forward_decode_graph"), "launch": (ModelRunner, "launch"),
        "collect": (ModelRunner, "collect"), "postprocess": (Scheduler, "postprocess"),
        "complete": (Engine, "_complete"),
        "schedule": (Scheduler, "schedule"), "prepare_inputs": (ModelRunner, "prepare_inputs"),
        "prepare_sampling": (model_runner_module, "prepare_sampling"),
    }


@contextlib.contextmanager
def _timed(owner, attribute: str, name: str, seconds: dict[str, float]):
    """Add the wall time of every call of owner.attribute to seconds[name] while the context is open."""
    raw = owner.__dict__[attribute] if isinstance(owner, type) else getattr(owner, attribute)
    function = raw.__func__ if isinstance(raw, staticmethod) else raw

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - started

    setattr(owner, attribute, staticmethod(timed) if isinstance(raw, staticmethod) else timed)
    try:
        yield
    finally:
        setattr(owner, attribute, raw)


def _prefill_step_parts(seconds: dict[str, float], step_seconds: float) -> dict[str, float]:
    timed = ("schedule", "prepare_inputs", "prepare_sampling", "postprocess")
    return {"step": step_seconds, **{name: seconds[name] for name in timed},
            "rest": step_seconds - sum(seconds[name] for name in timed)}


def _step_parts(seconds: dict[str, float], step_seconds: float) -> dict[str, float]:
    """One step's HOST_STEP_PARTS from the timed functions' totals (outer functions less the inner ones)."""
    inner_launch = seconds["decode_rows"] + seconds["sampling_inputs"] + seconds["forward_inputs"]
    return {
        "look_ahead": seconds["look_ahead"], "decode_rows": seconds["decode_rows"],
        "sampling_inputs": seconds["sampling_inputs"], "forward_inputs": seconds["forward_inputs"],
        "launch_rest": seconds["launch"] - inner_launch, "collect": seconds["collect"],
        "postprocess": seconds["postprocess"],
        "outputs": seconds["complete"] - seconds["collect"] - seconds["postprocess"],
        "step_rest": step_seconds - seconds["look_ahead"] - seconds["launch"] - seconds["complete"],
    }
