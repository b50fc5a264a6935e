"""GPU check of the Megatron backend's packed attention core with a value head narrower than the query-key head
(multi-head latent attention: DeepSeek-V3's 128 against 192): FlashAttention's varlen kernel takes one head dim, so
`PackedCoreAttention` pads V with zero columns and drops them again. Against the CPU path (length-bucketed sdpa, which
takes any V dim) in fp32 on the same packed bf16 inputs (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("megatron.core")


def test_narrow_value_heads_through_flash_varlen():
    from slime.backends.attention import bucketed_causal_attention, varlen_supported
    from slime.backends.megatron_utils.attention import PackedCoreAttention

    cuda = torch.device("cuda")
    if not varlen_supported(cuda):
        pytest.skip("no FlashAttention varlen kernel on this GPU")
    generator = torch.Generator().manual_seed(0)
    lengths = [37, 5, 120, 64]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    tokens, heads, qk_dim, v_dim = sum(lengths), 8, 192, 128
    query, key = (torch.randn(tokens, heads, qk_dim, generator=generator).bfloat16() for _ in range(2))
    value = torch.randn(tokens, heads, v_dim, generator=generator).bfloat16()
    core = PackedCoreAttention.__new__(PackedCoreAttention)  # the attention math only, no megatron config
    core.cp_size, core.softmax_scale = 1, qk_dim ** -0.5
    got = core._packed_attention(query.to(cuda), key.to(cuda), value.to(cuda), cu_seqlens.to(cuda), max(lengths))
    expected = bucketed_causal_attention(query.float(), key.float(), value.float(), cu_seqlens, qk_dim ** -0.5)
    assert got.shape == (tokens, heads, v_dim)
    torch.testing.assert_close(got.float().cpu(), expected, rtol=0, atol=3e-2)
