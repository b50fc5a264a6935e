"""One rank's schedule of a rollout's train data: per optimizer step, its samples split into micro-batches (static
--micro-batch-size chunks; first-fit bins of --max-tokens-per-gpu tokens with --use-dynamic-batch-size; slime's
FLOPs-balanced bins with --balance-by-flops) and each packed into one row, with as many micro-batches on every
data-parallel rank (their collectives pair up), a multiple of the backend's `num_micro_batches_multiple` (the
largest bins split until it is). The forward-only passes get their own schedule when
--log-probs-max-tokens-per-gpu gives them a larger budget.

Not the packing itself (packing.py) nor the data-parallel split (slime/ray/train_data.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slime.backends.packing import (
    PackedMicroBatch,
    pack_samples,
    pad_num_micro_batches,
    split_micro_batches,
    step_sample_indices,
)
from slime.utils.flops_balance import balanced_micro_batches, linear_coefficient
from slime.utils.train_data_types import TrainData


def train_schedule(args, data: TrainData, backend, max_tokens_per_gpu: int | None = None) -> list[list[PackedMicroBatch]]:
    """Per optimizer step, this rank's packed micro-batches; with dynamic batch sizes at most `max_tokens_per_gpu`
    (default --max-tokens-per-gpu) tokens each. Collective over the data-parallel group (`backend.all_reduce`)."""
    tokens = data["tokens"]
    num_steps = data.get("num_steps_per_rollout") or args.num_steps_per_rollout or 1
    lengths = [len(t) for t in tokens]
    max_tokens = (max_tokens_per_gpu or args.max_tokens_per_gpu) if args.use_dynamic_batch_size else None
    steps = step_sample_indices(len(tokens), num_steps)
    if args.balance_by_flops:  # slime's cost model instead of first-fit token bins (dynamic batch sizes)
        coefficient = linear_coefficient(backend.hf_config.to_dict())
        bins_per_step = [balanced_micro_batches(step, lengths, max_tokens, coefficient) for step in steps]
    else:
        bins_per_step = [split_micro_batches(step, lengths, args.micro_batch_size, max_tokens) for step in steps]
    counts = torch.tensor([len(b) for b in bins_per_step], device=backend.device)
    backend.all_reduce(counts, dist.ReduceOp.MAX)
    multiple = backend.num_micro_batches_multiple
    targets = [-(-int(count) // multiple) * multiple for count in counts.tolist()]
    for step, target in zip(steps, targets):
        if len(step) < target:
            raise ValueError(f"a step of {len(step)} samples on this rank cannot be split into {target} micro-batches "
                             f"(a multiple of {multiple}: megatron's interleaved schedule, --pipeline-model-parallel-"
                             "size with virtual stages); raise --global-batch-size or --max-tokens-per-gpu")
    images = data.get("multimodal_train_inputs")
    return [[pack_samples(tokens, data["response_lengths"], b, images) for b in pad_num_micro_batches(bins, lengths, target)]
            for bins, target in zip(bins_per_step, targets)]


def forward_only_schedule(args, data: TrainData, backend, schedule: list[list[PackedMicroBatch]]):
    """The forward-only passes' micro-batches: --log-probs-max-tokens-per-gpu tokens each with dynamic batch sizes
    (they keep no activations for a backward, so they can take more), else `schedule` itself."""
    if not args.use_dynamic_batch_size or args.log_probs_max_tokens_per_gpu == args.max_tokens_per_gpu:
        return schedule
    return train_schedule(args, data, backend, args.log_probs_max_tokens_per_gpu)
