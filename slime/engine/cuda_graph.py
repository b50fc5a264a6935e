"""CUDA graphs of the model's decode forward (one new token per sequence, Triton attention) at bucketed batch
sizes, replayed with static input buffers so a decode step costs a few copies and one graph launch instead of
hundreds of kernel launches from Python.

A batch of n sequences runs in the smallest bucket >= n; the padded rows write their K/V to a scratch cache slot
that no sequence owns and attend nothing (seq_len 0). Graphs bake in the addresses of the weights and the KV cache.
A release of either that keeps the graphs' own memory (no `cuda_graph` tag; the colocated loop's) parks them
(`ParkedGraphs`) with those addresses, and the resume takes them back when every address came back the same (the
weights and the KV cache live at fixed addresses where the driver allows, device_arena.py); otherwise, and after a
release of `cuda_graph`, the model runner drops them and builds a new DecodeGraphs on the next decode step. The
first one captures every bucket up front (kernel compilation happens at start-up, not mid-run); later ones capture a
bucket when a batch first needs it, since re-capturing all of them took 0.55-0.73 s per rollout on an H200 while a
rollout uses a few (each lazy capture still cost 10-45 ms of a rollout). Not used for prefill,
on CPU, with enforce_eager, or beyond the largest bucket (the eager path runs those).
"""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import torch
from torch import nn

from slime.engine.host_staging import HostStaging
from slime.engine.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def slots_on_scratch(slot_mapping: torch.Tensor, scratch_slot: int):
    """While capturing (and warming up): every row of `slot_mapping` writes its K/V to the scratch slot that no
    sequence owns; the rows' slots are put back after."""
    saved = slot_mapping.clone()
    slot_mapping.fill_(scratch_slot)
    try:
        yield
    finally:
        slot_mapping.copy_(saved)


def bucket_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to max_num_seqs (rounded up to a multiple of 16 past 8)."""
    largest = max_num_seqs if max_num_seqs <= 8 else -(-max_num_seqs // 16) * 16
    return sorted({size for size in (1, 2, 4, 8) if size < largest} | set(range(16, largest, 16)) | {largest})


class DecodeGraphs:
    def __init__(self, model: nn.Module, max_num_seqs: int, max_num_blocks_per_seq: int, scratch_slot: int,
                 staging: HostStaging, capture_all: bool = True, capture_stats: dict | None = None,
                 warmed_batch_sizes: set[int] | None = None):
        self.model = model
        # batch sizes whose forward ran in this process before (kernels compiled and tuned for them): a capture
        # again after a memory release (lazy, inside a rollout) skips the warm-up forward; kept by the owner
        self.warmed_batch_sizes = warmed_batch_sizes if warmed_batch_sizes is not None else set()
        # graphs captured and seconds spent (warm-up forward included), summed by the owner across DecodeGraphs
        self.capture_stats = capture_stats if capture_stats is not None else {"graphs": 0, "seconds": 0.0}
        self.staging = staging
        self.batch_sizes = bucket_batch_sizes(max_num_seqs)
        self.scratch_slot = scratch_slot
        max_batch_size = self.batch_sizes[-1]
        device = next(model.parameters()).device
        hidden_size = model.config.hidden_size
        dtype = next(model.parameters()).dtype
        # One int64 buffer for the per-token inputs, so a step's host data arrives in one copy.
        self.token_inputs = torch.zeros(4, max_batch_size, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens = self.token_inputs
        self.block_tables = torch.zeros(max_batch_size, max_num_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch_size + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(max_batch_size, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None  # one memory pool for every bucket's graph: they never run at the same time
        if capture_all:
            self._capture_all()

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def _metadata(self, batch_size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch_size],
            block_tables=self.block_tables[:batch_size],
            max_query_len=1,
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
        )

    def _forward(self, batch_size: int) -> None:
        meta = self._metadata(batch_size)
        self.hidden[:batch_size] = self.model(self.input_ids[:batch_size], self.positions[:batch_size], meta)

    def _capture_all(self) -> None:
        """Capture every bucket, largest first (the smaller graphs reuse its memory pool); its time is logged."""
        started = time.perf_counter()
        for batch_size in reversed(self.batch_sizes):
            self._capture(batch_size)
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes up to %d) in %.2f s", len(self.graphs),
                    self.batch_sizes[-1], time.perf_counter() - started)

    def _capture(self, batch_size: int) -> None:
        """Capture one bucket, after a warm-up forward the first time this process captures its size (Triton
        compilation and tuning, cuBLAS workspaces). The warm-up writes K/V only to the scratch slot (the slots it
        reads are those of the last replay or zeros) and its hidden rows are overwritten by the replay that
        follows."""
        started = time.perf_counter()
        with slots_on_scratch(self.slot_mapping[:batch_size], self.scratch_slot):
            if batch_size not in self.warmed_batch_sizes:
                self._forward(batch_size)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._forward(batch_size)
        self.pool = graph.pool() if self.pool is None else self.pool
        self.graphs[batch_size] = graph
        self.warmed_batch_sizes.add(batch_size)
        self.capture_stats["graphs"] += 1
        self.capture_stats["seconds"] += time.perf_counter() - started

    def run(self, token_inputs: np.ndarray, block_tables: np.ndarray, input_tokens: torch.Tensor | None = None,
            input_rows: torch.Tensor | None = None) -> torch.Tensor:
        """token_inputs [4, n] int64 (input ids, positions, slots, seq_lens); block_tables [n, w] int32;
        input_tokens [n] on the device, if given, replaces the input ids (tokens the host has not seen yet), or
        only those of `input_rows` (on the device) when given.
        Returns hidden states [n, hidden_size] (a view into a static buffer, valid until the next run)."""
        num_seqs, width = block_tables.shape
        batch_size = next(size for size in self.batch_sizes if size >= num_seqs)
        padded = np.empty((4, batch_size), dtype=np.int64)
        padded[:, :num_seqs] = token_inputs
        padded[:, num_seqs:] = np.array([0, 0, self.scratch_slot, 0])[:, None]
        self.staging.copy_(self.token_inputs[:, :batch_size], padded)
        self.staging.copy_(self.block_tables[:num_seqs, :width], block_tables)
        if input_rows is not None:
            self.input_ids[input_rows] = input_tokens
        elif input_tokens is not None:
            self.input_ids[:num_seqs].copy_(input_tokens)
        if batch_size not in self.graphs:
            self._capture(batch_size)
        self.graphs[batch_size].replay()
        return self.hidden[:num_seqs]


def baked_addresses(model: nn.Module, *tensors: torch.Tensor | None) -> tuple[int, ...]:
    """The device addresses a decode graph bakes in that a memory release frees: every weight's, and `tensors`'
    (the KV cache, the routed-experts record; None: not allocated)."""
    return (*(param.data_ptr() for param in model.parameters()),
            *(tensor.data_ptr() if tensor is not None else 0 for tensor in tensors))


class ParkedGraphs:
    """CUDA graphs (DecodeGraphs, or prefill_graphs.PrefillGraphs: `kind` names them in the log) set aside while
    the memory they read is released, with the addresses they bake in."""

    def __init__(self, kind: str = "decode"):
        self.kind = kind
        self.graphs = None
        self.addresses: tuple[int, ...] = ()

    def park(self, graphs, addresses: tuple[int, ...]) -> None:
        self.graphs, self.addresses = graphs, addresses

    def take(self, addresses: tuple[int, ...]):
        """The parked graphs if `addresses` (after a resume) are those they bake in, else None; either way they
        leave the parking (graphs not taken are freed with their memory pool)."""
        graphs, same = self.graphs, addresses == self.addresses
        self.clear()
        if graphs is not None:
            logger.info("%s CUDA graphs %s", self.kind, "kept across the release (weights and KV cache at the same "
                        "addresses)" if same else "dropped: the resume moved the weights or the KV cache")
        return graphs if same else None

    def clear(self) -> None:
        self.graphs, self.addresses = None, ()
