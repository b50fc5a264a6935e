"""The Megatron critic's value head: a last-stage GPTModel's output layer replaced by a hidden -> 1 projection, as
slime's critic does (its `LinearForLastLayer`), and the values of a packed micro-batch's response tokens.

As the FSDP critic's head (fsdp_utils/value_model.py) it has no bias and starts at zero (slime's draws it from
N(0, 0.02) with a zero bias), so a critic built from an HF model gives 0 everywhere at first and both backends'
critics start and train alike. A value sits where the policy's log-prob of that token does: the hidden state that
predicts it.

Parallelism: the head is replicated over tensor parallelism (every TP rank holds the whole [1, hidden] weight and
computes the same values from the full hidden states, as the loss then is the same on every TP rank). With sequence
parallelism each rank projects its slice of the row and the values are all-gathered; the backward hands each rank
its slice's gradient, so the head's gradient is a partial sum over TP (grads.py sums the parameters marked
`sequence_parallel`). Pipeline parallelism: only the last stage has it.

Checkpoints: in torch_dist the head is the model's `output_layer.weight` [1, hidden]; in an HF folder it is
`value_head.weight` (the FSDP critic's name), and a plain HF model has none (the head starts at zero).

Not the decoder (model.py), not the value loss (loss.py) and not the critic's flow (critic_flow.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from slime.backends.checkpoint_files import VALUE_HEAD_KEY
from slime.backends.packing import PackedMicroBatch, to_device

OUTPUT_LAYER_KEY = "output_layer.weight"


class ValueHead(torch.nn.Module):
    """In place of GPTModel's output layer: hidden states [s, b, hidden] -> fp32 values [s, b, 1]."""

    def __init__(self, config):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, config.hidden_size, dtype=config.params_dtype))
        self.sequence_parallel = config.sequence_parallel
        if self.sequence_parallel:
            self.weight.sequence_parallel = True

    def forward(self, input_, weight=None, runtime_gather_output=None):
        values = input_.matmul(self.weight.t()).float()
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


def install_value_head(model) -> None:
    """Replace a last-stage GPTModel's output layer by a zero ValueHead (the model must not tie its output layer to
    the embedding: the head is a weight of its own)."""
    if model.share_embeddings_and_output_weights:
        raise ValueError("the critic's GPTModel ties its output layer to the embedding; the value head needs an "
                         "untied model (--custom-model-provider-path: build it with "
                         "share_embeddings_and_output_weights=False)")
    model.output_layer = ValueHead(model.config)


def micro_batch_values(micro_batch: PackedMicroBatch, output: torch.Tensor) -> torch.Tensor:
    """The last stage's output [1, T, 1] -> fp32 values [num_response_tokens] (micro_batches.py's `head`)."""
    return output[0, :, 0].index_select(0, to_device(micro_batch.logit_index, output.device))


def hf_value_head(path: str | Path, hidden_size: int) -> torch.Tensor:
    """The full head [1, hidden] an HF folder holds (`value_head.weight`), or zeros when it has none."""
    from slime.backends.megatron_utils.hf_weights import LazyHFCheckpoint

    checkpoint = LazyHFCheckpoint(path)
    if VALUE_HEAD_KEY in checkpoint:
        return checkpoint.read(VALUE_HEAD_KEY).reshape(1, hidden_size)
    return torch.zeros(1, hidden_size)


def has_value_head(torch_dist_dir: str | Path) -> bool:
    """Whether a torch_dist checkpoint holds a critic (a [1, hidden] output layer) rather than a policy."""
    from megatron.core.dist_checkpointing import load_tensors_metadata

    tensor = load_tensors_metadata(str(torch_dist_dir)).get(OUTPUT_LAYER_KEY)
    return tensor is not None and tuple(tensor.global_shape)[0] == 1
