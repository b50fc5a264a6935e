"""The per-row host arrays of a decode batch (padded block tables, sampling seeds and parameters, prompt lengths),
kept from one decode step to the next so that a steady decode step does not rebuild them from every sequence's
Python lists: rows of sequences that left are dropped, a sequence that joined gets its row built once, and a row
whose sequence grew a block gets that block id written (all such rows in one assignment). When the batch holds the
same sequences in the same order as the step before (the common decode step), nothing is re-gathered.

Numpy, no torch. Valid across consecutive decode steps only: the model runner clears it when a step runs eagerly
(prefill) and when the KV cache is freed. Between two consecutive decode steps a sequence cannot be preempted and
readmitted with a new block table (the scheduler never readmits in the step that preempted, so the sequence is absent
from one of the two batches and its row is dropped). Not the step's per-token inputs
(positions, slots, token ids: those change every step and the model runner computes them).
"""

from __future__ import annotations

import itertools

import numpy as np

from slime.engine.sequence import Sequence


def _block_at(seq: Sequence, index: int) -> int:
    return seq.block_table[index]


def sampling_values(params, vocab_size: int) -> tuple[float, float, float, int, bool]:
    """(temperature, top_p, min_p, top_k, needs_filtering) of one SamplingParams as the sampler takes them."""
    top_k = vocab_size if params.top_k == -1 else params.top_k
    top_p = params.top_p if params.top_p < 1.0 else 2.0  # 2.0: never cut by float round-off
    needs_filtering = params.top_k != -1 or params.top_p < 1.0 or params.min_p > 0.0
    return params.temperature, top_p, params.min_p, top_k, needs_filtering


class DecodeRows:
    def __init__(self, vocab_size: int, block_size: int):
        self.vocab_size = vocab_size
        self.block_size = block_size
        # Bumped whenever the rows may describe other sequences (so other sampling values); a steady decode step
        # keeps it, and the sampling inputs built from the rows' values can be reused (DecodeSampling).
        self.version = 0
        self.clear()

    def clear(self) -> None:
        self.seqs: list[Sequence] = []  # strong references: the ids in _row_of stay unique while cached
        self._row_of: dict[int, int] = {}
        self._allocate(0, 1)
        self.version += 1

    def _allocate(self, num_rows: int, width: int) -> None:
        self.block_tables = np.zeros((num_rows, width), dtype=np.int32)
        self.num_blocks = np.zeros(num_rows, dtype=np.int64)
        self.seeds = np.zeros(num_rows, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(num_rows, dtype=np.int64)
        self.float_params = np.zeros((3, num_rows), dtype=np.float32)  # temperature, top_p, min_p
        self.top_ks = np.zeros(num_rows, dtype=np.int64)
        self.needs_filtering = np.zeros(num_rows, dtype=bool)
        self.min_new_tokens = np.zeros(num_rows, dtype=np.int64)

    def _take(self, rows: np.ndarray, width: int) -> None:
        """Keep rows `rows` of every array, in that order; block tables padded to `width` columns."""
        tables = self.block_tables
        if width > tables.shape[1]:
            tables = np.pad(tables, ((0, 0), (0, width - tables.shape[1])))
        self.block_tables = tables[rows]
        self.seeds = self.seeds[rows]
        self.num_prompt_tokens = self.num_prompt_tokens[rows]
        self.float_params = self.float_params[:, rows]
        self.top_ks = self.top_ks[rows]
        self.needs_filtering = self.needs_filtering[rows]
        self.min_new_tokens = self.min_new_tokens[rows]

    def update(self, seqs: list[Sequence], positions: np.ndarray) -> None:
        """Make row i describe seqs[i], which computes the token at positions[i]. A row's table holds the blocks up
        to that position's (all its attention reads): computed from the positions, so that a steady decode step
        reads no sequence's table but those of the rows that crossed into a new block."""
        num_rows = len(seqs)
        num_blocks = positions // self.block_size + 1
        width = max(int(num_blocks.max()), self.block_tables.shape[1])
        if seqs == self.seqs:  # element by element `is` (Sequence has no __eq__), in C
            # The steady decode step: the same sequences in the same rows, some of which grew a block.
            if width > self.block_tables.shape[1]:
                self.block_tables = np.pad(self.block_tables, ((0, 0), (0, width - self.block_tables.shape[1])))
            self._write_changed_tables(seqs, self.num_blocks, num_blocks)
            self.num_blocks = num_blocks
            return
        old_rows = np.fromiter(map(self._row_of.get, map(id, seqs), itertools.repeat(-1)), dtype=np.int64,
                               count=num_rows)
        joined = old_rows < 0
        if joined.all():
            self._allocate(num_rows, int(num_blocks.max()))
            joined_rows = range(num_rows)
        else:
            old_rows[joined] = 0  # any row: rewritten below
            old_num_blocks = self.num_blocks[old_rows]
            old_num_blocks[joined] = num_blocks[joined]  # joined rows are written in full below
            self._take(old_rows, width)
            self._write_changed_tables(seqs, old_num_blocks, num_blocks)
            joined_rows = np.flatnonzero(joined).tolist()
        for row in joined_rows:
            self._write_table(row, seqs[row].block_table, int(num_blocks[row]))
            self._fill_request_row(row, seqs[row])
        self.num_blocks = num_blocks
        self.seqs = seqs
        self._row_of = dict(zip(map(id, seqs), range(num_rows)))
        self.version += 1

    def _write_table(self, row: int, table: list[int], num_blocks: int) -> None:
        self.block_tables[row, :num_blocks] = table[:num_blocks]
        self.block_tables[row, num_blocks:] = 0

    def _write_changed_tables(self, seqs: list[Sequence], old_num_blocks: np.ndarray, num_blocks: np.ndarray) -> None:
        """Rewrite the rows whose table length changed since it was written. A decode step appends at most one
        block to a table (at a block boundary, every sequence of that length at once): those rows get the new
        block id in one vectorised assignment; any other change rewrites the row."""
        grown_by = num_blocks - old_num_blocks
        changed = np.flatnonzero(grown_by)
        if not len(changed):
            return
        for row in changed[grown_by[changed] != 1].tolist():
            self._write_table(row, seqs[row].block_table, int(num_blocks[row]))
        grew_one = changed[grown_by[changed] == 1]
        last_blocks = num_blocks[grew_one] - 1
        self.block_tables[grew_one, last_blocks] = np.fromiter(
            map(_block_at, map(seqs.__getitem__, grew_one.tolist()), last_blocks.tolist()), dtype=np.int32,
            count=len(grew_one))

    def _fill_request_row(self, row: int, seq: Sequence) -> None:
        params = seq.sampling_params
        temperature, top_p, min_p, top_k, needs_filtering = sampling_values(params, self.vocab_size)
        self.seeds[row] = seq.seed
        self.num_prompt_tokens[row] = seq.num_prompt_tokens
        self.float_params[:, row] = (temperature, top_p, min_p)
        self.top_ks[row] = top_k
        self.needs_filtering[row] = needs_filtering
        self.min_new_tokens[row] = params.min_new_tokens
