"""Triton kernels of the engine against independent torch references: paged attention (decode tokens, prefill
chunks over a cached prefix, grouped-query heads, padded rows) and the fused sampler
(Gumbel-max draw and log-probs in one pass).

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported) on small
fp32 shapes; skipped when triton is not installed. With CUDA they run compiled, fp32 and bf16."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from slime.engine.dtypes import to_cache_dtype
from slime.engine.layers.activation import SiluAndMul
from slime.engine.layers.rmsnorm import RMSNorm
from slime.engine.layers.rotary import RotaryEmbedding
from slime.engine.layers.triton_fused import add_rms_norm, norm_rope, qkv_rope_store, rms_norm, silu_and_mul
from slime.engine.layers.triton_paged_attention import paged_attention
from slime.engine.sampler import draw_scores, near_tie_rows
from slime.engine.triton_sampler import fused_sample

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference_attention(q, k_cache, v_cache, block_tables, query_lens, seq_lens, scale):
    """Per sequence: gather its keys token by token, causal softmax attention in float64."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    block_size = k_cache.shape[1]
    outputs, start = [], 0
    for seq, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        positions = torch.arange(seq_len)
        blocks = block_tables[seq, positions // block_size].long().cpu()
        keys = k_cache.cpu()[blocks, positions % block_size].double()  # [seq_len, kv_heads, dim]
        values = v_cache.cpu()[blocks, positions % block_size].double()
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
        queries = q.cpu()[start : start + query_len].double()
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        query_positions = torch.arange(seq_len - query_len, seq_len)
        scores = scores.masked_fill(positions[None, None, :] > query_positions[None, :, None], float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
        start += query_len
    return torch.cat(outputs)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (2, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_paged_attention_matches_reference(num_heads, num_kv_heads, dtype):
    generator = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    head_dim, block_size, num_blocks = 16, 4, 64
    # decode with long context, prefill chunk over a cached prefix, fresh prefill, decode at position 0
    query_lens, seq_lens = [1, 7, 20, 1], [37, 13, 20, 1]
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(DEVICE, dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(DEVICE, dtype)
    max_num_blocks = 12
    block_tables = torch.randperm(num_blocks, generator=generator)[: 4 * max_num_blocks].view(4, max_num_blocks)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator).to(DEVICE, dtype)
    query_start_loc = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    scale = head_dim**-0.5
    out = paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables.to(DEVICE, torch.int32),
        query_start_loc.to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        max(query_lens),
        scale,
    )
    expected = reference_attention(
        q.float(), k_cache.float(), v_cache.float(), block_tables, query_lens, seq_lens, scale
    )
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.cpu().double(), expected, atol=tolerance, rtol=tolerance)


def test_paged_attention_padded_rows_are_zero_and_leave_real_rows_alone():
    """CUDA-graph padding: rows with seq_len 0 (query_len 1) output zeros; the real rows match the reference."""
    generator = torch.Generator().manual_seed(0)
    k_cache = torch.randn(8, 4, 1, 16, generator=generator).to(DEVICE)
    v_cache = torch.randn(8, 4, 1, 16, generator=generator).to(DEVICE)
    q = torch.randn(3, 2, 16, generator=generator).to(DEVICE)
    block_tables = torch.tensor([[3, 5], [0, 0], [0, 0]], dtype=torch.int32)
    out = paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables.to(DEVICE),
        torch.arange(4, dtype=torch.int32, device=DEVICE),
        torch.tensor([6, 0, 0], dtype=torch.int32, device=DEVICE),
        1,
        0.25,
    )
    assert torch.all(out[1:] == 0)
    expected = reference_attention(q[:1], k_cache, v_cache, block_tables, [1], [6], 0.25)
    torch.testing.assert_close(out[:1].cpu().double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_fused_elementwise_kernels_match_torch_modules(dtype):
    generator = torch.Generator().manual_seed(0)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    hidden = torch.randn(5, 96, generator=generator).to(DEVICE, dtype)
    norm = RMSNorm(96, 1e-6).to(DEVICE, dtype)
    norm.weight.data = torch.rand(96, generator=generator).to(DEVICE, dtype) + 0.5
    torch.testing.assert_close(rms_norm(hidden, norm.weight, norm.eps), norm(hidden), **tolerance)
    residual = torch.randn(5, 96, generator=generator).to(DEVICE, dtype)
    normed, summed = add_rms_norm(hidden, residual, norm.weight, norm.eps)
    assert summed.dtype == dtype and torch.equal(summed, hidden + residual)  # rounded as torch's add
    torch.testing.assert_close(normed, norm(hidden + residual), **tolerance)

    gate_up = torch.randn(5, 2 * 1500, generator=generator).to(DEVICE, dtype)  # two column blocks
    torch.testing.assert_close(silu_and_mul(gate_up), SiluAndMul()(gate_up), **tolerance)

    rotary = RotaryEmbedding(32, 64, 10000.0).to(DEVICE)
    positions = torch.tensor([0, 3, 63, 7, 7], device=DEVICE)
    qkv = torch.randn(5, 6 * 32, generator=generator).to(DEVICE, dtype)
    q, k = qkv[:, : 4 * 32].view(5, 4, 32), qkv[:, 4 * 32 :].view(5, 2, 32)  # strided views, as in the decoder
    head_norm = RMSNorm(32, 1e-6).to(DEVICE, dtype)
    head_norm.weight.data = torch.rand(32, generator=generator).to(DEVICE, dtype) + 0.5
    expected_q, expected_k = rotary(positions, head_norm(q), head_norm(k))
    torch.testing.assert_close(
        norm_rope(q, head_norm.weight, head_norm.eps, rotary.cos, rotary.sin, positions), expected_q, **tolerance
    )
    torch.testing.assert_close(
        norm_rope(k, head_norm.weight, head_norm.eps, rotary.cos, rotary.sin, positions), expected_k, **tolerance
    )
    expected_q, _ = rotary(positions, q, k)
    torch.testing.assert_close(norm_rope(q, None, 0.0, rotary.cos, rotary.sin, positions), expected_q, **tolerance)


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_qkv_rope_store_equals_norm_rope_and_cache_writes(dtype, qk_norm):
    """The fused attention input stage: q as norm_rope gives it, and the caches' slots hold norm_rope(k) and v,
    bit for bit, for 6 q heads over 2 KV heads (not powers of two apart); other slots stay untouched."""
    generator = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim = 6, 2, 32
    qkv = torch.randn(5, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(DEVICE, dtype)
    rotary = RotaryEmbedding(head_dim, 64, 10000.0).to(DEVICE)
    positions = torch.tensor([0, 3, 63, 7, 7], device=DEVICE)
    slots = torch.tensor([9, 0, 4, 15, 2], device=DEVICE)
    q_norm, k_norm = RMSNorm(head_dim, 1e-6).to(DEVICE, dtype), RMSNorm(head_dim, 1e-6).to(DEVICE, dtype)
    q_norm.weight.data = torch.rand(head_dim, generator=generator).to(DEVICE, dtype) + 0.5
    k_norm.weight.data = torch.rand(head_dim, generator=generator).to(DEVICE, dtype) + 0.5
    k_cache = torch.full((4, 4, num_kv_heads, head_dim), 7.0, dtype=dtype, device=DEVICE)
    v_cache = k_cache.clone()
    weights = (q_norm.weight, k_norm.weight) if qk_norm else (None, None)
    q = qkv_rope_store(qkv, *weights, 1e-6, rotary.cos, rotary.sin, positions, slots, k_cache, v_cache, num_heads)
    q_in, k_in, v_in = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    views = [x.view(5, -1, head_dim) for x in (q_in, k_in, v_in)]
    assert torch.equal(q, norm_rope(views[0], weights[0], 1e-6, rotary.cos, rotary.sin, positions))
    flat_k, flat_v = k_cache.view(16, num_kv_heads, head_dim), v_cache.view(16, num_kv_heads, head_dim)
    assert torch.equal(flat_k[slots], norm_rope(views[1], weights[1], 1e-6, rotary.cos, rotary.sin, positions))
    assert torch.equal(flat_v[slots], views[2])
    untouched = torch.ones(16, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert (flat_k[untouched] == 7).all() and (flat_v[untouched] == 7).all()


@pytest.mark.parametrize("rotary_dim, interleaved", [(16, True), (16, False), (8, True), (24, False), (32, True)],
                         ids=["glm4", "glm45", "quarter_interleaved", "three_quarters", "whole_interleaved"])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_partial_and_interleaved_rope_match_torch_rotary(dtype, qk_norm, rotary_dim, interleaved):
    """GLM's RoPE in the fused kernels: only the first rotary_dim dims of a head rotate, adjacent pairs (GLM-4) or
    rotate-half pairs (GLM-4.5), the rest pass; norm_rope equals rotary.py's torch path, and qkv_rope_store equals
    norm_rope plus the cache writes bit for bit."""
    generator = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim = 6, 2, 32
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    rotary = RotaryEmbedding(head_dim, 64, 10000.0, rotary_dim=rotary_dim, interleaved=interleaved).to(DEVICE)
    assert rotary.cos.shape == (64, rotary_dim)
    qkv = torch.randn(5, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(DEVICE, dtype)
    positions = torch.tensor([0, 3, 63, 7, 7], device=DEVICE)
    slots = torch.tensor([9, 0, 4, 15, 2], device=DEVICE)
    norms = [RMSNorm(head_dim, 1e-6).to(DEVICE, dtype) for _ in range(2)]
    for norm in norms:
        norm.weight.data = torch.rand(head_dim, generator=generator).to(DEVICE, dtype) + 0.5
    weights = (norms[0].weight, norms[1].weight) if qk_norm else (None, None)
    q_in, k_in, v_in = (x.view(5, -1, head_dim) for x in qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1))
    for x, norm, weight in ((q_in, norms[0], weights[0]), (k_in, norms[1], weights[1])):
        expected = rotary.rotate(positions, norm(x) if qk_norm else x)
        got = norm_rope(x, weight, 1e-6, rotary.cos, rotary.sin, positions, interleaved=interleaved)
        torch.testing.assert_close(got, expected, **tolerance)
        assert torch.equal(got[..., rotary_dim:], expected[..., rotary_dim:]) or qk_norm  # the passing dims
    k_cache = torch.full((4, 4, num_kv_heads, head_dim), 7.0, dtype=dtype, device=DEVICE)
    v_cache = k_cache.clone()
    q = qkv_rope_store(qkv, *weights, 1e-6, rotary.cos, rotary.sin, positions, slots, k_cache, v_cache, num_heads,
                       interleaved=interleaved)
    assert torch.equal(q, norm_rope(q_in, weights[0], 1e-6, rotary.cos, rotary.sin, positions, interleaved))
    flat_k, flat_v = k_cache.view(16, num_kv_heads, head_dim), v_cache.view(16, num_kv_heads, head_dim)
    assert torch.equal(flat_k[slots], norm_rope(k_in, weights[1], 1e-6, rotary.cos, rotary.sin, positions,
                                                interleaved))
    assert torch.equal(flat_v[slots], v_in)


# The Triton interpreter (3.9 here) rounds to fp8 wrongly where rounding up crosses a power of two (1.96 -> 1.0).
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA: the Triton interpreter's fp8 rounding is wrong")
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_qkv_rope_store_into_an_fp8_cache_rounds_and_saturates_as_torch(cache_dtype):
    """--kv-cache-dtype fp8: the slots hold exactly what the torch path stores (`to_cache_dtype` of norm_rope(k)
    and of v: rounded to nearest, values past the type's largest one saturated, not NaN); q stays in qkv's dtype."""
    generator = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, dtype = 4, 2, 32, torch.bfloat16 if DEVICE == "cuda" else torch.float32
    qkv = torch.randn(5, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    qkv[:, (num_heads + num_kv_heads) * head_dim:] *= 3e4  # v past fp8_e4m3's 448 (and, some, e5m2's 57344)
    qkv = qkv.to(DEVICE, dtype)
    rotary = RotaryEmbedding(head_dim, 64, 10000.0).to(DEVICE)
    positions = torch.tensor([0, 3, 63, 7, 7], device=DEVICE)
    slots = torch.tensor([9, 0, 4, 15, 2], device=DEVICE)
    k_norm = RMSNorm(head_dim, 1e-6).to(DEVICE, dtype)
    k_cache = torch.zeros((4, 4, num_kv_heads, head_dim), dtype=cache_dtype, device=DEVICE)
    v_cache = k_cache.clone()
    q = qkv_rope_store(qkv, k_norm.weight, k_norm.weight, 1e-6, rotary.cos, rotary.sin, positions, slots, k_cache,
                       v_cache, num_heads)
    assert q.dtype == dtype
    _, k_in, v_in = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    expected_k = to_cache_dtype(norm_rope(k_in.view(5, -1, head_dim), k_norm.weight, 1e-6, rotary.cos, rotary.sin,
                                          positions), cache_dtype)
    expected_v = to_cache_dtype(v_in.view(5, -1, head_dim), cache_dtype)
    flat_k, flat_v = k_cache.view(16, num_kv_heads, head_dim), v_cache.view(16, num_kv_heads, head_dim)
    assert torch.equal(flat_k[slots].float(), expected_k.float())
    assert torch.equal(flat_v[slots].float(), expected_v.float())
    assert flat_v[slots].float().abs().max() == torch.finfo(cache_dtype).max  # saturated, finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab_size", [3000, 40000])  # 3 chunks, not a multiple of the block; 16 chunks
def test_fused_sample_matches_the_torch_reference(vocab_size, dtype):
    """Same tokens as argmax(logits / T + g) with float64 noise (the torch path), except on near-ties; greedy rows
    (T = 0) take the argmax; log-probs equal log_softmax(logits / T) at the token; -inf columns (filtered) are never
    drawn, even when whole chunks are -inf."""
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(8, vocab_size, generator=generator) * 3).to(dtype)
    logits[6, : vocab_size - 5] = float("-inf")  # only the last five columns allowed
    logits[7, 1::2] = float("-inf")
    logits = logits.to(DEVICE)
    temperatures = torch.tensor([1.0, 0.6, 0.0, 1.3, 1.0, 1.0, 1.0, 0.0], device=DEVICE)
    seeds = torch.tensor([0, 1, 2**32 - 1, 12345, 7, 7, 3, 3], device=DEVICE)
    steps = torch.tensor([0, 5, 9, 0, 100, 101, 2, 2], device=DEVICE)
    tokens, log_probs = fused_sample(logits, temperatures, seeds, steps)
    scores = draw_scores(logits, temperatures, seeds, steps)
    ties = near_tie_rows(scores)
    assert int(ties.sum()) <= 1
    assert ((tokens == scores.argmax(-1)) | ties).all(), (tokens, scores.argmax(-1))
    assert tokens[2] == logits[2].float().argmax() and tokens[7] == logits[7].float().argmax()
    assert tokens[6] >= vocab_size - 5 and tokens[7] % 2 == 0
    divisors = torch.where(temperatures == 0, torch.ones_like(temperatures), temperatures)
    expected = torch.log_softmax(logits.float() / divisors[:, None], -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(log_probs, expected, atol=2e-5, rtol=1e-5)


def test_fused_results_are_the_host_copy_and_row_keys_mask_as_torch():
    """fused_sample_results: results[0] the tokens exactly, results[1] the log-probs, both float64; the rows' noise
    keys, computed in the kernel from int64 seeds and steps, are torch's (noise_row_keys) for seeds and steps past
    32 bits and negative ones, so the draws are draw_scores' argmax."""
    from slime.engine.triton_sampler import fused_sample_results

    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(6, 3000, generator=generator) * 3).to(DEVICE)
    temperatures = torch.tensor([1.0, 0.9, 1.0, 0.0, 1.2, 1.0], device=DEVICE)
    seeds = torch.tensor([2**40 + 5, -7, 2**63 - 1, 4, -(2**35), 11], device=DEVICE)
    steps = torch.tensor([0, 2**31 + 3, 17, 1, 2**33, 0], device=DEVICE)
    tokens, results = fused_sample_results(logits, temperatures, seeds, steps)
    assert tokens.dtype == torch.int64 and results.dtype == torch.float64 and results.shape == (2, 6)
    assert torch.equal(results[0], tokens.double())
    scores = draw_scores(logits, temperatures, seeds, steps)
    assert ((tokens == scores.argmax(-1)) | near_tie_rows(scores)).all(), (tokens, scores.argmax(-1))
    divisors = torch.where(temperatures == 0, torch.ones_like(temperatures), temperatures)
    expected = torch.log_softmax(logits.double() / divisors[:, None].double(), -1).gather(1, tokens[:, None])
    torch.testing.assert_close(results[1], expected.squeeze(1), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("sampler", ["fused", "torch"])
def test_draws_follow_the_softmax(sampler):
    """Frequencies of many seeded draws from one row of logits match softmax(logits / T): each of the five likely
    tokens and the long tail as a whole, within 4.5 standard errors."""
    from slime.engine.sampler import SamplingBatch, sample

    interpreted = DEVICE == "cpu" and sampler == "fused"  # Triton's interpreter: ~8 ms per program
    num_draws, vocab_size, temperature = (800 if interpreted else 20000), 1000, 0.8
    logits = torch.full((vocab_size,), -3.0)
    logits[:5] = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0])
    probs = torch.softmax(logits.double() / temperature, -1)
    expected = torch.cat([probs[:5], probs[5:].sum()[None]])
    device = DEVICE if sampler == "fused" else "cpu"
    rows = logits.to(device).expand(num_draws, -1)
    temperatures = torch.full((num_draws,), temperature, device=device)
    seeds = torch.arange(num_draws, device=device) * 7919
    steps = torch.arange(num_draws, device=device) % 13
    if sampler == "fused":
        tokens, _ = fused_sample(rows, temperatures, seeds, steps)
    else:
        zeros = torch.zeros(0, dtype=torch.int64)
        batch = SamplingBatch(temperatures, torch.full((num_draws,), vocab_size), torch.full((num_draws,), 2.0),
                              torch.zeros(num_draws), seeds, steps, zeros, zeros, needs_filtering=False,
                              all_greedy=False, any_greedy=False)
        tokens, _ = sample(rows, batch)
    counts = torch.bincount(tokens.cpu().clamp(max=5), minlength=6).double() / num_draws
    standard_error = (expected * (1 - expected) / num_draws).sqrt()
    assert ((counts - expected).abs() <= 4.5 * standard_error).all(), (counts, expected)


@pytest.mark.parametrize("arch", ["qwen3", "glm4", "glm4_moe"])
def test_engine_triton_path_matches_torch_path(tmp_path, arch):
    """The whole engine with Triton attention metadata and fused kernels (chunked prefill, prefix-cache hits,
    decode) gives the torch path's greedy tokens and log-probs; GLM-4 / GLM-4.5 with their partial RoPE (and
    GLM-4.5's q/k norm) inside the fused attention input stage."""
    from slime.engine.engine import Engine
    from slime.utils.tiny_model import build_tiny_model

    extra = {"use_qk_norm": True} if arch == "glm4_moe" else {}
    path = build_tiny_model(tmp_path / arch, arch=arch, initializer_range=0.2, **extra)
    prompts = [list(range(3, 30)), list(range(3, 21)), [7, 8, 9]]
    params = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    outputs = []
    for use_triton in (False, True):
        engine = Engine(
            str(path),
            device=DEVICE,
            dtype="float32",
            kvcache_block_size=4,
            num_kvcache_blocks=64,
            max_num_batched_tokens=16,
            enforce_eager=True,
        )
        engine.model_runner.set_use_triton(use_triton)
        assert all(layer.self_attn.use_triton == use_triton for layer in engine.model_runner.model.model.layers)
        outputs.append(engine.generate(prompts, params) + engine.generate(prompts[:1], params))
    for torch_output, triton_output in zip(*outputs):
        assert triton_output["output_ids"] == torch_output["output_ids"]
        assert triton_output["output_log_probs"] == pytest.approx(torch_output["output_log_probs"], abs=1e-4)
    assert outputs[1][-1]["cached_tokens"] > 0


def test_start_up_self_check_passes_and_catches_a_wrong_attention_kernel(monkeypatch):
    """The model runner's start-up check runs both kernel variants (prefill over a cached prefix, decode) against
    SDPA: it accepts the real kernel and turns a wrong one (here: a decode result off by a constant) into the
    torch fallback with a warning."""
    import slime.engine.layers.triton_paged_attention as kernel_module
    from slime.engine.kernel_checks import triton_attention_works

    device = torch.device(DEVICE)
    assert triton_attention_works(device)
    assert triton_attention_works(device, torch.bfloat16)  # a bf16 model's cache: the float32 check all the same

    real = kernel_module.paged_attention

    def wrong_decode(q, *args, **kwargs):
        out = real(q, *args, **kwargs)
        return out + 0.01 if args[-2] == 1 else out  # max_query_len 1: the decode step

    monkeypatch.setattr(kernel_module, "paged_attention", wrong_decode)
    with pytest.warns(UserWarning, match="Triton paged attention unavailable"):
        assert not triton_attention_works(device)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_kernel_self_check_passes_for_every_16_and_32_bit_cache(kv_dtype):
    """The start-up check of the fused kernels runs in float32 whatever a 16/32-bit cache's dtype: a bf16 model's
    cache once made the check write bf16 slots from float32 inputs, which the kernel refuses, so every bf16 engine
    ran without its fused kernels (decode steps 4.1 -> 6.9 ms on an H200)."""
    from slime.engine.kernel_checks import triton_fused_kernels_work

    assert triton_fused_kernels_work(torch.device(DEVICE), kv_dtype)


def test_sampler_buffers_start_aligned_for_every_batch_size():
    """Triton specialises a kernel on 16-byte pointer alignment: the sampler's outputs must be aligned whatever the
    row count, or a new batch size compiles the kernel again mid-run."""
    from slime.engine.triton_sampler import chunk_buffers

    for num_rows in range(1, 40):
        for num_chunks in (1, 7, 16):
            for buffer in chunk_buffers(num_rows, num_chunks, DEVICE):
                assert buffer.data_ptr() % 16 == 0, (num_rows, num_chunks)
                assert buffer.shape == (num_rows, num_chunks)
