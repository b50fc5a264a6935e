"""The trainer's attention over packed rows off the GPU (length-bucketed, padded sdpa): the same outputs and
gradients as each sample's own causal attention computed independently, and the same log-probs and gradients as
transformers' dense-mask sdpa over the packed row."""

import math

import pytest
import torch

from slime.backends.attention import VARLEN, bucketed_causal_attention, packed_causal_attention
from slime.backends.packing import cu_seqlens_of, pack_samples


def _reference(q, k, v, lengths, scale):
    """Each sample on its own, softmax written out, K/V heads repeated to the query heads."""
    group = q.shape[1] // k.shape[1]
    pieces, start = [], 0
    for length in lengths:
        qs, ks, vs = (t[start:start + length].transpose(0, 1) for t in (q, k, v))  # [H, L, D]
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        scores = qs @ ks.transpose(1, 2) * scale
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1), -math.inf)
        pieces.append((scores.softmax(-1) @ vs).transpose(0, 1))
        start += length
    return torch.cat(pieces)


@pytest.mark.parametrize("lengths", [[37, 200, 5, 129, 1, 64, 65], [9], [3, 3, 3], [1, 1]])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_bucketed_attention_equals_each_sample_alone(lengths, num_kv_heads):
    generator = torch.Generator().manual_seed(len(lengths) + num_kv_heads)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, 16, generator=generator, dtype=torch.float64, requires_grad=True)
               for heads in (4, num_kv_heads, num_kv_heads))
    weights = torch.randn(total, 4, 16, generator=generator, dtype=torch.float64)
    out = packed_causal_attention(q, k, v, cu_seqlens_of(lengths), max(lengths), 0.25)
    expected = _reference(q, k, v, lengths, 0.25)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (q, k, v))
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)


def test_samples_never_see_each_other():
    """Changing one sample's keys and values leaves every other sample's output bit-identical."""
    lengths = [7, 30, 12, 8]
    q, k, v = (torch.randn(sum(lengths), 2, 8) for _ in range(3))
    before = bucketed_causal_attention(q, k, v, cu_seqlens_of(lengths), 0.3)
    k2, v2 = k.clone(), v.clone()
    k2[7:37] += 5.0
    v2[7:37] -= 3.0
    after = bucketed_causal_attention(q, k2, v2, cu_seqlens_of(lengths), 0.3)
    assert torch.equal(before[:7], after[:7]) and torch.equal(before[37:], after[37:])
    assert not torch.allclose(before[7:37], after[7:37])


def test_packed_log_probs_and_gradients_match_dense_sdpa(tmp_path):
    from transformers import AutoModelForCausalLM

    from slime.backends.fsdp_utils.model import PolicyModel, attention_implementation
    from slime.utils.tiny_model import build_tiny_model

    assert attention_implementation() == VARLEN
    checkpoint = build_tiny_model(tmp_path / "tiny", arch="qwen3", seed=5, hidden_size=64, intermediate_size=128,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    generator = torch.Generator().manual_seed(0)
    lengths, response_lengths = [37, 200, 5, 129], [20, 150, 2, 100]
    tokens = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in lengths]
    batch = pack_samples(tokens, response_lengths, [0, 1, 2, 3])

    def packed(implementation):
        hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64, attn_implementation=implementation)
        log_probs, entropy = PolicyModel(hf).forward_micro_batch(batch)
        (log_probs.sum() + entropy.sum()).backward()
        return log_probs.detach(), [p.grad for p in hf.parameters()]

    bucketed_log_probs, bucketed_grads = packed(VARLEN)
    dense_log_probs, dense_grads = packed("sdpa")
    torch.testing.assert_close(bucketed_log_probs, dense_log_probs, rtol=1e-9, atol=1e-10)
    for grad, dense_grad in zip(bucketed_grads, dense_grads):
        torch.testing.assert_close(grad, dense_grad, rtol=1e-8, atol=1e-10)
