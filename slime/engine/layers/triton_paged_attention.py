"""Paged attention as one Triton kernel: every query token (prefill chunk or decode) attends its sequence's cached
keys and values read straight from the block cache through the block table, with no gather copy and no padding.

One program handles one sequence, one KV head and BLOCK_M rows, where a row is (query token, query head of that
KV head's group), so grouped-query heads share each K/V tile they load. The step's own K/V must already be in the
cache (`PagedAttention` writes it first). Causal within the chunk: query i of a sequence with `seq_len` tokens
(after this step) sits at position seq_len - query_len + i and sees keys at positions <= its own. A sequence with
seq_len 0 (a padded CUDA-graph row) outputs zeros. Not a kernel for the CPU: there the pure-torch path runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DECODE_BLOCK_M = 16  # tl.dot needs at least 16 rows; a decode token brings only num_heads / num_kv_heads rows
PREFILL_BLOCK_M = 64
BLOCK_N = 64


# The block-table width changes from step to step: one compiled kernel for all widths, not one per divisibility.
@triton.jit(do_not_specialize=["stride_block_table"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    scale,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_block_table,
    NUM_QUERIES_PER_KV: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    row_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    if row_block * BLOCK_M >= query_len * NUM_QUERIES_PER_KV:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_query_position = seq_len - query_len

    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    query_index = rows // NUM_QUERIES_PER_KV
    head = kv_head * NUM_QUERIES_PER_KV + rows % NUM_QUERIES_PER_KV
    row_valid = query_index < query_len
    offs_d = tl.arange(0, HEAD_DIM)
    q_offsets = (query_start + query_index).to(tl.int64)[:, None] * stride_q_token + head[:, None] * stride_q_head
    q = tl.load(q_ptr + q_offsets + offs_d[None, :], mask=row_valid[:, None], other=0.0)
    query_position = first_query_position + query_index

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Keys past the last query of this row block are causally invisible to all of its rows.
    last_query_index = tl.minimum(query_len, (row_block + 1) * BLOCK_M // NUM_QUERIES_PER_KV + 1) - 1
    kv_end = tl.minimum(seq_len, first_query_position + last_query_index + 1)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_valid = offs_n < kv_end
        block_ids = tl.load(block_table_row + offs_n // KV_BLOCK_SIZE, mask=key_valid, other=0)
        slot_offsets = (
            block_ids.to(tl.int64) * stride_cache_block
            + (offs_n % KV_BLOCK_SIZE) * stride_cache_slot
            + kv_head * stride_cache_head
        )
        k = tl.load(k_cache_ptr + slot_offsets[None, :] + offs_d[:, None], mask=key_valid[None, :], other=0.0)
        if IEEE_DOT:
            scores = tl.dot(q, k, input_precision="ieee")
        else:
            scores = tl.dot(q, k)
        visible = (offs_n[None, :] <= query_position[:, None]) & key_valid[None, :]
        scores = tl.where(visible, scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet: avoid inf - inf
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + slot_offsets[:, None] + offs_d[None, :], mask=key_valid[:, None], other=0.0)
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_offsets = (query_start + query_index).to(tl.int64)[:, None] * stride_out_token + head[:, None] * stride_out_head
    tl.store(out_ptr + out_offsets + offs_d[None, :], acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim]; caches [num_blocks, block_size, num_kv_heads, head_dim];
    block_tables [num_seqs, max_num_blocks] int32; query_start_loc [num_seqs + 1] int32 (cumulative query lengths);
    seq_lens [num_seqs] int32 (tokens in the cache after this step). Returns [num_tokens, num_heads, head_dim]."""
    _, num_heads, head_dim = q.shape
    _, kv_block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    assert head_dim & (head_dim - 1) == 0 and head_dim >= 16, "head_dim must be a power of two >= 16"
    num_queries_per_kv = num_heads // num_kv_heads
    out = torch.empty_like(q)
    num_rows = max_query_len * num_queries_per_kv
    block_m = DECODE_BLOCK_M if num_rows <= DECODE_BLOCK_M else PREFILL_BLOCK_M
    num_seqs = block_tables.shape[0]
    grid = (num_seqs, triton.cdiv(num_rows, block_m), num_kv_heads)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        NUM_QUERIES_PER_KV=num_queries_per_kv,
        KV_BLOCK_SIZE=kv_block_size,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        IEEE_DOT=q.dtype == torch.float32,
        num_warps=4,
    )
    return out
