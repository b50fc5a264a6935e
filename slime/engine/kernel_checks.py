"""Start-up self-checks of the engine's Triton kernels (the MLA one included) (and of torch's grouped_mm for MoE experts) on this machine:
each kernel family must import, compile and match its torch reference on a small case before the model runner uses
it; any failure (no triton, a compile error, a wrong result) warns and keeps the torch path. Not a test suite:
tests/engine/test_triton_kernels.py checks the kernels themselves.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from slime.engine.dtypes import FP8_DTYPES, to_cache_dtype


def triton_attention_works(device: torch.device, kv_dtype: torch.dtype = torch.float32) -> bool:
    """Whether the Triton paged-attention kernels import, compile and match SDPA here on a small prefill chunk over
    a cached prefix and on a decode step of two sequences (the two kernel variants), in float32, or reading an fp8
    cache when `kv_dtype` is one (against SDPA over the same cache read back); if not, warn and let the engine run
    the pure-torch path."""
    try:
        from slime.engine.layers.triton_paged_attention import paged_attention

        generator = torch.Generator(device=device).manual_seed(0)
        cache_dtype = kv_dtype if kv_dtype in FP8_DTYPES else torch.float32  # q is float32: so is a 16-bit cache
        k_cache, v_cache = (to_cache_dtype(torch.randn(2, 4, 2, 64, device=device, generator=generator),
                                           cache_dtype) for _ in range(2))
        cases = [  # (block tables, query lengths, sequence lengths after the step)
            ([[1, 0]], [5], [8]),
            ([[1, 0], [0, 1]], [1, 1], [8, 6]),
        ]
        for tables, query_lens, seq_lens in cases:
            q = torch.randn(sum(query_lens), 4, 64, device=device, generator=generator)
            query_start_loc = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32, device=device)
            out = paged_attention(q, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32, device=device),
                                  query_start_loc, torch.tensor(seq_lens, dtype=torch.int32, device=device),
                                  max(query_lens), 0.125)
            expected = torch.cat([
                _sdpa_reference(q[start:start + query_len], k_cache.float(), v_cache.float(), table, seq_len)
                for table, query_len, seq_len, start in zip(tables, query_lens, seq_lens, query_start_loc.tolist())
            ])
            torch.testing.assert_close(out, expected, atol=1e-3, rtol=1e-3)
        return True
    # any failure (no triton, compile error, wrong result) means: use the torch path
    except Exception as error:  # noqa: BLE001
        warnings.warn(f"Triton paged attention unavailable ({type(error).__name__}: {error}); using the torch path",
                      stacklevel=2)
        return False


def triton_mla_attention_works(device: torch.device, dtype: torch.dtype = torch.float32, num_heads: int = 4,
                               latent_dim: int = 24, rope_dim: int = 8) -> bool:
    """Whether the absorbed-MLA Triton kernel (triton_mla_decode.py) imports, compiles and matches SDPA here on a
    prefill chunk over a cached prefix and on a decode step of two sequences, at the model's heads, latent and rope
    dims and dtype (the kernel variants the model will run: a tile that does not fit the device fails here, not
    mid-run); if not, warn and let the engine run the torch path."""
    try:
        import torch.nn.functional as F

        from slime.engine.layers.triton_mla_decode import mla_attention

        generator = torch.Generator(device=device).manual_seed(0)
        row_dim = latent_dim + rope_dim
        cache = torch.randn(2, 4, 1, row_dim, device=device, generator=generator).to(dtype)
        for tables, query_lens, seq_lens in (([[1, 0]], [5], [8]), ([[1, 0], [0, 1]], [1, 1], [8, 6])):
            q = torch.randn(sum(query_lens), num_heads, row_dim, device=device, generator=generator).to(dtype)
            query_start_loc = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32, device=device)
            out = mla_attention(q, cache, torch.tensor(tables, dtype=torch.int32, device=device), query_start_loc,
                                torch.tensor(seq_lens, dtype=torch.int32, device=device), max(query_lens),
                                row_dim**-0.5, latent_dim)
            expected = []
            for table, query_len, seq_len, start in zip(tables, query_lens, seq_lens, query_start_loc.tolist()):
                rows = cache[table].reshape(-1, row_dim)[:seq_len].float()
                positions = torch.arange(seq_len - query_len, seq_len, device=device)
                mask = torch.arange(seq_len, device=device)[None, :] <= positions[:, None]
                expected.append(F.scaled_dot_product_attention(
                    q[start:start + query_len].float().transpose(0, 1), rows[None], rows[None, :, :latent_dim],
                    attn_mask=mask, scale=row_dim**-0.5).transpose(0, 1))
            tolerance = 1e-3 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(out.float(), torch.cat(expected), atol=tolerance, rtol=tolerance)
        return True
    except Exception as error:  # noqa: BLE001
        warnings.warn(f"Triton MLA attention unavailable ({type(error).__name__}: {error}); using the torch path",
                      stacklevel=2)
        return False


def _sdpa_reference(q, k_cache, v_cache, table: list[int], seq_len: int) -> torch.Tensor:
    """Causal attention of the last len(q) positions of a sequence whose K/V sit in the blocks `table`."""
    import torch.nn.functional as F

    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    keys = k_cache[table].reshape(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1)
    values = v_cache[table].reshape(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1)
    positions = torch.arange(seq_len - q.shape[0], seq_len, device=q.device)
    mask = torch.arange(seq_len, device=q.device)[None, :] <= positions[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask, scale=0.125,
                                          enable_gqa=True).transpose(0, 1)


def triton_fused_kernels_work(device: torch.device, kv_dtype: torch.dtype = torch.float32) -> bool:
    """Whether the fused kernels the decoder runs (RMSNorm, add + RMSNorm, q/k norm + rotary + K/V cache writes, the
    latter also with GLM's partial interleaved and partial rotate-half RoPE, SiLU-and-mul) match the torch modules
    here, in float32, the cache writes into an fp8 cache when `kv_dtype` is
    one (a 16-bit cache is in the model's dtype, as qkv); if not, warn and keep the torch modules for those
    stages."""
    try:
        from slime.engine.layers.activation import SiluAndMul
        from slime.engine.layers.rmsnorm import RMSNorm
        from slime.engine.layers.rotary import RotaryEmbedding
        from slime.engine.layers.triton_fused import add_rms_norm, qkv_rope_store, rms_norm, silu_and_mul

        generator = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(3, 64, 128, device=device, generator=generator)
        norm = RMSNorm(128, 1e-6).to(device)
        torch.testing.assert_close(rms_norm(x, norm.weight, norm.eps), norm(x), atol=1e-4, rtol=1e-4)
        residual = torch.randn(64, 128, device=device, generator=generator)
        expected = norm(x[0] + residual), x[0] + residual
        got = add_rms_norm(x[0], residual, norm.weight, norm.eps)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(silu_and_mul(x[0]), SiluAndMul()(x[0]), atol=1e-4, rtol=1e-4)
        rotary = RotaryEmbedding(128, 16, 10000.0).to(device)
        positions = torch.arange(3, device=device) * 5
        qkv = x[:, :8].reshape(3, 8 * 128)  # 4 q heads, 2 k heads, 2 v heads
        cache_dtype = kv_dtype if kv_dtype in FP8_DTYPES else x.dtype
        k_cache, v_cache = torch.zeros(2, 2, 4, 2, 128, device=device, dtype=cache_dtype)
        slots = torch.tensor([5, 0, 3], device=device)
        got_q = qkv_rope_store(qkv, norm.weight, norm.weight, norm.eps, rotary.cos, rotary.sin, positions, slots,
                               k_cache, v_cache, 4)
        expected_q, expected_k = rotary(positions, norm(x[:, :4]), norm(x[:, 4:6]))
        torch.testing.assert_close(got_q, expected_q, atol=1e-4, rtol=1e-4)
        if kv_dtype in FP8_DTYPES:  # the kernel rounds fp32 to fp8 once, as to_cache_dtype; 1e-4 apart may round apart
            expected_k, expected_v = to_cache_dtype(expected_k, kv_dtype), to_cache_dtype(x[:, 6:8], kv_dtype)
            tolerance = dict(atol=1e-3, rtol=torch.finfo(kv_dtype).eps)
        else:
            expected_v, tolerance = x[:, 6:8], dict(atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(k_cache.view(8, 2, 128)[slots].float(), expected_k.float(), **tolerance)
        torch.testing.assert_close(v_cache.view(8, 2, 128)[slots].float(), expected_v.float(), **tolerance)
        for interleaved in (True, False):  # GLM-4's and GLM-4.5's half-head RoPE
            rotary = RotaryEmbedding(128, 16, 10000.0, rotary_dim=64, interleaved=interleaved).to(device)
            got_q = qkv_rope_store(qkv, norm.weight, norm.weight, norm.eps, rotary.cos, rotary.sin, positions, slots,
                                   k_cache, v_cache, 4, interleaved=interleaved)
            torch.testing.assert_close(got_q, rotary.rotate(positions, norm(x[:, :4])), atol=1e-4, rtol=1e-4)
        return True
    except Exception as error:  # noqa: BLE001
        warnings.warn(f"fused Triton kernels unavailable ({type(error).__name__}: {error}); using torch modules",
                      stacklevel=2)
        return False


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped_mm runs here in `dtype` and matches one matmul per expert (empty groups included);
    on CUDA also under CUDA graph capture, as decode steps replay graphs. If not, warn: the MoE experts then run
    one matmul per expert, and decode CUDA graphs are off."""
    if device.type == "cuda" and dtype != torch.bfloat16:
        # torch's CUDA grouped_mm has a kernel for bf16 only; other dtypes loop over groups read on the host, which
        # a CUDA graph cannot capture, and a failed capture leaves the process's CUDA random-number state unusable
        # ("Offset increment outside graph capture"), so it is not even tried.
        warnings.warn(f"torch grouped_mm has no CUDA graph-capturable kernel for {dtype}; MoE experts run one matmul "
                      "per expert and decode CUDA graphs are off for this MoE model (bf16 has both)", stacklevel=2)
        return False
    try:
        from slime.engine.layers.moe import GroupedExperts

        generator = torch.Generator(device=device).manual_seed(0)
        experts = GroupedExperts(4, 64, 32).to(device=device, dtype=dtype)
        with torch.no_grad():
            experts.gate_up_proj.normal_(generator=generator)
            experts.down_proj.normal_(generator=generator)
            hidden = torch.randn(16, 64, device=device, dtype=dtype, generator=generator)
            expert_ids = torch.tensor([[0, 3], [3, 1]] * 8, device=device)
            weights = torch.rand(16, 2, device=device, dtype=dtype, generator=generator)
            experts.use_grouped_mm = True
            got = experts(hidden, expert_ids, weights)
            experts.use_grouped_mm = False
            expected = experts(hidden, expert_ids, weights)
        tolerance = 1e-4 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(got, expected, atol=tolerance * expected.abs().max().item(), rtol=tolerance)
        if device.type == "cuda":  # decode steps replay CUDA graphs: the kernel must also run under capture
            experts.use_grouped_mm = True
            captured = _captured_output(lambda: experts(hidden, expert_ids, weights), device)
            torch.testing.assert_close(captured, expected, atol=tolerance * expected.abs().max().item(),
                                       rtol=tolerance)
        return True
    except Exception as error:  # noqa: BLE001
        warnings.warn(f"torch grouped_mm unavailable for {dtype} on {device} ({type(error).__name__}: {error}); "
                      "MoE experts run one matmul per expert", stacklevel=2)
        return False


@torch.no_grad()
def _captured_output(function, device: torch.device) -> torch.Tensor:
    """`function()`'s output computed by replaying a CUDA graph of it (warmed up on a side stream first, as
    capture requires). Raises where the function cannot be captured: some grouped_mm dtypes copy group offsets to
    the host, which capture refuses."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        function()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = function()
    graph.replay()
    torch.cuda.synchronize(device)
    return output.clone()
