"""Absorbed multi-head latent attention (MLA) as a Triton kernel over the paged latent KV cache: every query token
(decode, and prefill chunks too) attends its sequence's latent rows read straight from the block cache through the
block table, with no gather copy and no expansion per head.

A cache row is [c_kv | k_pe]: LATENT_DIM (kv_lora_rank, 512 for DeepSeek-V3) + ROPE_DIM (qk_rope_head_dim, 64)
values; V is the same row's first LATENT_DIM values, so one load of a key tile serves both matmuls. An absorbed query
row is [q_nope · W_UK | q_pe] (576). All query heads share the one latent "head" (multi-query attention): one
program takes BLOCK_M rows, a row being a (query token, head) pair, so decode tiles up to BLOCK_M heads of one token
against each key tile it loads (the reuse that makes MLA decode cheap), and the dot product is split into the
latent block and the rope block (neither dim need be a power of two: both are padded and masked). The output is the
attended latent [num_tokens, heads, LATENT_DIM]; the caller applies W_UV.

Split-KV (flash-decoding) for decode when too few programs would fill the GPU, merged by the paged kernel's merge
kernel; the split count depends on shapes only, so a captured CUDA graph stays valid. The step's own latent rows
must already be in the cache. A sequence with seq_len 0 (a padded CUDA-graph row) outputs zeros. Not a kernel for
the CPU: there `latent_attention.py`'s torch path runs (tests run this one in Triton's interpreter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slime.engine.layers.triton_paged_attention import _merge_kv_splits_kernel, choose_num_kv_splits


@dataclass(frozen=True)
class MLAKernelConfig:
    block_m: int  # (token, head) rows per program; >= 16 for tensor-core tiles
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


# Untuned starting points (no GPU sweep yet): a [block_n, 576] key tile and a [block_m, 512] fp32 accumulator per
# program; benchmarks/bench_mla_decode.py --sweep is the place to tune them.
MLA_DECODE_CONFIG = MLAKernelConfig(block_m=16, block_n=32, num_warps=4, num_stages=2)
MLA_PREFILL_CONFIG = MLAKernelConfig(block_m=32, block_n=32, num_warps=4, num_stages=2)


@triton.jit(do_not_specialize=["stride_block_table"])
def _mla_attention_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,
    split_max_ptr,
    split_sum_ptr,
    block_tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    scale,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_split_stats_token,
    stride_split_stats_head,
    stride_cache_block,
    stride_cache_slot,
    stride_block_table,
    NUM_HEADS: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    LATENT_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_LATENT: tl.constexpr,
    BLOCK_ROPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    row_block = tl.program_id(1)
    split = tl.program_id(2)
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    if row_block * BLOCK_M >= query_len * NUM_HEADS:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_query_position = seq_len - query_len

    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    query_index = rows // NUM_HEADS
    head = rows % NUM_HEADS
    row_valid = query_index < query_len
    token = (query_start + query_index).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_LATENT)
    offs_r = tl.arange(0, BLOCK_ROPE)
    c_valid = offs_c < LATENT_DIM
    r_valid = offs_r < ROPE_DIM
    q_rows = q_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head
    q_c = tl.load(q_rows + offs_c[None, :], mask=row_valid[:, None] & c_valid[None, :], other=0.0)
    q_r = tl.load(q_rows + LATENT_DIM + offs_r[None, :], mask=row_valid[:, None] & r_valid[None, :], other=0.0)
    query_position = first_query_position + query_index
    qk_scale = scale * 1.4426950408889634  # times log2(e): softmax with exp2

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_LATENT], dtype=tl.float32)
    # Keys past the last query of this row block are causally invisible to all of its rows.
    last_query_index = tl.minimum(query_len, (row_block + 1) * BLOCK_M // NUM_HEADS + 1) - 1
    kv_end = tl.minimum(seq_len, first_query_position + last_query_index + 1)
    tiles_per_split = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), NUM_KV_SPLITS)
    kv_start = split * tiles_per_split * BLOCK_N
    kv_stop = tl.minimum(kv_end, kv_start + tiles_per_split * BLOCK_N)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    for start_n in range(kv_start, kv_stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_valid = offs_n < kv_stop
        block_ids = tl.load(block_table_row + offs_n // KV_BLOCK_SIZE, mask=key_valid, other=0)
        slots = block_ids.to(tl.int64) * stride_cache_block + (offs_n % KV_BLOCK_SIZE) * stride_cache_slot
        k_c = tl.load(cache_ptr + slots[:, None] + offs_c[None, :], mask=key_valid[:, None] & c_valid[None, :],
                      other=0.0).to(q_c.dtype)
        k_r = tl.load(cache_ptr + slots[:, None] + LATENT_DIM + offs_r[None, :],
                      mask=key_valid[:, None] & r_valid[None, :], other=0.0).to(q_r.dtype)
        if IEEE_DOT:
            scores = tl.dot(q_c, tl.trans(k_c), input_precision="ieee")
            scores = tl.dot(q_r, tl.trans(k_r), scores, input_precision="ieee")
        else:
            scores = tl.dot(q_c, tl.trans(k_c))
            scores = tl.dot(q_r, tl.trans(k_r), scores)
        visible = (offs_n[None, :] <= query_position[:, None]) & key_valid[None, :]
        scores = tl.where(visible, scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet: avoid inf - inf
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(k_c.dtype), k_c, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(k_c.dtype), k_c)
        m_i = m_new

    if NUM_KV_SPLITS == 1:
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_offsets = token[:, None] * stride_out_token + head[:, None] * stride_out_head + offs_c[None, :]
        tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & c_valid[None, :])
    else:
        # Unnormalized partials [token, head, split, :] plus the running max (log2 domain) and sum of this split.
        out_offsets = token[:, None] * stride_out_token + head[:, None] * stride_out_head + split * LATENT_DIM
        tl.store(out_ptr + out_offsets + offs_c[None, :], acc, mask=row_valid[:, None])
        stats_offsets = token * stride_split_stats_token + head * stride_split_stats_head + split
        tl.store(split_max_ptr + stats_offsets, m_i, mask=row_valid)
        tl.store(split_sum_ptr + stats_offsets, l_i, mask=row_valid)


def mla_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    latent_dim: int,
    *,
    num_kv_splits: int | None = None,
    config: MLAKernelConfig | None = None,
) -> torch.Tensor:
    """q [num_tokens, num_heads, latent_dim + rope_dim] (absorbed queries); cache [num_blocks, block_size, 1,
    latent_dim + rope_dim] in q's dtype; block_tables [num_seqs, max_num_blocks] int32; query_start_loc
    [num_seqs + 1] int32; seq_lens [num_seqs] int32 (tokens in the cache after this step). Returns the attended
    latent [num_tokens, num_heads, latent_dim] in q's dtype.

    `max_query_len`: most query tokens of one sequence (1: decode). `num_kv_splits` (a power of two) and `config`
    override the automatic choices (tests, benchmarks)."""
    num_tokens, num_heads, row_dim = q.shape
    num_blocks, kv_block_size, one_head, cache_row_dim = cache.shape
    assert one_head == 1 and cache_row_dim == row_dim and cache.stride(-1) == 1 and q.stride(-1) == 1
    rope_dim = row_dim - latent_dim
    num_seqs, max_num_blocks = block_tables.shape
    config = config or (MLA_DECODE_CONFIG if max_query_len == 1 else MLA_PREFILL_CONFIG)
    num_row_blocks = triton.cdiv(max_query_len * num_heads, config.block_m)
    block_latent = max(16, triton.next_power_of_2(latent_dim))
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(num_seqs, num_row_blocks, max_num_blocks * kv_block_size,
                                             max_query_len, config.block_n, q.device)
        if block_latent != latent_dim:  # the merge kernel reads whole power-of-two rows
            num_kv_splits = 1
    if num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1):
        raise ValueError(f"num_kv_splits must be a power of two >= 1, got {num_kv_splits}")
    out = q.new_empty(num_tokens, num_heads, latent_dim)
    if num_kv_splits == 1:
        kernel_out, split_max, split_sum = out, out, out  # the split buffers are not touched
    else:
        kernel_out = q.new_empty(num_tokens, num_heads, num_kv_splits, latent_dim, dtype=torch.float32)
        split_max = q.new_empty(num_tokens, num_heads, num_kv_splits, dtype=torch.float32)
        split_sum = torch.empty_like(split_max)
    grid = (num_seqs, num_row_blocks, num_kv_splits)
    _mla_attention_kernel[grid](
        q, cache, kernel_out, split_max, split_sum, block_tables, query_start_loc, seq_lens, scale,
        q.stride(0), q.stride(1), kernel_out.stride(0), kernel_out.stride(1), split_max.stride(0),
        split_max.stride(1), cache.stride(0), cache.stride(1), block_tables.stride(0),
        NUM_HEADS=num_heads, KV_BLOCK_SIZE=kv_block_size, LATENT_DIM=latent_dim, ROPE_DIM=rope_dim,
        BLOCK_LATENT=block_latent, BLOCK_ROPE=max(16, triton.next_power_of_2(rope_dim)), BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, NUM_KV_SPLITS=num_kv_splits, IEEE_DOT=q.dtype == torch.float32,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if num_kv_splits > 1:
        _merge_kv_splits_kernel[(num_tokens, num_heads)](
            kernel_out, split_max, split_sum, out, kernel_out.stride(0), kernel_out.stride(1), split_max.stride(0),
            split_max.stride(1), out.stride(0), out.stride(1), NUM_KV_SPLITS=num_kv_splits, HEAD_DIM=latent_dim,
            num_warps=4,
        )
    return out
