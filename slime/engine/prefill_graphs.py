"""Piecewise CUDA graphs of the model's forward for prefill and mixed steps, at bucketed token counts.

Everything of a step but the attention is captured, as num_layers + 1 graphs ("pieces"): the embedding and layer 0's
attention input (qkv matmul, q/k norm, rotary, K/V cache store); then per layer its o_proj and MLP with the next
layer's attention input; the last piece ends with the final norm. The attention runs eagerly between two pieces on
the step's real metadata, since its grid depends on the batch's sequences and their lengths. An 8192-token chunk of
a 28-layer model then costs 29 graph replays and 28 attention launches from Python instead of ~370 launches, which
on an H200 left the device idle ~40% of W1's prefill phase (benchmarks/RESULTS.md). vLLM calls this piecewise CUDA
graphs; SGLang (0.5.15) has them on unless --disable-piecewise-cuda-graph.

A step of n tokens runs in the smallest bucket >= n. The rows past n read stale inputs; their K/V (and MoE routing)
go to the scratch cache slot that no sequence owns, the attention computes the n real rows only, and their outputs
are never read. Like the decode graphs (cuda_graph.py) these bake in the addresses of the weights and the KV cache:
the model runner drops, parks and takes them back together with those. The first PrefillGraphs captures every
bucket at start-up; later ones (after a release that dropped them) capture a bucket when a step first needs it.
Not used on the CPU, with enforce_eager, or past the largest bucket (the eager forward runs those).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from slime.engine.cuda_graph import slots_on_scratch
from slime.engine.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)


def bucket_token_counts(max_num_tokens: int) -> list[int]:
    """16, 32, ..., 1024, then multiples of 1024, up to max_num_tokens rounded up to a multiple of 16."""
    largest = -(-max_num_tokens // 16) * 16
    sizes = {16 << shift for shift in range(7)} | set(range(2048, largest, 1024)) | {largest}
    return sorted(size for size in sizes if size <= largest)


def _reserved_after_emptying(device: torch.device) -> int:
    """Device memory torch's allocator holds once its unused cached blocks are given back: what the graphs' pool
    and buffers add to it is what they hold for good (the warm-up passes' activations are given back)."""
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)


@dataclass
class _Bucket:
    """One token count's pieces in order, and the final hidden states the last one writes."""

    graphs: list[torch.cuda.CUDAGraph]
    hidden: torch.Tensor


class PrefillGraphs:
    def __init__(self, model: nn.Module, max_num_tokens: int, scratch_slot: int, use_graphs: bool = True,
                 capture_all: bool = True, capture_stats: dict | None = None,
                 warmed_sizes: set[int] | None = None):
        """`use_graphs` False runs the same pieces eagerly (the CPU tests' check of the split and the padding).
        `capture_stats` and `warmed_sizes` are kept by the owner across PrefillGraphs, as DecodeGraphs'."""
        self.model = model
        self.decoder = model.model
        self.layers = list(self.decoder.layers)
        self.sizes = bucket_token_counts(max_num_tokens)
        self.scratch_slot = scratch_slot
        self.use_graphs = use_graphs
        self.capture_stats = capture_stats if capture_stats is not None else {"graphs": 0, "seconds": 0.0}
        self.warmed_sizes = warmed_sizes if warmed_sizes is not None else set()
        config, parameter = model.config, next(model.parameters())
        reserved_before = _reserved_after_emptying(parameter.device) if use_graphs and capture_all else 0
        max_size = self.sizes[-1]
        self.token_inputs = torch.zeros(3, max_size, dtype=torch.int64, device=parameter.device)
        self.input_ids, self.positions, self.slot_mapping = self.token_inputs
        num_heads = self.layers[0].self_attn.num_heads  # this rank's q heads (all of them at tp_size 1)
        q_size = num_heads * config.head_dim
        # Shared by every layer and bucket: a piece writes q, the eager attention reads it and writes `attended`,
        # which the next piece reads (zeros at first: the padded rows' values are never read, but stay finite).
        self.q = torch.zeros(max_size, num_heads, config.head_dim, dtype=parameter.dtype, device=parameter.device)
        self.attended = torch.zeros(max_size, q_size, dtype=parameter.dtype, device=parameter.device)
        self.buckets: dict[int, _Bucket] = {}
        self.pool = None  # one memory pool for every piece of every bucket: they run one at a time, in order
        self.capture_stream = torch.cuda.Stream() if use_graphs else None
        if use_graphs and capture_all:
            started = time.perf_counter()
            for size in reversed(self.sizes):
                self._capture(size)
            torch.cuda.synchronize()
            logger.info("captured piecewise prefill CUDA graphs for %d token counts up to %d (%d graphs) in %.2f s, "
                        "holding %.2f GiB of device memory (prefill_cuda_graph_max_tokens lowers it)", len(self.sizes),
                        max_size, len(self.sizes) * (len(self.layers) + 1), time.perf_counter() - started,
                        (_reserved_after_emptying(parameter.device) - reserved_before) / 2**30)

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.sizes[-1]

    def _piece(self, index: int, size: int, residual: torch.Tensor | None):
        """Piece `index` over the first `size` rows of the static buffers: after layer index-1's attention (none
        for the first piece) up to layer index's (the final norm for the last piece). Returns (its hidden output
        or None, the residual stream for the next piece)."""
        positions, slot_mapping = self.positions[:size], self.slot_mapping[:size]
        if index == 0:
            hidden, residual = self.decoder.embed_tokens(self.input_ids[:size]), None
        else:
            layer = self.layers[index - 1]
            hidden, residual = layer.feed_forward(layer.self_attn.o_proj(self.attended[:size]), residual,
                                                  slot_mapping)
        if index == len(self.layers):
            return self.decoder.final_norm(hidden, residual), None
        layer = self.layers[index]
        normed, residual = layer.input_norm(hidden, residual)
        layer.self_attn.project(positions, normed, slot_mapping, self.q[:size])
        return None, residual

    def _capture(self, size: int) -> _Bucket:
        """Capture one bucket's pieces in order, after an eager pass the first time this process sees the size
        (Triton compilation, cuBLAS heuristics). Both write K/V only to the scratch slot. A piece's residual
        output is held until the next piece is captured, then released to the pool: at replay the next piece has
        read it before any later piece can reuse its memory."""
        started = time.perf_counter()
        with slots_on_scratch(self.slot_mapping[:size], self.scratch_slot):
            if size not in self.warmed_sizes:
                residual = None
                for index in range(len(self.layers) + 1):
                    _, residual = self._piece(index, size, residual)
            graphs, hidden = self._capture_pieces(size)
        self.buckets[size] = bucket = _Bucket(graphs, hidden)
        self.warmed_sizes.add(size)
        self.capture_stats["graphs"] += len(graphs)
        self.capture_stats["seconds"] += time.perf_counter() - started
        return bucket

    def _capture_pieces(self, size: int) -> tuple[list[torch.cuda.CUDAGraph], torch.Tensor]:
        """The pieces' graphs and the last one's output. One synchronisation per bucket, not per piece:
        torch.cuda.graph() also empties the allocator's caches at every capture, which made 406 captures take 5.6 s
        of an H200 engine's start-up."""
        graphs, residual, hidden = [], None, None
        self.capture_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.capture_stream):
            for index in range(len(self.layers) + 1):
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(*(() if self.pool is None else (self.pool,)))
                try:
                    hidden, residual = self._piece(index, size, residual)
                finally:
                    graph.capture_end()  # a failed capture must still end, or the stream stays capturing
                self.pool = graph.pool() if self.pool is None else self.pool
                graphs.append(graph)
        torch.cuda.current_stream().wait_stream(self.capture_stream)
        return graphs, hidden

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model's forward of n tokens (as `model(input_ids, positions, meta)`, Triton metadata, n within the
        largest bucket): final hidden states [n, hidden_size], a view into a static buffer valid until the next
        run."""
        num_tokens = input_ids.shape[0]
        size = next(size for size in self.sizes if size >= num_tokens)
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        self.slot_mapping[:num_tokens].copy_(meta.slot_mapping)
        self.slot_mapping[num_tokens:size].fill_(self.scratch_slot)
        bucket = self.buckets.get(size) if self.use_graphs else None
        if self.use_graphs and bucket is None:
            bucket = self._capture(size)
        q, attended, hidden, residual = self.q[:num_tokens], self.attended[:num_tokens], None, None
        for index in range(len(self.layers) + 1):
            if bucket is not None:
                bucket.graphs[index].replay()
            else:
                hidden, residual = self._piece(index, size, residual)
            if index < len(self.layers):
                self.layers[index].self_attn.attn.attend(q, meta, out=attended)
        return (bucket.hidden if bucket is not None else hidden)[:num_tokens]
