"""The fused Triton log-prob head (`triton_log_probs`) against independent float64 references: forward log-probs,
entropy and log-sum-exp, and the gradients w.r.t. hidden states and output weight for losses on log-probs only,
entropy only, and both; fp32 and bf16 inputs; vocabularies that are not a multiple of the kernels' block.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported) on tiny
CPU shapes, called directly: the dispatcher `chunked_log_probs_and_entropy` sends CPU tensors to the torch path.
The `gpu` test compares the dispatcher's CUDA (fused) result with the torch path at Qwen3-0.6B's head size."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from slime.backends import triton_log_probs
from slime.backends.log_probs import (
    chunked_log_probs_and_entropy,
    torch_chunked_log_probs_and_entropy,
    uses_fused_path,
)
from slime.backends.triton_log_probs import FusedChunkedLogProbs, logits_stats

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter casts fp32 to bf16 by truncation, compiled Triton rounds to nearest (as torch): a truncated
# d loss / d logits is biased by up to one bf16 ulp.
BF16_GRAD_TOLERANCE = 1e-2 if os.environ.get("TRITON_INTERPRET") == "1" else 2e-3
NUM_TOKENS, HIDDEN_SIZE, VOCAB_SIZE = 37, 16, 1000
SMALL_BLOCK_V = 128  # 1000 = 7 * 128 + 104: several column blocks, the last one partial


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(triton_log_probs, "STATS_BLOCK_V", SMALL_BLOCK_V)
    monkeypatch.setattr(triton_log_probs, "GRAD_BLOCK_V", SMALL_BLOCK_V)


def make_problem(seed, dtype=torch.float32, peaked_scale=30.0):
    """hidden [37, 16], weight [1000, 16], targets [37]. Logits have std ~4; rows 0-3 are scaled to near one-hot
    distributions (exp under- and overflow territory); row 0's target is its argmax, the rest random."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(NUM_TOKENS, HIDDEN_SIZE, generator=generator, dtype=torch.float64)
    hidden[:4] *= peaked_scale
    weight = torch.randn(VOCAB_SIZE, HIDDEN_SIZE, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, VOCAB_SIZE, (NUM_TOKENS,), generator=generator)
    targets[0] = (hidden[0] @ weight.t()).argmax()
    return hidden.to(DEVICE, dtype), weight.to(DEVICE, dtype), targets.to(DEVICE)


def reference_from_logits(logits, targets, temperature):
    log_softmax = torch.log_softmax(logits.double().cpu() / temperature, dim=-1)
    log_probs = log_softmax.gather(1, targets.cpu()[:, None]).squeeze(1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs, entropy, torch.logsumexp(logits.double().cpu() / temperature, dim=-1)


def loss_of(log_probs, entropy, terms, seed=7):
    """A loss with random per-token weights on the chosen outputs ('lp', 'ent' or both)."""
    generator = torch.Generator().manual_seed(seed)
    weights_lp, weights_ent = torch.randn(2, log_probs.shape[0], generator=generator, dtype=torch.float64)
    loss = 0
    if "lp" in terms:
        loss = loss + (log_probs.double() * weights_lp.to(log_probs.device)).sum()
    if "ent" in terms:
        loss = loss + (entropy.double() * weights_ent.to(entropy.device)).sum()
    return loss


def reference_grads(hidden, weight, targets, temperature, terms):
    hidden = hidden.detach().double().cpu().requires_grad_()
    weight = weight.detach().double().cpu().requires_grad_()
    log_probs, entropy, _ = reference_from_logits(hidden @ weight.t(), targets, temperature)
    outputs = (log_probs.detach(), entropy.detach())
    return outputs, torch.autograd.grad(loss_of(log_probs, entropy, terms), (hidden, weight))


def fused_grads(hidden, weight, targets, temperature, terms, chunk_size):
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    log_probs, entropy = FusedChunkedLogProbs.apply(hidden, weight, targets, temperature, chunk_size)
    assert log_probs.dtype == entropy.dtype == torch.float32
    grads = torch.autograd.grad(loss_of(log_probs, entropy, terms), (hidden, weight))
    assert grads[0].dtype == hidden.dtype and grads[1].dtype == weight.dtype
    return (log_probs.detach(), entropy.detach()), grads


def torch_grads(hidden, weight, targets, temperature, terms, chunk_size):
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    log_probs, entropy = torch_chunked_log_probs_and_entropy(hidden, weight, targets, temperature, chunk_size)
    return torch.autograd.grad(loss_of(log_probs, entropy, terms), (hidden, weight))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("block_v", [SMALL_BLOCK_V, None])  # None: the default block, wider than the vocabulary
def test_logits_stats_match_float64_reference(monkeypatch, temperature, block_v):
    if block_v is not None:
        monkeypatch.setattr(triton_log_probs, "STATS_BLOCK_V", block_v)
    hidden, weight, targets = make_problem(seed=1)
    logits = hidden @ weight.t()
    log_probs, entropy, row_max, log_sum_exp = logits_stats(logits, targets, temperature)
    lse = row_max.double() + log_sum_exp.double()
    ref_log_probs, ref_entropy, ref_lse = reference_from_logits(logits, targets, temperature)
    # The peaked rows reach |log p| ~ 1e3, where fp32 resolves ~1e-4.
    torch.testing.assert_close(log_probs.cpu().double(), ref_log_probs, rtol=1e-6, atol=2e-5)
    torch.testing.assert_close(lse.cpu(), ref_lse, rtol=1e-6, atol=2e-5)
    torch.testing.assert_close(entropy.cpu().double(), ref_entropy, rtol=0, atol=2e-5)
    assert abs(log_probs[0].item()) < 1e-4 and entropy[:4].max() < 1.0  # the peaked rows are peaked


@pytest.mark.parametrize("terms", [("lp",), ("ent",), ("lp", "ent")])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_gradients_match_float64_reference(small_blocks, terms, temperature):
    hidden, weight, targets = make_problem(seed=2)
    (log_probs, entropy), grads = fused_grads(hidden, weight, targets, temperature, terms, chunk_size=16)
    (ref_log_probs, ref_entropy), ref_grads = reference_grads(hidden, weight, targets, temperature, terms)
    torch.testing.assert_close(log_probs.cpu().double(), ref_log_probs, rtol=1e-6, atol=2e-5)
    torch.testing.assert_close(entropy.cpu().double(), ref_entropy, rtol=0, atol=2e-5)
    torch_path_grads = torch_grads(hidden, weight, targets, temperature, terms, chunk_size=16)
    for got, want, torch_got in zip(grads, ref_grads, torch_path_grads):
        atol = 1e-5 * want.abs().max().item()
        if DEVICE == "cuda":
            # Measured on an H200: cuBLAS's fp32 logits of the peaked rows (|z| ~ 1e2) round differently from the
            # float64 ones, enough to move these gradients by more than the CPU bound; the fused path must then be
            # no worse than twice the torch path's own error on the same device.
            atol = max(atol, 2 * (torch_got.cpu().double() - want).abs().max().item())
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=atol)


def test_fused_single_chunk_with_default_blocks_matches_float64_reference():
    """One chunk (the weight gradient skips the fp32 accumulator) and one column block per row."""
    hidden, weight, targets = make_problem(seed=3)
    terms = ("lp", "ent")
    (log_probs, entropy), grads = fused_grads(hidden, weight, targets, 0.7, terms, chunk_size=NUM_TOKENS)
    (ref_log_probs, ref_entropy), ref_grads = reference_grads(hidden, weight, targets, 0.7, terms)
    torch.testing.assert_close(log_probs.cpu().double(), ref_log_probs, rtol=1e-6, atol=2e-5)
    torch.testing.assert_close(entropy.cpu().double(), ref_entropy, rtol=0, atol=2e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("terms", [("lp",), ("ent",), ("lp", "ent")])
def test_fused_bf16_matches_float64_reference_and_torch_path(small_blocks, terms):
    """bf16 hidden and weight: the logits are rounded to bf16 by the matmul (relative 2^-8), so against the exact
    float64 reference the tolerance is bf16's; against the torch path on the same bf16 logits it is fp32's."""
    hidden, weight, targets = make_problem(seed=4, dtype=torch.bfloat16, peaked_scale=3.0)
    temperature = 0.7
    (log_probs, entropy), grads = fused_grads(hidden, weight, targets, temperature, terms, chunk_size=16)
    (ref_log_probs, ref_entropy), ref_grads = reference_grads(hidden, weight, targets, temperature, terms)
    torch.testing.assert_close(log_probs.cpu().double(), ref_log_probs, rtol=1e-2, atol=0.1)
    torch.testing.assert_close(entropy.cpu().double(), ref_entropy, rtol=0, atol=0.05)
    for got, want in zip(grads, ref_grads):
        relative_error = (got.cpu().double() - want).norm() / want.norm()
        assert relative_error < 2e-2

    hidden_t, weight_t = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    torch_log_probs, torch_entropy = torch_chunked_log_probs_and_entropy(hidden_t, weight_t, targets, temperature, 16)
    torch_grads = torch.autograd.grad(loss_of(torch_log_probs, torch_entropy, terms), (hidden_t, weight_t))
    torch.testing.assert_close(log_probs, torch_log_probs.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, torch_entropy.detach(), rtol=0, atol=1e-5)
    for got, want in zip(grads, torch_grads):
        assert (got.double() - want.double()).norm() / want.double().norm() < BF16_GRAD_TOLERANCE


def test_dispatcher_sends_cpu_tensors_to_torch_path():
    hidden, weight, _ = make_problem(seed=5)
    assert not uses_fused_path(hidden.cpu(), weight.cpu())


@pytest.mark.gpu
def test_dispatcher_cuda_fused_matches_torch_path_at_qwen3_head_size():
    """[4096, 1024] x [151936, 1024] bf16: the dispatcher's fused path (default chunk) against the torch path."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    num_tokens, hidden_size, vocab_size = 4096, 1024, 151936
    hidden = torch.randn(num_tokens, hidden_size, device="cuda", generator=generator).bfloat16()
    weight = (torch.randn(vocab_size, hidden_size, device="cuda", generator=generator) * 0.05).bfloat16()
    targets = torch.randint(0, vocab_size, (num_tokens,), device="cuda", generator=generator)
    assert uses_fused_path(hidden, weight)
    results = []
    for function in (chunked_log_probs_and_entropy, torch_chunked_log_probs_and_entropy):
        hidden_leaf, weight_leaf = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        log_probs, entropy = function(hidden_leaf, weight_leaf, targets, 0.7)
        grads = torch.autograd.grad(loss_of(log_probs, entropy, ("lp", "ent")), (hidden_leaf, weight_leaf))
        results.append((log_probs.detach(), entropy.detach(), *grads))
    (log_probs, entropy, grad_hidden, grad_weight), (ref_lp, ref_ent, ref_grad_hidden, ref_grad_weight) = results
    assert log_probs.dtype == torch.float32 and grad_weight.dtype == torch.bfloat16
    # Different chunk sizes may round a logit to a neighbouring bf16 value (one ulp of |z| ~ 8 is 0.03).
    torch.testing.assert_close(log_probs, ref_lp, rtol=0, atol=0.1)
    assert (log_probs - ref_lp).abs().mean() < 1e-3
    torch.testing.assert_close(entropy, ref_ent, rtol=0, atol=1e-2)
    for got, want in ((grad_hidden, ref_grad_hidden), (grad_weight, ref_grad_weight)):
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
