"""Log-probs and entropy of sampled tokens under `logits / temperature` from vocab-parallel logits: each
tensor-parallel rank holds the logits of its slice of the (padded) vocabulary, [N, V / tp]; the full-vocabulary
logits are never gathered. Three all-reduces over the TP group (max, sum of exp, target logit and the entropy's
sum of p * z): `reduce_from_tensor_model_parallel_region` sums forward and passes the gradient through unchanged,
which is the gradient of a sum whose result every TP rank then uses identically. Columns past the real
vocabulary (Megatron's padding) are excluded from the softmax.

Not the GPU's fused head (slime/backends/fsdp_utils/log_probs.py): that one takes hidden states at TP=1.
"""

from __future__ import annotations

import torch


def vocab_parallel_log_probs_and_entropy(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float,
                                         vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V_local] (this rank's vocab slice), target_ids [N] (global ids) -> log p(target), entropy;
    both fp32 [N], identical on every TP rank."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    local_vocab = logits.shape[-1]
    start = tp_rank * local_vocab
    z = logits.float() / temperature
    real = torch.arange(start, start + local_vocab, device=z.device) < vocab_size
    if not bool(real.all()):
        z = z.masked_fill(~real, float("-inf"))
    with torch.no_grad():
        z_max = z.max(dim=-1).values
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            torch.distributed.all_reduce(z_max, op=torch.distributed.ReduceOp.MAX,
                                         group=parallel_state.get_tensor_model_parallel_group())
    shifted = z - z_max[:, None]
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    log_normaliser = sum_exp.log()
    local_target = target_ids - start
    in_slice = (local_target >= 0) & (local_target < local_vocab)
    picked = shifted.gather(1, local_target.clamp(0, local_vocab - 1)[:, None]).squeeze(1)
    target_logit = reduce_from_tensor_model_parallel_region(torch.where(in_slice, picked, torch.zeros_like(picked)))
    log_probs = target_logit - log_normaliser
    # H = log sum exp(z) - sum p z, in the shifted frame (the shift cancels).
    weighted = torch.where(real, exp * shifted, torch.zeros_like(exp)).sum(dim=-1)
    entropy = log_normaliser - reduce_from_tensor_model_parallel_region(weighted) / sum_exp
    return log_probs, entropy
