"""Packed forward and the chunked log-prob head against plain transformers / full-vocabulary references."""

import pytest
import torch

from slime.backends.fsdp_utils.model import PolicyModel, load_hf_model
from slime.backends.log_probs import chunked_log_probs_and_entropy
from slime.backends.packing import pack_samples
from slime.utils.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), arch="qwen3", seed=1)


CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager", pytest.param("flex_attention", marks=CUDA_ONLY)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_log_probs_equal_per_sample_forward(tiny_checkpoint, attn_implementation, temperature):
    device = "cuda" if attn_implementation == "flex_attention" else "cpu"
    hf_model = load_hf_model(str(tiny_checkpoint), attn_implementation=attn_implementation).eval().to(device)
    generator = torch.Generator().manual_seed(0)
    vocab = hf_model.config.vocab_size
    lengths = [(3, 4), (1, 1), (6, 9), (2, 5)]  # (prompt, response)
    tokens = [torch.randint(3, vocab, (p + r,), generator=generator).tolist() for p, r in lengths]
    response_lengths = [r for _, r in lengths]
    model = PolicyModel(hf_model, temperature=temperature, chunk_size=5)
    packed = pack_samples(tokens, response_lengths, [0, 1, 2, 3]).to(device)
    with torch.no_grad():
        log_probs, entropy = model.forward_micro_batch(packed)
        expected_lp, expected_ent = [], []
        for sample, r in zip(tokens, response_lengths):
            logits = hf_model(torch.tensor([sample], device=device)).logits[0].float() / temperature
            log_softmax = torch.log_softmax(logits[len(sample) - r - 1:-1], dim=-1)
            expected_lp.append(log_softmax.gather(1, torch.tensor(sample[-r:], device=device)[:, None]).squeeze(1))
            expected_ent.append(-(log_softmax.exp() * log_softmax).sum(-1))
    torch.testing.assert_close(log_probs, torch.cat(expected_lp), rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, torch.cat(expected_ent), rtol=0, atol=1e-5)


def test_pack_samples_layout():
    packed = pack_samples([[5, 6, 7], [8, 9], [1, 2, 3, 4]], [1, 1, 2], [2, 0])
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert packed.logit_index.tolist() == [1, 2, 5]
    assert packed.target_ids.tolist() == [3, 4, 7]
    assert packed.response_lengths == [2, 1]
    with pytest.raises(ValueError, match="response_length"):
        pack_samples([[1, 2]], [2], [0])


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_log_probs_and_entropy_match_full_logits(chunk_size, temperature):
    generator = torch.Generator().manual_seed(chunk_size)
    num_tokens, hidden_size, vocab = 11, 8, 37
    hidden = torch.randn(num_tokens, hidden_size, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (num_tokens,), generator=generator)
    upstream_lp = torch.randn(num_tokens, generator=generator, dtype=torch.float64)
    upstream_ent = torch.randn(num_tokens, generator=generator, dtype=torch.float64)

    log_softmax = torch.log_softmax(hidden @ weight.t() / temperature, dim=-1)
    ref_lp = log_softmax.gather(1, targets[:, None]).squeeze(1)
    ref_ent = -(log_softmax.exp() * log_softmax).sum(-1)
    ref_grads = torch.autograd.grad((ref_lp * upstream_lp).sum() + (ref_ent * upstream_ent).sum(), (hidden, weight))

    lp, ent = chunked_log_probs_and_entropy(hidden, weight, targets, temperature, chunk_size)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=1e-5)
    grads = torch.autograd.grad((lp * upstream_lp).sum() + (ent * upstream_ent).sum(), (hidden, weight))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Without an entropy term the backward skips the entropy path and still matches.
    log_softmax = torch.log_softmax(hidden @ weight.t() / temperature, dim=-1)
    ref_lp = log_softmax.gather(1, targets[:, None]).squeeze(1)
    ref_grads = torch.autograd.grad((ref_lp * upstream_lp).sum(), (hidden, weight))
    lp, _ = chunked_log_probs_and_entropy(hidden, weight, targets, temperature, chunk_size)
    grads = torch.autograd.grad((lp * upstream_lp).sum(), (hidden, weight))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
