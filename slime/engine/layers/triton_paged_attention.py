"""Paged attention as Triton kernels: every query token (prefill chunk or decode) attends its sequence's cached keys
and values read straight from the block cache through the block table, with no gather copy and no padding.

One program handles one sequence, one KV head and BLOCK_M rows, where a row is (query token, query head of that
KV head's group), so grouped-query heads share each K/V tile they load. K and V tiles are loaded as
[BLOCK_N, HEAD_DIM], the cache's contiguous axis last, so each key is one run of HEAD_DIM elements. An fp8 cache
with bf16 queries is computed in fp16 (FP8_KV_IN_FP16): e4m3 -> fp16 is one native conversion per two elements on
Hopper (e4m3 -> bf16 goes through fp32), exact, and fp16 keeps more of q's and p's mantissa than bf16.

- Prefill (any chunk of more than one query token): BLOCK_M = 64 rows, QK^T and PV on tensor cores (`tl.dot`).
- Decode (one query token per sequence), multi-head (one query head per KV head): BLOCK_M = 1, no tensor cores,
  a broadcast multiply and a sum in registers. Grouped-query heads: BLOCK_M = 16 rows (the group, padded) on
  tensor cores over 16-key tiles on one warp. Decode is bound by reading K/V: the decode configs below are the
  ones to tune with `benchmarks/bench_paged_attention.py --sweep`, at contexts that are not multiples of a tile.
- Split-KV (flash-decoding): when there are too few (sequence, KV head) programs to fill the GPU, each one is
  split into NUM_KV_SPLITS programs over consecutive key ranges that write unnormalized partial results, and a
  second kernel merges them. The split count depends only on shapes (batch size, heads, block-table width, SM
  count), and each program computes its key range on the device from seq_lens, so a captured CUDA graph stays
  valid when it is replayed with other lengths and block tables.

The step's own K/V must already be in the cache (`PagedAttention` writes it first). Causal within the chunk:
query i of a sequence with `seq_len` tokens (after this step) sits at position seq_len - query_len + i and sees
keys at positions <= its own. A sequence with seq_len 0 (a padded CUDA-graph row) outputs zeros. Not a kernel for
the CPU: there the pure-torch path runs (the tests run it in Triton's interpreter).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Above this many query heads per KV head, decode uses tensor cores (BLOCK_M >= 16). Measured on an H200 (Qwen3-0.6B
# shape, GQA 2, bf16): the register path ran at 213-367 us per call against 84-95 us for the tensor-core one.
MAX_REGISTER_DECODE_GROUP = 1
MAX_KV_SPLITS = 16
SPLIT_KV_TARGET_PROGRAMS_PER_SM = 4  # split decode until (seqs x KV heads x splits) reaches this many per SM
# An fp8 cache read by bf16 queries: the tiles in fp16 (q clamped to fp16's range), not in q's dtype. A module switch
# so that benchmarks/bench_paged_attention.py can time both in one run.
FP8_KV_IN_FP16 = True


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch knobs of one kernel launch. `block_m` 0: the smallest that fits (decode)."""

    block_m: int
    block_n: int
    use_dot: bool
    num_warps: int
    num_stages: int


# H200 sweeps (benchmarks/bench_paged_attention.py --sweep, 2026-12-02): W1's prefill chunk (32 fresh prompts of 256
# tokens, Qwen3-0.6B heads) 66.5 us against 72.9 with 64-key tiles.
PREFILL_CONFIG = KernelConfig(block_m=64, block_n=32, use_dot=True, num_warps=4, num_stages=3)
REGISTER_DECODE_CONFIG = KernelConfig(block_m=0, block_n=32, use_dot=False, num_warps=4, num_stages=2)
# Head dim 128 (Qwen3-0.6B, 256 seqs), at the contexts a decode run passes through (2026-12-03 sweep): one warp per
# program over 16-key tiles, 83.6 / 90.4 / 97.0 / 126.4 us at contexts 300 / 321 / 352 / 480, against 87.2 / 96.6 /
# 100.2 / 129.6 for 64-key tiles on 4 warps (the config before, chosen at contexts 384 and 512, multiples of its
# tile: a context one key past a 64-key tile paid for most of a whole tile). Split-KV is slower at that batch.
DOT_DECODE_CONFIG = KernelConfig(block_m=16, block_n=16, use_dot=True, num_warps=1, num_stages=4)
# Head dim 64 (SmolLM-135M, 512 seqs x 384 context): the same config, 43.8 us (3.5 TB/s) against 50.8 for 32-key
# tiles on 2 warps and 48.2 for 64-key tiles on 4 warps.
# An fp8 cache (fp16 tiles, 2026-12-03 sweep, us at contexts 300 / 321 / 384 / 480 for Qwen3-0.6B's heads, then W5's
# step): 64-key tiles on 2 warps 69.2 / 78.0 / 79.9 / 101.2, 46.5, against 70.2 / 75.7 / 85.6 / 103.9, 55.7 for the
# bf16 decode config above (the best per case: 68.6 / 74.2 / 79.7 / 100.6, 43.1). Half the bytes per key: a tile
# twice as wide keeps as many bytes in flight.
FP8_DOT_DECODE_CONFIG = KernelConfig(block_m=16, block_n=64, use_dot=True, num_warps=2, num_stages=3)


# The block-table width changes from step to step: one compiled kernel for all widths, not one per divisibility.
@triton.jit(do_not_specialize=["stride_block_table"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
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
    stride_cache_head,
    stride_block_table,
    NUM_QUERIES_PER_KV: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    USE_DOT: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    KV_IN_FP16: tl.constexpr,
):
    seq = tl.program_id(0)
    row_block = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_KV_SPLITS
    split = tl.program_id(2) % NUM_KV_SPLITS
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
    if KV_IN_FP16:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)  # fp16's range
    if not USE_DOT:
        q = q.to(tl.float32)
    query_position = first_query_position + query_index
    qk_scale = scale * 1.4426950408889634  # times log2(e): softmax with exp2

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Keys past the last query of this row block are causally invisible to all of its rows.
    last_query_index = tl.minimum(query_len, (row_block + 1) * BLOCK_M // NUM_QUERIES_PER_KV + 1) - 1
    kv_end = tl.minimum(seq_len, first_query_position + last_query_index + 1)
    # This split's share of the key tiles, from the device-side length (CUDA-graph replays change it).
    tiles_per_split = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), NUM_KV_SPLITS)
    kv_start = split * tiles_per_split * BLOCK_N
    kv_stop = tl.minimum(kv_end, kv_start + tiles_per_split * BLOCK_N)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    cache_head_offset = kv_head * stride_cache_head
    for start_n in range(kv_start, kv_stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_valid = offs_n < kv_stop
        block_ids = tl.load(block_table_row + offs_n // KV_BLOCK_SIZE, mask=key_valid, other=0)
        slot_offsets = block_ids.to(tl.int64) * stride_cache_block + (offs_n % KV_BLOCK_SIZE) * stride_cache_slot
        slot_offsets += cache_head_offset
        kv_offsets = slot_offsets[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM], head_dim contiguous
        # An fp8 cache is read back in fp16 (KV_IN_FP16) or q's dtype (a no-op for a cache in the model dtype).
        k = tl.load(k_cache_ptr + kv_offsets, mask=key_valid[:, None], other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + kv_offsets, mask=key_valid[:, None], other=0.0).to(q.dtype)
        if USE_DOT:
            if IEEE_DOT:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
        else:
            scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], 2)
        visible = (offs_n[None, :] <= query_position[:, None]) & key_valid[None, :]
        scores = tl.where(visible, scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet: avoid inf - inf
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if USE_DOT:
            if IEEE_DOT:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
        m_i = m_new

    token = (query_start + query_index).to(tl.int64)
    if NUM_KV_SPLITS == 1:
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_offsets = token[:, None] * stride_out_token + head[:, None] * stride_out_head
        tl.store(out_ptr + out_offsets + offs_d[None, :], acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        # Unnormalized partials [token, head, split, :] plus the running max (log2 domain) and sum of this split.
        out_offsets = token[:, None] * stride_out_token + head[:, None] * stride_out_head + split * HEAD_DIM
        tl.store(out_ptr + out_offsets + offs_d[None, :], acc, mask=row_valid[:, None])
        stats_offsets = token * stride_split_stats_token + head * stride_split_stats_head + split
        tl.store(split_max_ptr + stats_offsets, m_i, mask=row_valid)
        tl.store(split_sum_ptr + stats_offsets, l_i, mask=row_valid)


@triton.jit
def _merge_kv_splits_kernel(
    split_out_ptr,
    split_max_ptr,
    split_sum_ptr,
    out_ptr,
    stride_split_out_token,
    stride_split_out_head,
    stride_split_stats_token,
    stride_split_stats_head,
    stride_out_token,
    stride_out_head,
    NUM_KV_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_KV_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    stats_offsets = token * stride_split_stats_token + head * stride_split_stats_head + splits
    split_max = tl.load(split_max_ptr + stats_offsets)
    split_sum = tl.load(split_sum_ptr + stats_offsets)
    split_out = tl.load(
        split_out_ptr
        + token * stride_split_out_token
        + head * stride_split_out_head
        + splits[:, None] * HEAD_DIM
        + offs_d[None, :]
    )
    max_all = tl.max(split_max, 0)
    max_safe = tl.where(max_all == float("-inf"), 0.0, max_all)  # every split empty (seq_len 0): zeros
    weight = tl.exp2(split_max - max_safe)  # empty splits have max -inf: weight 0
    total = tl.sum(weight * split_sum, 0)
    out = tl.sum(weight[:, None] * split_out, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_out_token + head * stride_out_head + offs_d, out.to(out_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_config(num_queries_per_kv: int, max_query_len: int, fp8_cache: bool = False) -> KernelConfig:
    """Decode (one query token per sequence) gets a decode config, by group size and the cache's element size (the
    same for every head dim since the 2026-12-03 sweeps); any prefill chunk the prefill one."""
    if max_query_len > 1:
        return PREFILL_CONFIG
    if triton.next_power_of_2(num_queries_per_kv) <= MAX_REGISTER_DECODE_GROUP:
        return REGISTER_DECODE_CONFIG
    return FP8_DOT_DECODE_CONFIG if fp8_cache else DOT_DECODE_CONFIG


def choose_num_kv_splits(
    num_seqs: int, num_kv_heads: int, max_context_len: int, max_query_len: int, block_n: int, device: torch.device
) -> int:
    """Split-KV only for decode on CUDA, and only when (seqs x KV heads) programs would leave SMs idle. Shapes
    only, never lengths: the count must stay fixed for a captured CUDA graph."""
    if max_query_len > 1 or device.type != "cuda":
        return 1
    num_programs = num_seqs * num_kv_heads
    target_programs = SPLIT_KV_TARGET_PROGRAMS_PER_SM * _num_sms(device)
    if num_programs >= target_programs:
        return 1
    num_splits = triton.next_power_of_2(triton.cdiv(target_programs, num_programs))
    # No more splits than key tiles in the widest context the block table can hold; a power of two (the merge
    # kernel's requirement), so round that cap down.
    max_tiles = triton.cdiv(max_context_len, block_n)
    tile_cap = 1 << (max_tiles.bit_length() - 1) if max_tiles >= 1 else 1
    return max(1, min(num_splits, MAX_KV_SPLITS, tile_cap))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    num_kv_splits: int | None = None,
    config: KernelConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim]; caches [num_blocks, block_size, num_kv_heads, head_dim] in q's dtype or
    an fp8 one (read back in fp16 for bf16 queries, see FP8_KV_IN_FP16, else in q's dtype);
    block_tables [num_seqs, max_num_blocks] int32; query_start_loc [num_seqs + 1] int32 (cumulative query lengths);
    seq_lens [num_seqs] int32 (tokens in the cache after this step). Returns [num_tokens, num_heads, head_dim].

    `num_kv_splits` (a power of two) and `config` override the automatic choices (tests, benchmarks); the result
    is written into `out` (q's shape and dtype, contiguous) when given."""
    num_tokens, num_heads, head_dim = q.shape
    _, kv_block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    assert head_dim & (head_dim - 1) == 0 and head_dim >= 16, "head_dim must be a power of two >= 16"
    num_queries_per_kv = num_heads // num_kv_heads
    num_seqs, max_num_blocks = block_tables.shape
    fp8_cache = k_cache.element_size() == 1
    config = config or choose_config(num_queries_per_kv, max_query_len, fp8_cache=fp8_cache)
    block_m = config.block_m or triton.next_power_of_2(num_queries_per_kv)
    if config.use_dot and block_m < 16:
        raise ValueError(f"config {config}: tensor-core tiles need block_m >= 16")
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(
            num_seqs, num_kv_heads, max_num_blocks * kv_block_size, max_query_len, config.block_n, q.device
        )
    if num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1):
        raise ValueError(f"num_kv_splits must be a power of two >= 1, got {num_kv_splits}")

    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    if num_kv_splits == 1:
        kernel_out, split_max, split_sum = out, out, out  # the split buffers are not touched
    else:
        kernel_out = q.new_empty(num_tokens, num_heads, num_kv_splits, head_dim, dtype=torch.float32)
        split_max = q.new_empty(num_tokens, num_heads, num_kv_splits, dtype=torch.float32)
        split_sum = torch.empty_like(split_max)
    num_rows = max_query_len * num_queries_per_kv
    grid = (num_seqs, triton.cdiv(num_rows, block_m), num_kv_heads * num_kv_splits)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        kernel_out,
        split_max,
        split_sum,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        q.stride(0),
        q.stride(1),
        kernel_out.stride(0),
        kernel_out.stride(1),
        split_max.stride(0),
        split_max.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        NUM_QUERIES_PER_KV=num_queries_per_kv,
        KV_BLOCK_SIZE=kv_block_size,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        NUM_KV_SPLITS=num_kv_splits,
        USE_DOT=config.use_dot,
        IEEE_DOT=q.dtype == torch.float32,
        KV_IN_FP16=FP8_KV_IN_FP16 and fp8_cache and q.dtype == torch.bfloat16,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if num_kv_splits > 1:
        _merge_kv_splits_kernel[(num_tokens, num_heads)](
            kernel_out,
            split_max,
            split_sum,
            out,
            kernel_out.stride(0),
            kernel_out.stride(1),
            split_max.stride(0),
            split_max.stride(1),
            out.stride(0),
            out.stride(1),
            NUM_KV_SPLITS=num_kv_splits,
            HEAD_DIM=head_dim,
            num_warps=4,
        )
    return out
