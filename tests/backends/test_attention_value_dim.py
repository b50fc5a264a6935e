"""The trainer's packed attention when the value head dim differs from the query/key one (multi-head latent
attention: DeepSeek-V3 192 / 128, the tiny test models 24 / 12): outputs and gradients equal each sample's own
causal attention, on the CPU (length-bucketed sdpa) and on a GPU through FlashAttention's varlen kernel, which takes
one head dim (V padded to the query/key dim, the output cut back)."""

import pytest
import torch

from slime.backends.attention import packed_causal_attention, varlen_supported
from slime.backends.packing import cu_seqlens_of
from tests.backends.test_attention import _reference


def _case(lengths, qk_dim, value_dim, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k = (torch.randn(total, 4, qk_dim, generator=generator, dtype=torch.float64) for _ in range(2))
    v = torch.randn(total, 4, value_dim, generator=generator, dtype=torch.float64)
    weights = torch.randn(total, 4, value_dim, generator=generator, dtype=torch.float64)
    return [t.to(device, dtype).requires_grad_(t is not weights) for t in (q, k, v, weights)]


@pytest.mark.parametrize("qk_dim,value_dim", [(24, 12), (192, 128), (16, 32)])
def test_value_dim_other_than_query_dim_on_the_cpu(qk_dim, value_dim):
    lengths = [37, 5, 64, 1]
    q, k, v, weights = _case(lengths, qk_dim, value_dim, torch.float64, "cpu")
    out = packed_causal_attention(q, k, v, cu_seqlens_of(lengths), max(lengths), qk_dim**-0.5)
    expected = _reference(q, k, v, lengths, qk_dim**-0.5)
    assert out.shape == (sum(lengths), 4, value_dim)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    for grad, expected_grad in zip(torch.autograd.grad((out * weights).sum(), (q, k, v)),
                                   torch.autograd.grad((expected * weights).sum(), (q, k, v))):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and varlen_supported(torch.device("cuda"))),
                    reason="needs CUDA with FlashAttention")
@pytest.mark.parametrize("qk_dim,value_dim", [(192, 128), (24, 16)])
def test_flash_varlen_with_padded_values_equals_reference(qk_dim, value_dim):
    lengths = [300, 17, 1, 128]
    q, k, v, weights = _case(lengths, qk_dim, value_dim, torch.bfloat16, "cuda")
    out = packed_causal_attention(q, k, v, cu_seqlens_of(lengths).cuda(), max(lengths), qk_dim**-0.5)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = _reference(*exact, lengths, qk_dim**-0.5)
    assert out.shape == (sum(lengths), 4, value_dim)
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * weights.double()).sum(), exact)
    for grad, expected_grad in zip(grads, expected_grads):
        assert grad.shape == expected_grad.shape
        torch.testing.assert_close(grad.double(), expected_grad, rtol=5e-2, atol=5e-2)
