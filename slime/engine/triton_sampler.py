"""The sampler's Gumbel-max draw as one Triton kernel: argmax over the vocabulary of probs / Exp(1) noise, with the
noise computed in registers from the same counter-based hash as `sampler.exponential_noise` (so the same tokens),
instead of materialising [num_rows, vocab] float64 noise and integer temporaries in device memory.

Ties go to the lowest index, as torch.argmax. A CUDA fast path only: the CPU and the reference stay in `sampler.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 1024
NUM_CHUNKS = 16


@triton.jit
def _hash32(x):
    # uint32 wrap-around arithmetic equals sampler._hash32's int64 arithmetic masked to 32 bits.
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _gumbel_argmax_kernel(
    probs_ptr, row_keys_ptr, best_score_ptr, best_index_ptr, vocab_size, stride_row, chunk_size, BLOCK_V: tl.constexpr
):
    """Program (row, chunk): the best (score, lowest index) of columns [chunk * chunk_size, + chunk_size)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row_key = tl.load(row_keys_ptr + row).to(tl.uint32)
    best_score = tl.full([BLOCK_V], -1.0, dtype=tl.float64)
    best_index = tl.zeros([BLOCK_V], dtype=tl.int32)
    row_ptr = probs_ptr + row.to(tl.int64) * stride_row
    chunk_start = chunk * chunk_size
    chunk_end = tl.minimum(chunk_start + chunk_size, vocab_size)
    for start in range(chunk_start, chunk_end, BLOCK_V):
        columns = start + tl.arange(0, BLOCK_V)
        valid = columns < chunk_end
        probs = tl.load(row_ptr + columns, mask=valid, other=0.0).to(tl.float64)
        bits = _hash32(_hash32(row_key ^ columns.to(tl.uint32)) + row_key)
        uniform = (bits.to(tl.float64) + 0.5) / 4294967296.0
        score = tl.where(valid, probs / -tl.log(uniform), -1.0)
        better = score > best_score  # strict: an earlier column keeps a tie
        best_score = tl.where(better, score, best_score)
        best_index = tl.where(better, columns, best_index)
    top = tl.max(best_score, 0)
    index = tl.min(tl.where(best_score == top, best_index, vocab_size), 0)
    num_chunks = tl.num_programs(1)
    tl.store(best_score_ptr + row * num_chunks + chunk, top)
    tl.store(best_index_ptr + row * num_chunks + chunk, index.to(tl.int64))


def gumbel_argmax(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """probs [num_rows, vocab] float32 (rows sum to 1), seeds / steps [num_rows] int64 -> token ids [num_rows].
    The vocabulary is split into chunks (enough programs to fill the GPU at small batches); per-chunk winners are
    reduced with torch.argmax, whose first-maximum rule keeps the lowest index on ties, as within a chunk."""
    from slime.engine.sampler import noise_row_keys

    probs = probs.contiguous()
    num_rows, vocab_size = probs.shape
    if not num_rows:
        return torch.empty(0, dtype=torch.int64, device=probs.device)
    num_chunks = min(NUM_CHUNKS, triton.cdiv(vocab_size, BLOCK_V))
    chunk_size = triton.cdiv(triton.cdiv(vocab_size, num_chunks), BLOCK_V) * BLOCK_V
    num_chunks = triton.cdiv(vocab_size, chunk_size)
    best_score = torch.empty(num_rows, num_chunks, dtype=torch.float64, device=probs.device)
    best_index = torch.empty(num_rows, num_chunks, dtype=torch.int64, device=probs.device)
    row_keys = noise_row_keys(seeds, steps).contiguous()
    _gumbel_argmax_kernel[(num_rows, num_chunks)](
        probs, row_keys, best_score, best_index, vocab_size, probs.stride(0), chunk_size, BLOCK_V=BLOCK_V
    )
    return best_index.gather(1, best_score.argmax(1, keepdim=True)).squeeze(1)
