"""The vocabulary split over the ranks: the token embedding and the LM head.

The vocabulary is padded to a multiple of tp_size (`padded_vocab_size`); rank r holds rows [r * V_pad / tp,
(r + 1) * V_pad / tp) of the embedding (and of an untied LM head; a tied head shares the embedding's shard). The
padding rows, past the real vocabulary, are zeros and never looked up.
- `VocabParallelEmbedding`: each rank looks up the ids that fall in its rows, gives zero rows for the others, and
  one all-reduce sums the ranks' rows into every token's embedding.
- `ParallelLMHead`: each rank computes the logits of its rows; an all-gather along the vocabulary gives every rank
  the full logits, sliced back to the real vocabulary, so sampling and log-probs read what one rank would.

At tp_size 1 they are `nn.Embedding` / a bias-free `nn.Linear` (parameter `weight` [vocab, hidden], same forward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slime.engine.parallel.state import ParallelState


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size) * tp_size


class _VocabShard(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelState):
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.num_local_rows = padded_vocab_size(vocab_size, parallel.tp_size) // parallel.tp_size
        self.vocab_start = parallel.tp_rank * self.num_local_rows
        # the rows of this shard inside the real vocabulary (the rest is padding)
        self.num_valid_rows = max(0, min(vocab_size - self.vocab_start, self.num_local_rows))
        self.weight = nn.Parameter(torch.zeros(self.num_local_rows, hidden_size))


class VocabParallelEmbedding(_VocabShard):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.num_local_rows)
        rows = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        return self.parallel.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(_VocabShard):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits [..., vocab_size] on every rank."""
        logits = F.linear(hidden, self.weight)
        if self.parallel.tp_size == 1:
            return logits
        logits = self.parallel.all_gather_last_dim(logits)
        return logits if logits.shape[-1] == self.vocab_size else logits[..., : self.vocab_size].contiguous()
