"""The critic's model: the Hugging Face decoder body with a value head (hidden -> 1) instead of the output layer,
returning one value per response token of a packed micro-batch, sharded with FSDP2 like the policy.

A value sits at the same position as the policy's log-prob of that token: the hidden state that predicts it.
Checkpoints hold the body under its HF names plus `value_head.weight`; a plain HF folder (no head) starts the head
at zero, so the first values are 0 everywhere.
"""

from __future__ import annotations

import torch
from torch import nn

from slime.backends.fsdp_utils.model import ShardOptions, packed_hidden_states, shard_model
from slime.backends.packing import PackedMicroBatch


class ValueModel(nn.Module):
    def __init__(self, hf_model: nn.Module):
        super().__init__()
        # Keep the causal LM under the policy's prefix so the body's checkpoint names are the HF ones; its output
        # layer is dropped (an untied one would be dead weight; a tied one is the embedding, kept by the body).
        hf_model.lm_head = nn.Identity()
        self.hf_model = hf_model
        self.value_head = nn.Linear(hf_model.config.hidden_size, 1, bias=False)
        nn.init.zeros_(self.value_head.weight)

    def forward(self, input_ids, position_ids, logit_index, cu_seqlens=None, max_seqlen=None):
        hidden = packed_hidden_states(self.hf_model, input_ids, position_ids, cu_seqlens, max_seqlen)
        hidden = hidden.index_select(0, logit_index)
        # A matmul with the head's row, not Linear + squeeze: FSDP's output must not be a view.
        return hidden.matmul(self.value_head.weight[0]).float()

    def forward_micro_batch(self, micro_batch: PackedMicroBatch) -> torch.Tensor:
        return self(micro_batch.input_ids, micro_batch.position_ids, micro_batch.logit_index, micro_batch.cu_seqlens,
                    micro_batch.max_seqlen)


def build_value_model(hf_model: nn.Module, mesh, options: ShardOptions, *,
                      value_head_weight: torch.Tensor | None) -> ValueModel:
    """Wrap (loading `value_head_weight` when resuming a critic), then shard like the policy."""
    model = ValueModel(hf_model)
    if value_head_weight is not None:
        with torch.no_grad():
            model.value_head.weight.copy_(value_head_weight)
    return shard_model(model, hf_model, mesh, options)
