"""`bench_engine.py --tp-size N [--ep-size M]`: the same workload on the engine at one rank and at N ranks, in one
run, with the ratio, and the collectives a decode step of N ranks does, timed on their own.

A decode step of a sharded dense model all-reduces [batch, hidden] once for the embedding and twice per layer (after
the attention's o_proj and the MLP's down_proj; an MoE layer's experts and shared expert share the second), then
all-gathers the LM head's [batch, vocab / N] logits. `collective_ms_per_decode_step` times exactly those collectives
(same sizes, dtype and backend: NCCL on CUDA, gloo on the CPU) in N processes, median of 50 steps; the engine's own
step includes them plus the ranks' skew. The reference's expectation for small models on GPUs: TP=2 decodes
~1.3-1.6x TP=1, not 2x (../shared/reference/engine-parallelism.md section 9).
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slime.utils.misc import find_free_port


def compare_tp(model_path: Path, workload, args, single: dict, bench_engine) -> dict:
    """Run `bench_engine` at args.tp_size ranks beside its one-rank result `single`; the comparison as a dict."""
    args.engine_parallel = {"tp_size": args.tp_size, "ep_size": args.ep_size}
    try:
        sharded = bench_engine(model_path, workload, args, measure_weights_and_memory=False)
    finally:
        args.engine_parallel = {}
    config = json.loads((Path(model_path) / "config.json").read_text())
    config = config.get("text_config", config)
    batch = len(workload.prompts)
    collectives = time_decode_collectives(args.tp_size, batch, config["hidden_size"], config["num_hidden_layers"],
                                          config["vocab_size"], args.device, getattr(torch, args.dtype))
    rate = {name: run["num_output_tokens"] / run["seconds"] for name, run in (("tp1", single), ("tpn", sharded))}
    result = {
        "tp_size": args.tp_size, "ep_size": args.ep_size,
        "tp1_output_tok_s": round(rate["tp1"], 1), "tpn_output_tok_s": round(rate["tpn"], 1),
        "tpn_over_tp1": round(rate["tpn"] / rate["tp1"], 3),
        "tp1_ms_per_step": round(1000 * single["seconds"] / single["num_steps"], 2),
        "tpn_ms_per_step": round(1000 * sharded["seconds"] / sharded["num_steps"], 2),
        "decode_batch": batch, **collectives,
    }
    print(f"  TP={args.tp_size} (EP={args.ep_size}): {result['tpn_output_tok_s']} tok/s vs TP=1 "
          f"{result['tp1_output_tok_s']} tok/s = {result['tpn_over_tp1']}x; per step {result['tpn_ms_per_step']} ms "
          f"vs {result['tp1_ms_per_step']} ms; its collectives alone: {result['collective_ms_per_decode_step']} ms "
          f"({result['collectives_per_decode_step']} per decode step of {batch} rows)", flush=True)
    return result


def time_decode_collectives(world: int, batch: int, hidden: int, layers: int, vocab: int, device: str,
                            dtype: torch.dtype, steps: int = 50) -> dict:
    queue = mp.get_context("spawn").SimpleQueue()
    port = find_free_port()
    procs = [mp.get_context("spawn").Process(target=_collectives_rank, daemon=True,
                                             args=(rank, world, port, batch, hidden, layers, vocab, device, dtype,
                                                   steps, queue)) for rank in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=600)
    result = queue.get()
    return {"collectives_per_decode_step": 2 * layers + 2, "collective_ms_per_decode_step": result}


def _collectives_rank(rank, world, port, batch, hidden, layers, vocab, device, dtype, steps, queue) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world,
                            rank=rank, timeout=timedelta(minutes=5))
    target = torch.device("cuda" if cuda else "cpu")
    activations = torch.randn(batch, hidden, dtype=dtype, device=target)
    logits = torch.randn(batch, -(-vocab // world), dtype=dtype, device=target)
    gathered = torch.empty(world * logits.shape[0], logits.shape[1], dtype=dtype, device=target)

    def step():
        for _ in range(2 * layers + 1):
            dist.all_reduce(activations)
        dist.all_gather_into_tensor(gathered, logits)

    for _ in range(5):
        step()
    times = []
    for _ in range(steps):
        activations.normal_()  # fresh values every step (repeated sums would run to inf)
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    if rank == 0:
        queue.put(round(1000 * float(np.median(times)), 3))
    dist.destroy_process_group()
