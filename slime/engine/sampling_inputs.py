"""A step's per-row sampling tensors (SamplingBatch) from its sequences' SamplingParams: for any batch from the
sequences themselves (two host-to-device copies: int64 and float32 rows), for a decode-graph batch from the rows
DecodeRows keeps across steps (DecodeSampling: one copy per steady decode step). Not the sampling itself
(`sampler.py`).
"""

from __future__ import annotations

import numpy as np

from slime.engine.decode_rows import DecodeRows, sampling_values
from slime.engine.host_staging import HostStaging
from slime.engine.sampler import SamplingBatch
from slime.engine.scheduled_batch import ScheduledSequence


def prepare_sampling(sampled: list[ScheduledSequence], vocab_size: int, staging: HostStaging,
                     eos_token_ids: set[int]) -> SamplingBatch:
    """The rows that sample, in order. Each distinct SamplingParams object is read once per step."""
    num_rows = len(sampled)
    seqs = [item.seq for item in sampled]
    params_of_rows = [seq.sampling_params for seq in seqs]
    distinct = {id(params): params for params in params_of_rows}
    values = {key: sampling_values(params, vocab_size) for key, params in distinct.items()}
    if len(values) == 1:
        (only,) = values.values()
        float_columns = np.broadcast_to(np.array(only[:3], dtype=np.float32)[:, None], (3, num_rows))
        top_ks = np.full(num_rows, only[3], dtype=np.int64)
    else:
        rows = [values[id(params)] for params in params_of_rows]
        float_columns = np.array([row[:3] for row in rows], dtype=np.float32).T
        top_ks = np.fromiter((row[3] for row in rows), dtype=np.int64, count=num_rows)
    seeds = np.fromiter((seq.seed for seq in seqs), dtype=np.int64, count=num_rows)
    steps = np.fromiter((len(seq.token_ids) - seq.num_prompt_tokens for seq in seqs), dtype=np.int64, count=num_rows)
    banned = ([], [])
    if any(params.min_new_tokens > 0 for params in distinct.values()):
        banned = _banned_stop_tokens(zip(range(num_rows), params_of_rows, steps.tolist()), vocab_size, eos_token_ids)
    return _sampling_batch(
        staging, float_columns, top_ks, seeds, steps, *banned,
        needs_filtering=any(value[4] for value in values.values()),
        all_greedy=not any(value[0] for value in values.values()),
        any_greedy=any(value[0] == 0 for value in values.values()),
    )


class DecodeSampling:
    """prepare_sampling for a decode-graph batch (every row samples), from the rows' cached sampling values. Those
    change only when the rows do (DecodeRows.version): their device tensors are sent once and reused by the steady
    decode steps that follow, which send only the rows' step counts and banned tokens (one transfer, not two)."""

    def __init__(self, staging: HostStaging, eos_token_ids: set[int]):
        self.staging = staging
        self.eos_token_ids = eos_token_ids
        self._version = None
        self._row_values: dict = {}  # the SamplingBatch fields that depend on the rows only

    def build(self, rows: DecodeRows, positions: np.ndarray) -> SamplingBatch:
        steps = positions + 1 - rows.num_prompt_tokens  # tokens generated so far, the one being computed included
        banned_rows, banned_token_ids = [], []
        if (steps < rows.min_new_tokens).any():
            params_of_rows = [seq.sampling_params for seq in rows.seqs]
            banned_rows, banned_token_ids = _banned_stop_tokens(
                zip(range(len(rows.seqs)), params_of_rows, steps.tolist()), rows.vocab_size, self.eos_token_ids)
        if rows.version != self._version:
            temperatures = rows.float_params[0]
            top_ks, seeds = self.staging.to_device_packed([rows.top_ks, rows.seeds], np.int64)
            float_tensors = self.staging.to_device_packed(list(rows.float_params), np.float32)
            self._row_values = dict(
                zip(("temperatures", "top_ps", "min_ps"), float_tensors), top_ks=top_ks, seeds=seeds,
                needs_filtering=bool(rows.needs_filtering.any()),
                all_greedy=not temperatures.any(),
                any_greedy=not temperatures.all(),
            )
            self._version = rows.version
        steps, banned_rows, banned_token_ids = self.staging.to_device_packed(
            [steps, np.array(banned_rows, dtype=np.int64), np.array(banned_token_ids, dtype=np.int64)], np.int64)
        return SamplingBatch(steps=steps, banned_rows=banned_rows, banned_token_ids=banned_token_ids,
                             **self._row_values)


def _banned_stop_tokens(rows, vocab_size: int, eos_token_ids: set[int]) -> tuple[list[int], list[int]]:
    """(row, token) pairs masked out of sampling: the stop tokens of each (row, params, step) whose step is still
    under its min_new_tokens."""
    banned_rows, banned_token_ids = [], []
    for row, params, step in rows:
        if step < params.min_new_tokens:
            stop_ids = set(params.stop_token_ids)
            if not params.ignore_eos:
                stop_ids |= eos_token_ids
            for token_id in sorted(t for t in stop_ids if t < vocab_size):
                banned_rows.append(row)
                banned_token_ids.append(token_id)
    return banned_rows, banned_token_ids


def _sampling_batch(staging: HostStaging, float_columns, top_ks, seeds, steps, banned_rows, banned_token_ids,
                    **flags) -> SamplingBatch:
    int_tensors = staging.to_device_packed(
        [top_ks, seeds, steps, np.array(banned_rows, dtype=np.int64), np.array(banned_token_ids, dtype=np.int64)],
        np.int64,
    )
    temperatures, top_ps, min_ps = staging.to_device_packed(list(float_columns), np.float32)
    return SamplingBatch(
        temperatures=temperatures,
        top_ks=int_tensors[0],
        top_ps=top_ps,
        min_ps=min_ps,
        seeds=int_tensors[1],
        steps=int_tensors[2],
        banned_rows=int_tensors[3],
        banned_token_ids=int_tensors[4],
        **flags,
    )
