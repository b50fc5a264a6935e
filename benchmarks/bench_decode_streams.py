"""Does a decode step get faster when its batch runs as two halves on two CUDA streams inside one graph?

A W1 decode step (Qwen3-0.6B shape, 256 sequences) is ~2.6 ms of paged attention, which reads the KV cache at the
memory's speed, and ~1.4 ms of everything else: matmuls at 2-4x their floor (small M, latency-bound), norms,
RoPE, SiLU. Two independent halves give the GPU two kernels to run at once, so one half's matmuls can fill the SMs
the other half's attention leaves idle. This measures the graph replay of one decode step, same inputs, for:

- `one_stream`:  the engine's decode graph (cuda_graph.DecodeGraphs), the whole batch on one stream;
- `two_streams`: the batch split into halves, each a whole forward on its own stream, joined at the end;
- `two_streams_offset`: the same, the second half starting only after the first half's layer-0 attention, so the
  halves' attention kernels are out of phase.

and checks that every variant's hidden states match the one-stream graph's. A diagnosis tool for a design choice:
prints us per replay, the ratio to one stream, and a JSON line last.

    python benchmarks/bench_decode_streams.py [--contexts 300,384,480] [--batch-size 256]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_checkpoints import QWEN3_06B_SHAPE, build_checkpoint
from slime.engine.cuda_graph import DecodeGraphs


class TwoStreamDecodeGraphs(DecodeGraphs):
    """DecodeGraphs whose captured forward runs the two halves of the batch on two streams."""

    def __init__(self, *args, offset: bool, **kwargs):
        self.side_stream = torch.cuda.Stream()
        self.offset = offset
        super().__init__(*args, **kwargs)

    def _rows_forward(self, rows: slice, started: torch.cuda.Event | None) -> None:
        meta = self._metadata(self.batch_sizes[-1])
        meta.slot_mapping, meta.block_tables, meta.seq_lens = (
            meta.slot_mapping[rows], meta.block_tables[rows], meta.seq_lens[rows])
        meta.query_start_loc = self.query_start_loc[: rows.stop - rows.start + 1]
        decoder, positions = self.model.model, self.positions[rows]
        hidden = decoder.embed_tokens(self.input_ids[rows])
        first = decoder.layers[0]
        residual, normed = hidden, first.input_layernorm(hidden)
        attention_out = first.self_attn(positions, normed, meta)
        if started is not None:
            started.record()
        normed, residual = first.post_attention_layernorm.add_and_norm(attention_out, residual)
        hidden = first.mlp(normed)
        for layer in decoder.layers[1:]:
            hidden, residual = layer(positions, hidden, residual, meta)
        self.hidden[rows] = decoder.norm.add_and_norm(hidden, residual)[0]

    def _forward(self, batch_size: int) -> None:
        half = batch_size // 2
        main = torch.cuda.current_stream()
        started = torch.cuda.Event() if self.offset else None
        self.side_stream.wait_stream(main)
        self._rows_forward(slice(0, half), started)
        with torch.cuda.stream(self.side_stream):
            if started is not None:
                self.side_stream.wait_event(started)
            self._rows_forward(slice(half, batch_size), None)
        main.wait_stream(self.side_stream)


def step_inputs(batch_size: int, context: int, block_size: int, num_blocks: int, seed: int):
    """token_inputs [4, n] and block tables [n, w] of a decode step at `context` tokens per sequence, each
    sequence on its own randomly placed blocks."""
    rng = np.random.default_rng(seed)
    width = -(-context // block_size)
    tables = rng.permutation(num_blocks)[: batch_size * width].reshape(batch_size, width).astype(np.int32)
    position = context - 1
    token_inputs = np.empty((4, batch_size), dtype=np.int64)
    token_inputs[0] = rng.integers(0, 1000, batch_size)
    token_inputs[1] = position
    token_inputs[2] = tables[:, position // block_size].astype(np.int64) * block_size + position % block_size
    token_inputs[3] = context
    return token_inputs, tables


def time_replays(graphs: DecodeGraphs, batch_size: int, iters: int) -> float:
    graph = graphs.graphs[batch_size]
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(3):
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / iters)
    return float(np.median(samples))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="300,384,480")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    from slime.engine.engine import Engine

    work = Path(tempfile.mkdtemp(prefix="decode_streams_"))
    build_checkpoint(work, QWEN3_06B_SHAPE, torch.bfloat16, "cuda", seed=0)
    contexts = [int(c) for c in args.contexts.split(",")]
    engine = Engine(str(work), device="cuda", dtype="bfloat16", max_num_seqs=args.batch_size,
                    max_model_len=max(contexts) + 16, num_kvcache_blocks=args.batch_size * 40)
    runner = engine.model_runner
    common = (runner.model, args.batch_size, runner.max_num_blocks_per_seq, runner.scratch_slot, runner.staging)
    variants = {
        "one_stream": DecodeGraphs(*common, capture_all=False),
        "two_streams": TwoStreamDecodeGraphs(*common, capture_all=False, offset=False),
        "two_streams_offset": TwoStreamDecodeGraphs(*common, capture_all=False, offset=True),
    }
    results = []
    print(f"{'context':>8} {'variant':>20} {'us/replay':>10} {'vs one':>8} {'max |diff|':>11}")
    for context in contexts:
        token_inputs, tables = step_inputs(args.batch_size, context, runner.block_size, runner.num_kvcache_blocks, 1)
        reference, base = None, 0.0
        for name, graphs in variants.items():
            hidden = graphs.run(token_inputs, tables).float().clone()
            torch.cuda.synchronize()
            reference = hidden if reference is None else reference
            diff = (hidden - reference).abs().max().item()
            us = time_replays(graphs, graphs.batch_sizes[-1], args.iters)
            base = us if name == "one_stream" else base
            results.append({"context": context, "variant": name, "us": us, "ratio": us / base, "max_diff": diff})
            print(f"{context:>8} {name:>20} {us:>10.1f} {us / base:>8.3f} {diff:>11.2e}")
    print(json.dumps({"batch_size": args.batch_size, "results": results}))


if __name__ == "__main__":
    main()
