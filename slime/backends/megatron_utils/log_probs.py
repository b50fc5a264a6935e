"""Log-probs and entropy of sampled tokens under `logits / temperature`, two ways:

- TP = 1: the output layer hands back its input (`return_hidden_states`), and the log-probs come from the hidden
  states of the response positions and the output weight through the project's chunked head
  (slime/backends/log_probs.py: the fused Triton kernels on CUDA, the chunked torch path elsewhere), so
  no [tokens, vocabulary] logits exist at once, as in the FSDP backend;
- TP > 1: from vocab-parallel logits, each tensor-parallel rank holding the logits of its slice of the (padded)
  vocabulary, [N, V / tp]; the full-vocabulary logits are never gathered. All-reduces over the TP group (max, sum
  of exp, target logit and the entropy's sum of p * z): `reduce_from_tensor_model_parallel_region` sums forward
  and passes the gradient through unchanged, which is the gradient of a sum whose result every TP rank then uses
  identically. Columns past the real vocabulary (Megatron's padding) are excluded from the softmax.

Not the loss: the caller's `loss_of` turns these into its share of the loss.
"""

from __future__ import annotations

import types

import torch

from slime.backends.log_probs import chunked_log_probs_and_entropy


def _hidden_states_out(self, input_, weight=None, runtime_gather_output=None, **kwargs):
    return input_, None


def return_hidden_states(model) -> None:
    """Make a last-stage GPTModel at TP = 1 return the final hidden states [1, T, H] where it returned logits
    (its output layer passes its input through; the parameter and its name stay, for checkpoints and sync)."""
    model.output_layer.forward = types.MethodType(_hidden_states_out, model.output_layer)


def output_weight(model, vocab_size: int) -> torch.Tensor:
    """The output layer's weight (the embedding when tied) without Megatron's vocabulary padding rows."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()[:vocab_size]
    return model.output_layer.weight[:vocab_size]


def hidden_state_log_probs_and_entropy(model, hidden: torch.Tensor, target_ids: torch.Tensor, temperature: float,
                                       vocab_size: int, chunk_size: int | None):
    """hidden [N, H] of the positions predicting `target_ids` -> log p(target), entropy (fp32 [N])."""
    return chunked_log_probs_and_entropy(hidden, output_weight(model, vocab_size), target_ids, temperature,
                                         chunk_size)


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
