"""Train-data bookkeeping for the FSDP trainer: which samples form each optimizer step, how a step's samples are
split into micro-batches, and how a micro-batch is packed into one padding-free row.

Packing: the samples of a micro-batch are concatenated into a single row; `position_ids` restart at 0 for every
sample, and transformers turns restarting positions (with no attention mask and no KV cache) into a block-diagonal
causal mask, so no token attends across samples (on the GPU, `cu_seqlens` drives FlashAttention's varlen
kernel instead, see attention.py). Only the positions whose hidden state predicts a response token
are gathered for the log-prob head (`logit_index`). Pure torch, no distributed code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slime.backends.fsdp_utils.attention import cu_seqlens_of


@dataclass
class PackedMicroBatch:
    input_ids: torch.Tensor  # [1, num_tokens]
    position_ids: torch.Tensor  # [1, num_tokens]
    logit_index: torch.Tensor  # [num_response_tokens] positions whose hidden state predicts a response token
    target_ids: torch.Tensor  # [num_response_tokens] the response tokens themselves
    sample_indices: list[int]  # indices into the rank's train-data lists
    response_lengths: list[int]
    cu_seqlens: torch.Tensor  # [num_samples + 1] int32: where each sample starts in the row (varlen attention)
    max_seqlen: int

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def to(self, device) -> "PackedMicroBatch":
        return PackedMicroBatch(
            to_device(self.input_ids, device), to_device(self.position_ids, device),
            to_device(self.logit_index, device), to_device(self.target_ids, device), self.sample_indices,
            self.response_lengths, to_device(self.cu_seqlens, device), self.max_seqlen,
        )


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """Copy a host tensor to `device` without making the host wait for the GPU. A plain `.to("cuda")` of pageable
    memory synchronises the stream: the host would stall until the previous micro-batch's backward had finished
    and the GPU would then idle while the next forward's kernels are queued. From pinned memory the copy is queued
    (the caching host allocator keeps the pinned block until the copy has run)."""
    if torch.device(device).type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def outputs_per_sample(schedule, forward, device) -> dict[int, torch.Tensor]:
    """Run `forward(micro_batch on device) -> [the micro-batch's response tokens]` over every micro-batch of the
    schedule; returns {sample index: its slice, on the host}. One copy to the host at the end, not one per
    micro-batch: each would wait for the GPU and leave it idle while the next micro-batch is queued."""
    micro_batches = [micro_batch for step in schedule for micro_batch in step]
    if not micro_batches:
        return {}
    outputs = torch.cat([forward(micro_batch.to(device)) for micro_batch in micro_batches]).cpu()
    result = {}
    pieces = outputs.split([sum(micro_batch.response_lengths) for micro_batch in micro_batches])
    for micro_batch, piece in zip(micro_batches, pieces):
        result.update(zip(micro_batch.sample_indices, piece.split(micro_batch.response_lengths)))
    return result


def pack_samples(tokens: list[list[int]], response_lengths: list[int], sample_indices: list[int]) -> PackedMicroBatch:
    """Concatenate the given samples (full token lists, prompt + response) into one packed row."""
    input_ids, position_ids, logit_index, target_ids, lengths, sample_lengths = [], [], [], [], [], []
    offset = 0
    for index in sample_indices:
        sample_tokens = tokens[index]
        num_tokens, response_length = len(sample_tokens), response_lengths[index]
        if not 0 < response_length < num_tokens:
            raise ValueError(f"sample {index}: response_length {response_length} must be in [1, {num_tokens - 1}] "
                             "(a sample needs at least one prompt token and one response token)")
        input_ids.extend(sample_tokens)
        position_ids.extend(range(num_tokens))
        first_predictor = offset + num_tokens - response_length - 1
        logit_index.extend(range(first_predictor, first_predictor + response_length))
        target_ids.extend(sample_tokens[num_tokens - response_length:])
        lengths.append(response_length)
        sample_lengths.append(num_tokens)
        offset += num_tokens
    return PackedMicroBatch(
        input_ids=torch.tensor([input_ids], dtype=torch.long),
        position_ids=torch.tensor([position_ids], dtype=torch.long),
        logit_index=torch.tensor(logit_index, dtype=torch.long),
        target_ids=torch.tensor(target_ids, dtype=torch.long),
        sample_indices=list(sample_indices),
        response_lengths=lengths,
        cu_seqlens=cu_seqlens_of(sample_lengths),
        max_seqlen=max(sample_lengths),
    )


def step_sample_indices(num_samples: int, num_steps: int) -> list[list[int]]:
    """Sample i of a rank's lists belongs to step i // (num_samples // num_steps) (docs/internals.md)."""
    if num_steps < 1 or num_samples % num_steps != 0 or num_samples == 0:
        raise ValueError(f"{num_samples} train samples on this rank cannot be split into {num_steps} equal "
                         "optimizer steps (global_batch_size x num_steps_per_rollout must match the rollout)")
    per_step = num_samples // num_steps
    return [list(range(step * per_step, (step + 1) * per_step)) for step in range(num_steps)]


def split_micro_batches(indices: list[int], lengths: list[int], micro_batch_size: int,
                        max_tokens: int | None = None) -> list[list[int]]:
    """Static chunks of `micro_batch_size` samples, or, with `max_tokens`, first-fit bins of at most `max_tokens`
    tokens (a sample longer than the budget gets a bin of its own)."""
    if max_tokens is None:
        return [indices[i:i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]
    bins: list[list[int]] = []
    bin_tokens: list[int] = []
    for index in indices:
        length = lengths[index]
        for b, used in enumerate(bin_tokens):
            if used + length <= max_tokens:
                bins[b].append(index)
                bin_tokens[b] += length
                break
        else:
            bins.append([index])
            bin_tokens.append(length)
    return bins


def pad_num_micro_batches(bins: list[list[int]], lengths: list[int], target: int) -> list[list[int]]:
    """Split the largest multi-sample bins until there are `target` bins, so that every FSDP rank runs the same
    number of forward/backward passes (their collectives must pair up)."""
    bins = [list(b) for b in bins]
    while len(bins) < target:
        splittable = [b for b in bins if len(b) > 1]
        assert splittable, f"cannot split {len(bins)} micro-batches into {target}"
        largest = max(splittable, key=lambda b: sum(lengths[i] for i in b))
        position = bins.index(largest)
        half = len(largest) // 2
        bins[position:position + 1] = [largest[:half], largest[half:]]
    return bins
