"""Log-probs and entropy of sampled tokens under `logits / temperature`, computed from the final hidden states in
token chunks so that at most one chunk of full-vocabulary fp32 logits exists at a time, in forward and in
backward (the backward recomputes each chunk's logits instead of saving them).

Not a model: it takes hidden states [N, H] and the output-layer weight [V, H] (no bias).
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_SIZE = 1024


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


def chunked_log_probs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, target_ids: torch.Tensor,
                                  temperature: float = 1.0, chunk_size: int | None = DEFAULT_CHUNK_SIZE):
    """Per-token log p(target) and entropy (both fp32, shape [N]) of softmax(hidden @ weight.T / temperature).

    The entropy carries a gradient only where the caller uses it in the loss; otherwise its backward is skipped.
    """
    if chunk_size is None or chunk_size <= 0:
        chunk_size = DEFAULT_CHUNK_SIZE
    return _ChunkedLogProbs.apply(hidden, weight, target_ids, float(temperature), int(chunk_size))
