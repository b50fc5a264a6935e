"""The paged-attention kernel's paths against a float64 torch reference: register decode and tensor-core decode
(GQA 2 and 4), split-KV (flash-decoding) with empty splits, prefill chunks with and without a cached prefix, padded
seq_len 0 rows, random non-contiguous block tables, contexts that are not multiples of the block size.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported) on tiny
shapes; bf16 there only on the register path (the interpreter's bf16 `tl.dot` is wrong, compiled it is fine).
The `gpu` tests run the real shapes compiled, the automatic split choice, and a CUDA-graph replay."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from slime.engine.dtypes import to_cache_dtype
from slime.engine.layers.triton_paged_attention import (
    DOT_DECODE_CONFIG,
    FP8_DOT_DECODE_CONFIG,
    PREFILL_CONFIG,
    REGISTER_DECODE_CONFIG,
    KernelConfig,
    choose_config,
    choose_num_kv_splits,
    paged_attention,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REGISTER_DECODE = KernelConfig(block_m=0, block_n=8, use_dot=False, num_warps=4, num_stages=2)
DOT_DECODE = KernelConfig(block_m=16, block_n=16, use_dot=True, num_warps=4, num_stages=2)
SMALL_PREFILL = KernelConfig(block_m=16, block_n=16, use_dot=True, num_warps=4, num_stages=2)


def reference(q, k_cache, v_cache, block_tables, query_lens, seq_lens, scale):
    """float64, one sequence at a time: its keys gathered slot by slot, a causal mask from absolute positions."""
    num_heads, num_kv_heads, block_size = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out, start = torch.zeros(q.shape, dtype=torch.float64), 0
    for seq, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        for position_in_chunk in range(query_len):
            position = seq_len - query_len + position_in_chunk
            if position < 0:  # a padded row (seq_len 0) sees no keys: zeros
                continue
            slots = [(block_tables[seq, s // block_size], s % block_size) for s in range(position + 1)]
            for head in range(num_heads):
                keys = torch.stack([k_cache[block, slot, head // group] for block, slot in slots]).double()
                values = torch.stack([v_cache[block, slot, head // group] for block, slot in slots]).double()
                weights = (keys @ q[start + position_in_chunk, head].double() * scale).softmax(0)
                out[start + position_in_chunk, head] = weights @ values
        start += query_len
    return out


def make_batch(query_lens, seq_lens, num_heads, num_kv_heads, dtype, seed, head_dim=16, block_size=4):
    generator = torch.Generator().manual_seed(seed)
    max_num_blocks = max(-(-s // block_size) for s in seq_lens) + 1  # one spare column, as in the runner
    num_blocks = len(seq_lens) * max_num_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    block_tables = torch.randperm(num_blocks, generator=generator)[: len(seq_lens) * max_num_blocks]
    block_tables = block_tables.view(len(seq_lens), max_num_blocks).to(torch.int32)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator).to(dtype)
    return q, k_cache, v_cache, block_tables


def run_and_compare(query_lens, seq_lens, num_heads, num_kv_heads, dtype, config, num_kv_splits, seed=0):
    q, k_cache, v_cache, block_tables = make_batch(query_lens, seq_lens, num_heads, num_kv_heads, dtype, seed)
    scale = q.shape[-1] ** -0.5
    out = paged_attention(
        q.to(DEVICE),
        k_cache.to(DEVICE),
        v_cache.to(DEVICE),
        block_tables.to(DEVICE),
        torch.tensor([0] + query_lens, device=DEVICE).cumsum(0).to(torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        max(query_lens),
        scale,
        num_kv_splits=num_kv_splits,
        config=config,
    )
    assert out.dtype == dtype and out.shape == q.shape
    expected = reference(q, k_cache, v_cache, block_tables, query_lens, seq_lens, scale)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().double(), expected, atol=tolerance, rtol=tolerance)
    return out


def dtypes_for(config):
    if DEVICE == "cuda" or not config.use_dot:
        return [torch.float32, torch.bfloat16]
    return [torch.float32]


@pytest.mark.parametrize("config", [REGISTER_DECODE, DOT_DECODE], ids=["register", "dot"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (8, 2), (6, 2)], ids=["gqa2", "gqa4", "gqa3"])
@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_decode_matches_reference(config, num_heads, num_kv_heads, num_kv_splits):
    """Contexts 37 (5 tiles of 8 keys: with 4 splits of 2 tiles the last split is empty), 0 (padded row), 5, 16
    (whole blocks) and 1."""
    seq_lens = [37, 0, 5, 16, 1]
    for dtype in dtypes_for(config):
        out = run_and_compare([1] * 5, seq_lens, num_heads, num_kv_heads, dtype, config, num_kv_splits)
        assert torch.all(out[1] == 0)


@pytest.mark.parametrize("config", [PREFILL_CONFIG, SMALL_PREFILL], ids=["block_m64", "block_m16"])
@pytest.mark.parametrize("num_kv_splits", [1, 2])
def test_prefill_matches_reference(config, num_kv_splits):
    """Chunk of 7 over a 6-token cached prefix, a fresh 20-token prompt (several 16-row blocks, causal skipping),
    a decode token riding along, a fresh 5-token prompt."""
    for dtype in dtypes_for(config):
        run_and_compare([7, 20, 1, 5], [13, 20, 37, 5], 4, 2, dtype, config, num_kv_splits, seed=1)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("config", [REGISTER_DECODE, DOT_DECODE, SMALL_PREFILL], ids=["register", "dot", "prefill"])
def test_fp8_cache_is_read_back_in_the_query_dtype(cache_dtype, config):
    """An fp8 KV cache (--kv-cache-dtype fp8_e4m3 / fp8_e5m2): the kernel reads it back exactly, so its output is
    the reference attention over the cache's own (rounded) values, at the query dtype's tolerance."""
    query_lens, seq_lens = ([1] * 4, [37, 5, 16, 1]) if config is not SMALL_PREFILL else ([7, 20, 1], [13, 20, 37])
    for dtype in dtypes_for(config):
        q, k_cache, v_cache, block_tables = make_batch(query_lens, seq_lens, 4, 2, dtype, seed=2)
        k_cache, v_cache = to_cache_dtype(k_cache, cache_dtype), to_cache_dtype(v_cache, cache_dtype)
        scale = q.shape[-1] ** -0.5
        out = paged_attention(
            q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(DEVICE),
            torch.tensor([0] + query_lens, device=DEVICE).cumsum(0).to(torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), max(query_lens), scale, config=config,
        )
        assert out.dtype == dtype
        expected = reference(q, k_cache.double(), v_cache.double(), block_tables, query_lens, seq_lens, scale)
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.cpu().double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("config", [REGISTER_DECODE, DOT_DECODE], ids=["register", "dot"])
def test_bf16_queries_past_fp16_range_over_an_fp8_cache_stay_finite(config):
    """bf16 queries over an fp8 cache are computed in fp16 (FP8_KV_IN_FP16): a query element beyond fp16's range is
    clamped to it, not turned into inf (whose scores would make the softmax NaN)."""
    if torch.bfloat16 not in dtypes_for(config):
        pytest.skip("the Triton interpreter's bf16 tl.dot is wrong; the GPU run covers this config")
    query_lens, seq_lens = [1] * 3, [9, 5, 16]
    q, k_cache, v_cache, block_tables = make_batch(query_lens, seq_lens, 4, 2, torch.bfloat16, seed=3)
    q[0, 1, :4] = 1e5  # past fp16's 65504
    k_cache, v_cache = to_cache_dtype(k_cache, torch.float8_e4m3fn), to_cache_dtype(v_cache, torch.float8_e4m3fn)
    scale = 1e-3 / q.shape[-1] ** 0.5  # keeps the clamped scores in a range where the softmax is not one-hot
    out = paged_attention(
        q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(DEVICE),
        torch.tensor([0] + query_lens, device=DEVICE).cumsum(0).to(torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), 1, scale, config=config,
    )
    assert torch.isfinite(out).all()
    clamped = q.double().clamp(-65504, 65504)
    expected = reference(clamped, k_cache.double(), v_cache.double(), block_tables, query_lens, seq_lens, scale)
    torch.testing.assert_close(out.cpu().double(), expected, atol=2e-2, rtol=2e-2)


def test_automatic_config_follows_the_group_and_the_step():
    assert choose_config(1, 1) == REGISTER_DECODE_CONFIG  # multi-head attention: no group to fill 16 rows
    assert choose_config(2, 1) == DOT_DECODE_CONFIG  # grouped-query: tensor cores (faster on the H200)
    assert choose_config(8, 1) == choose_config(3, 1) == DOT_DECODE_CONFIG  # 3: SmolLM-135M's heads
    assert choose_config(2, 2) == choose_config(1, 7) == PREFILL_CONFIG
    assert choose_config(2, 1, fp8_cache=True) == FP8_DOT_DECODE_CONFIG != DOT_DECODE_CONFIG  # wider tiles for fp8
    assert choose_config(2, 9, fp8_cache=True) == PREFILL_CONFIG
    assert choose_num_kv_splits(1, 1, 4096, 1, 32, torch.device("cpu")) == 1  # no split off CUDA


def test_kv_split_count_is_a_power_of_two_capped_by_the_tiles(monkeypatch):
    """A block table holding 3 key tiles (the H200 failure: 3 splits) caps the count at 2, never 3."""
    import slime.engine.layers.triton_paged_attention as kernel

    monkeypatch.setattr(kernel, "_num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    for max_context_len in range(1, 40 * 32, 7):
        splits = choose_num_kv_splits(4, 2, max_context_len, 1, 32, cuda)
        assert splits & (splits - 1) == 0 and splits <= max(1, -(-max_context_len // 32))
    assert choose_num_kv_splits(4, 2, 96, 1, 32, cuda) == 2
    assert choose_num_kv_splits(4, 2, 4096, 1, 32, cuda) == kernel.MAX_KV_SPLITS


def test_num_kv_splits_must_be_a_power_of_two():
    q, k_cache, v_cache, block_tables = make_batch([1], [5], 2, 1, torch.float32, 0)
    with pytest.raises(ValueError, match="num_kv_splits"):
        paged_attention(
            q, k_cache, v_cache, block_tables, torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([5], dtype=torch.int32), 1, 0.25, num_kv_splits=3,
        )


def decode_reference(q, k_cache, v_cache, block_tables, seq_lens, seq, scale):
    """float64 attention of decode token `seq` over its gathered context (faster than `reference` at real sizes)."""
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    positions = torch.arange(seq_lens[seq])
    blocks = block_tables[seq].cpu()[positions // block_size].long()
    keys = k_cache.cpu()[blocks, positions % block_size].double().repeat_interleave(group, dim=1)  # [len, heads, dim]
    values = v_cache.cpu()[blocks, positions % block_size].double().repeat_interleave(group, dim=1)
    weights = (torch.einsum("hd,khd->hk", q[seq].cpu().double(), keys) * scale).softmax(-1)
    return torch.einsum("hk,khd->hd", weights, values)


@pytest.mark.gpu
def test_split_choice_depends_on_batch_not_on_lengths():
    device = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    assert choose_num_kv_splits(256, 8, 4096, 1, 32, device) == (1 if 256 * 8 >= 4 * num_sms else 2)
    assert choose_num_kv_splits(16, 8, 4096, 1, 32, device) > 1
    assert choose_num_kv_splits(16, 8, 4096, 7, 32, device) == 1  # prefill never splits
    assert choose_num_kv_splits(1, 1, 32, 1, 32, device) == 1  # no more splits than tiles


@pytest.mark.gpu
@pytest.mark.parametrize("num_seqs,context,num_heads,num_kv_heads,head_dim",
                         [(64, 300, 16, 8, 128), (4, 2000, 16, 8, 128), (128, 300, 9, 3, 64), (4, 2000, 9, 3, 64)],
                         ids=["qwen3-64x300", "qwen3-4x2000", "smollm-128x300", "smollm-4x2000"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16-cache", "fp8-cache"])
def test_real_shapes_bf16_automatic_choices(num_seqs, context, num_heads, num_kv_heads, head_dim, cache_dtype):
    """Qwen3-0.6B's heads (16 query / 8 KV, head dim 128) and SmolLM-135M's (9 / 3, head dim 64), one decode
    config for both (another for an fp8 cache, read in fp16 tiles), block size 16, bf16 queries, the automatic
    config and split count."""
    generator = torch.Generator().manual_seed(0)
    seq_lens = (torch.randint(context // 2, context, (num_seqs,), generator=generator)).tolist()
    q, k_cache, v_cache, block_tables = make_batch([1] * num_seqs, seq_lens, num_heads, num_kv_heads, torch.bfloat16,
                                                   0, head_dim, 16)
    k_cache, v_cache = to_cache_dtype(k_cache, cache_dtype), to_cache_dtype(v_cache, cache_dtype)
    scale = head_dim**-0.5
    out = paged_attention(
        q.cuda(), k_cache.cuda(), v_cache.cuda(), block_tables.cuda(),
        torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda"),
        torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), 1, scale,
    )
    for seq in range(0, num_seqs, max(1, num_seqs // 8)):
        expected = decode_reference(q, k_cache, v_cache, block_tables, seq_lens, seq, scale)
        torch.testing.assert_close(out[seq].cpu().double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_split_decode_in_a_cuda_graph_replays_with_other_lengths():
    """Captured once (split count fixed by shapes), replayed with new seq_lens and block tables: each replay matches
    the reference for its own lengths (the key ranges per split are computed on the device)."""
    num_seqs, num_heads, num_kv_heads = 4, 16, 8
    q, k_cache, v_cache, block_tables = make_batch(
        [1] * num_seqs, [1000] * num_seqs, num_heads, num_kv_heads, torch.bfloat16, 0, 128, 16
    )
    q, k_cache, v_cache = q.cuda(), k_cache.cuda(), v_cache.cuda()
    static_tables = block_tables.cuda()
    static_lens = torch.full((num_seqs,), 1000, dtype=torch.int32, device="cuda")
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda")
    assert choose_num_kv_splits(num_seqs, num_kv_heads, block_tables.shape[1] * 16, 1, 32, q.device) > 1
    args = (q, k_cache, v_cache, static_tables, query_start_loc, static_lens, 1, 128**-0.5)
    paged_attention(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = paged_attention(*args)
    for seq_lens in ([1000, 1, 0, 517], [3, 999, 64, 200]):
        new_tables = block_tables[torch.randperm(num_seqs)]
        static_tables.copy_(new_tables)
        static_lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        graph.replay()
        for seq, seq_len in enumerate(seq_lens):
            if seq_len == 0:
                assert torch.all(static_out[seq] == 0)
                continue
            expected = decode_reference(q, k_cache, v_cache, static_tables, seq_lens, seq, 128**-0.5)
            torch.testing.assert_close(static_out[seq].cpu().double(), expected, atol=2e-2, rtol=2e-2)
