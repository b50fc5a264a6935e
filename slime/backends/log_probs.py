"""Log-probs and entropy of sampled tokens under `logits / temperature`, computed from the final hidden states in
token chunks so that at most one chunk of full-vocabulary fp32 logits exists at a time, in forward and in
backward (the backward recomputes each chunk's logits instead of saving them).

On CUDA (with triton installed) the same computation runs through `triton_log_probs`: the matmuls stay in torch
and the softmax / gather / entropy passes are one Triton kernel each way, on logits kept in the matmul's dtype. The
torch code here is the reference and the CPU path.

Not a model: it takes hidden states [N, H] and the output-layer weight [V, H] (no bias).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

DEFAULT_CHUNK_SIZE = 1024
# The fused path holds one chunk of logits in the matmul's dtype (bf16: 4096 x 151,936 x 2 B = 1.2 GB), not fp32
# copies, so it affords larger chunks; larger matmuls and fewer kernel launches per token.
FUSED_DEFAULT_CHUNK_SIZE = 4096


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target_ids, temperature, chunk_size):
        ctx.set_materialize_grads(False)
        num_tokens = hidden.shape[0]
        log_probs = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            logits = (hidden[start:end] @ weight.t()).float() / temperature
            log_softmax = torch.log_softmax(logits, dim=-1)
            log_probs[start:end] = log_softmax.gather(1, target_ids[start:end, None]).squeeze(1)
            entropy[start:end] = -(log_softmax.exp() * log_softmax).sum(-1)
        ctx.save_for_backward(hidden, weight, target_ids, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, target_ids, entropy = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            chunk_hidden = hidden[start:end]
            logits = (chunk_hidden @ weight.t()).float() / ctx.temperature
            log_softmax = torch.log_softmax(logits, dim=-1)
            probs = log_softmax.exp()
            grad_logits = torch.zeros_like(logits)
            if grad_log_probs is not None:
                # d log p(y) / d z = onehot(y) - p
                grad_chunk = grad_log_probs[start:end, None]
                grad_logits -= grad_chunk * probs
                grad_logits.scatter_add_(1, target_ids[start:end, None], grad_chunk)
            if grad_entropy is not None:
                # d H / d z_j = -p_j (log p_j + H)
                grad_logits -= grad_entropy[start:end, None] * probs * (log_softmax + entropy[start:end, None])
            grad_logits = (grad_logits / ctx.temperature).to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += (grad_logits.t() @ chunk_hidden).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def uses_fused_path(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    return hidden.is_cuda and weight.is_cuda and triton_available()


def chunked_log_probs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, target_ids: torch.Tensor,
                                  temperature: float = 1.0, chunk_size: int | None = DEFAULT_CHUNK_SIZE):
    """Per-token log p(target) and entropy (both fp32, shape [N]) of softmax(hidden @ weight.T / temperature),
    `chunk_size` tokens at a time (None or <= 0: the path's default, 1024 for torch and 4096 for the fused path).

    The entropy carries a gradient only where the caller uses it in the loss; otherwise its backward is skipped.
    CUDA tensors take the fused Triton path when triton is installed; anything else the torch path.
    """
    if uses_fused_path(hidden, weight):
        from slime.backends.triton_log_probs import FusedChunkedLogProbs

        function, default_chunk_size = FusedChunkedLogProbs, FUSED_DEFAULT_CHUNK_SIZE
    else:
        function, default_chunk_size = _ChunkedLogProbs, DEFAULT_CHUNK_SIZE
    if chunk_size is None or chunk_size <= 0:
        chunk_size = default_chunk_size
    return function.apply(hidden, weight, target_ids, float(temperature), int(chunk_size))


def torch_chunked_log_probs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, target_ids: torch.Tensor,
                                        temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE):
    """The torch path on any device: the reference for the fused one (tests, benchmarks)."""
    return _ChunkedLogProbs.apply(hidden, weight, target_ids, float(temperature), int(chunk_size))
