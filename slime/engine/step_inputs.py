"""The flat token batch of one engine step: every scheduled sequence's new tokens back to back, with their
positions, cache slots, the rows that sample, and the attention metadata (Triton: block tables, query offsets,
context lengths; pure torch: expanded key slots and a mask), moved to the device in packed copies. Not the decode
graphs' inputs (decode_rows.py builds those incrementally)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from slime.engine.host_staging import HostStaging
from slime.engine.layers.attention import AttentionMetadata
from slime.engine.scheduled_batch import ScheduledSequence


@dataclass
class FlatArrays:
    """A step's batch on the host, all a rank needs to rebuild the step's tensors (engine/parallel/step_plan.py sends
    it to the other ranks): per sequence its first new position, new-token count and whether it samples, the new
    tokens back to back, and the block tables padded with block 0."""

    starts: np.ndarray  # [num_seqs] int64
    query_lens: np.ndarray  # [num_seqs] int64
    needs_sample: np.ndarray  # [num_seqs] bool
    input_ids: np.ndarray  # [num_tokens] int64
    block_tables: np.ndarray  # [num_seqs, max_num_blocks] int32
    lora_slots: np.ndarray  # [num_seqs] int64: each sequence's LoRA slot (-1: none; engine/lora/registry.py)


def flat_arrays(scheduled: list[ScheduledSequence]) -> FlatArrays:
    num_seqs = len(scheduled)
    input_ids = []
    for item in scheduled:
        input_ids.extend(item.seq.token_ids[item.start : item.start + item.num_new_tokens])
    return FlatArrays(
        starts=np.fromiter((item.start for item in scheduled), dtype=np.int64, count=num_seqs),
        query_lens=np.fromiter((item.num_new_tokens for item in scheduled), dtype=np.int64, count=num_seqs),
        needs_sample=np.fromiter((item.needs_sample for item in scheduled), dtype=bool, count=num_seqs),
        input_ids=np.asarray(input_ids, dtype=np.int64),
        block_tables=_padded_block_tables([item.seq.block_table for item in scheduled]),
        lora_slots=np.fromiter((item.seq.lora_slot for item in scheduled), dtype=np.int64, count=num_seqs),
    )


def flat_batch(scheduled: list[ScheduledSequence] | FlatArrays, block_size: int, staging: HostStaging,
               use_triton: bool):
    """(input_ids, positions, AttentionMetadata, logits_indices) on the device; the metadata is filled for the
    Triton path (`use_triton`) or the torch path."""
    arrays = scheduled if isinstance(scheduled, FlatArrays) else flat_arrays(scheduled)
    starts, query_lens, block_tables = arrays.starts, arrays.query_lens, arrays.block_tables
    num_seqs, num_tokens = len(starts), len(arrays.input_ids)
    cu_seqlens = np.cumsum(query_lens)
    token_seq_index = np.repeat(np.arange(num_seqs), query_lens)
    token_query_index = np.arange(num_tokens) - (cu_seqlens - query_lens)[token_seq_index]
    positions = starts[token_seq_index] + token_query_index
    slot_mapping = (
        block_tables[token_seq_index, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )
    logits_indices = (cu_seqlens - 1)[arrays.needs_sample]
    max_query_len = int(query_lens.max())
    to_device = staging.to_device
    input_ids_t, positions_t, slot_mapping_t, logits_indices_t = staging.to_device_packed(
        [arrays.input_ids, positions, slot_mapping, logits_indices], np.int64
    )
    if use_triton:
        query_start_loc, seq_lens, flat_tables = staging.to_device_packed(
            [np.concatenate([[0], cu_seqlens]), starts + query_lens, block_tables.ravel()], np.int32
        )
        meta = AttentionMetadata(
            slot_mapping=slot_mapping_t,
            block_tables=flat_tables.view(block_tables.shape),
            max_query_len=max_query_len,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
        )
        return input_ids_t, positions_t, meta, logits_indices_t
    query_positions = starts[:, None] + np.arange(max_query_len)[None, :]
    query_positions = np.where(np.arange(max_query_len)[None, :] < query_lens[:, None], query_positions, 0)
    key_positions = np.arange(block_tables.shape[1] * block_size)
    attn_mask = (key_positions[None, None, :] <= query_positions[:, :, None])[:, None]
    key_slots = (block_tables.astype(np.int64)[:, :, None] * block_size + np.arange(block_size))
    meta = AttentionMetadata(
        slot_mapping=slot_mapping_t,
        block_tables=to_device(block_tables.astype(np.int64)),
        max_query_len=max_query_len,
        key_slots=to_device(key_slots.reshape(num_seqs, -1)),
        token_seq_index=to_device(token_seq_index),
        token_query_index=to_device(token_query_index),
        attn_mask=to_device(attn_mask),
    )
    return input_ids_t, positions_t, meta, logits_indices_t


def _padded_block_tables(tables: list[list[int]]) -> np.ndarray:
    """[num_seqs, longest table] int32, padded with block 0 (never read: masked by context lengths)."""
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    padded = np.zeros((len(tables), int(lengths.max())), dtype=np.int32)
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lengths.sum()))
    padded[np.arange(padded.shape[1])[None, :] < lengths[:, None]] = flat  # row-major, as the chain
    return padded
