"""The per-step plan rank 0 sends to the other ranks of a sharded engine, as raw bytes (no pickling on the step path).

A plan is one message: a fixed header of int64s, then flat numpy arrays back to back. Two step kinds:
- FORWARD: an eager (or piecewise-graphed) forward over a flat batch: `FlatArrays` (each sequence's start, new-token
  count, sampling flag and LoRA slot, the new tokens, the padded block tables); the receiving rank rebuilds the step's tensors
  with `step_inputs.flat_batch` exactly as rank 0 did. `ALL_LOGITS` asks for every token's logits (scoring).
- DECODE_GRAPH: a decode step replayed from the CUDA graphs: the graphs' token inputs [4, num_seqs] (token ids,
  positions, cache slots, context lengths), block tables and each row's LoRA slot.
Control messages (weight loads, memory release, process-group set-up) are rare and go pickled (`CALL`); `STOP` ends a
rank's loop. A message is about 8 bytes per token and 4 per block-table entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slime.engine.step_inputs import FlatArrays

FORWARD, DECODE_GRAPH, CALL, STOP = 1, 2, 3, 4
ALL_LOGITS = 1  # FORWARD flag: logits of every token, not only the sampled rows'
HEADER_LEN = 6  # op, flags, num_seqs, num_tokens, max_num_blocks, reserved
_HEADER_BYTES = 8 * HEADER_LEN


@dataclass
class DecodeGraphInputs:
    token_inputs: np.ndarray  # [4, num_seqs] int64
    block_tables: np.ndarray  # [num_seqs, max_num_blocks] int32
    lora_slots: np.ndarray  # [num_seqs] int64: each row's LoRA slot (-1: none)


def _header(op: int, flags: int = 0, num_seqs: int = 0, num_tokens: int = 0, num_blocks: int = 0) -> bytes:
    return np.array([op, flags, num_seqs, num_tokens, num_blocks, 0], dtype=np.int64).tobytes()


def encode_forward(arrays: FlatArrays, all_logits: bool = False) -> bytes:
    num_seqs, max_blocks = arrays.block_tables.shape
    return b"".join((
        _header(FORWARD, ALL_LOGITS if all_logits else 0, num_seqs, len(arrays.input_ids), max_blocks),
        np.ascontiguousarray(arrays.starts, dtype=np.int64).tobytes(),
        np.ascontiguousarray(arrays.query_lens, dtype=np.int64).tobytes(),
        np.ascontiguousarray(arrays.needs_sample, dtype=np.bool_).tobytes(),
        np.ascontiguousarray(arrays.input_ids, dtype=np.int64).tobytes(),
        np.ascontiguousarray(arrays.block_tables, dtype=np.int32).tobytes(),
        np.ascontiguousarray(arrays.lora_slots, dtype=np.int64).tobytes(),
    ))


def encode_decode_graph(inputs: DecodeGraphInputs) -> bytes:
    num_seqs, max_blocks = inputs.block_tables.shape
    return b"".join((
        _header(DECODE_GRAPH, 0, num_seqs, num_seqs, max_blocks),
        np.ascontiguousarray(inputs.token_inputs, dtype=np.int64).tobytes(),
        np.ascontiguousarray(inputs.block_tables, dtype=np.int32).tobytes(),
        np.ascontiguousarray(inputs.lora_slots, dtype=np.int64).tobytes(),
    ))


def encode_control(op: int) -> bytes:
    return _header(op)


def decode(message: bytes) -> tuple[int, int, FlatArrays | DecodeGraphInputs | None]:
    """(op, flags, payload) of a message: FlatArrays for FORWARD, DecodeGraphInputs for DECODE_GRAPH, else None."""
    op, flags, num_seqs, num_tokens, max_blocks, _ = np.frombuffer(message, dtype=np.int64, count=HEADER_LEN).tolist()
    reader = _Reader(message, _HEADER_BYTES)
    if op == FORWARD:
        payload = FlatArrays(
            starts=reader.take(np.int64, num_seqs),
            query_lens=reader.take(np.int64, num_seqs),
            needs_sample=reader.take(np.bool_, num_seqs),
            input_ids=reader.take(np.int64, num_tokens),
            block_tables=reader.take(np.int32, num_seqs * max_blocks).reshape(num_seqs, max_blocks),
            lora_slots=reader.take(np.int64, num_seqs),
        )
    elif op == DECODE_GRAPH:
        payload = DecodeGraphInputs(reader.take(np.int64, 4 * num_seqs).reshape(4, num_seqs),
                                    reader.take(np.int32, num_seqs * max_blocks).reshape(num_seqs, max_blocks),
                                    reader.take(np.int64, num_seqs))
    elif op in (CALL, STOP):
        return op, flags, None  # a call's pickled (target, args, kwargs) follow the header
    else:
        raise ValueError(f"unknown step-plan op {op}")
    if reader.offset != len(message):
        raise ValueError(f"step plan of op {op}: {len(message) - reader.offset} bytes left over (sender and receiver "
                         "disagree on the format)")
    return op, flags, payload


class _Reader:
    def __init__(self, message: bytes, offset: int):
        self.message, self.offset = message, offset

    def take(self, dtype, count: int) -> np.ndarray:
        array = np.frombuffer(self.message, dtype=dtype, count=count, offset=self.offset)
        self.offset += array.nbytes
        return array
