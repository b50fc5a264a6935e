"""Train-data bookkeeping shared by the training backends: which samples form each optimizer step, how a step's samples are
split into micro-batches, and how a micro-batch is packed into one padding-free row.

Packing: the samples of a micro-batch are concatenated into a single row; `position_ids` restart at 0 for every
sample, and transformers turns restarting positions (with no attention mask and no KV cache) into a block-diagonal
causal mask, so no token attends across samples (on the GPU, `cu_seqlens` drives FlashAttention's varlen
kernel instead, see attention.py). Only the positions whose hidden state predicts a response token
are gathered for the log-prob head (`logit_index`). Vision-language samples bring their images' processor outputs
(`multimodal_train_inputs`: `pixel_values` rows and `image_grid_thw`), concatenated in sample order with the number of
images of each sample. Pure torch and numpy, no distributed code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


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
    # MoE routing to replay, [num_tokens, num_moe_layers, top_k] (routing_replay.py), or None
    routed_experts: torch.Tensor | None = None
    # Vision-language: the images of the row's samples in sample order (pixel_values [num_patches, patch_dim],
    # image_grid_thw [num_images, 3]) and how many images each sample has; None for text-only rows
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    num_images: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def to(self, device) -> "PackedMicroBatch":
        return PackedMicroBatch(
            to_device(self.input_ids, device), to_device(self.position_ids, device),
            to_device(self.logit_index, device), to_device(self.target_ids, device), self.sample_indices,
            self.response_lengths, to_device(self.cu_seqlens, device), self.max_seqlen,
            None if self.routed_experts is None else to_device(self.routed_experts, device),
            None if self.pixel_values is None else to_device(self.pixel_values, device),
            None if self.image_grid_thw is None else to_device(self.image_grid_thw, device), self.num_images,
        )


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """Copy a host tensor to `device` without making the host wait for the GPU. A plain `.to("cuda")` of pageable
    memory synchronises the stream: the host would stall until the previous micro-batch's backward had finished
    and the GPU would then idle while the next forward's kernels are queued. From pinned memory the copy is queued
    (the caching host allocator keeps the pinned block until the copy has run)."""
    if torch.device(device).type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def outputs_per_sample(schedule, forward_all) -> dict[int, torch.Tensor]:
    """Run `forward_all(micro_batches) -> [per micro-batch: a tensor over its response tokens]` over every
    micro-batch of the schedule; returns {sample index: its slice, on the host}. One copy to the host at the end,
    not one per micro-batch: each would wait for the GPU and leave it idle while the next micro-batch is queued."""
    micro_batches = [micro_batch for step in schedule for micro_batch in step]
    if not micro_batches:
        return {}
    outputs = torch.cat(forward_all(micro_batches)).cpu()
    result = {}
    pieces = outputs.split([sum(micro_batch.response_lengths) for micro_batch in micro_batches])
    for micro_batch, piece in zip(micro_batches, pieces):
        result.update(zip(micro_batch.sample_indices, piece.split(micro_batch.response_lengths)))
    return result


def float_tensors(rows: list[list[float]]) -> list[torch.Tensor]:
    """Per-sample float32 tensors of Python lists (loss masks, log-probs), through numpy: ~2.5x faster than
    torch.tensor on a list."""
    return [torch.from_numpy(np.asarray(row, dtype=np.float32)) for row in rows]


def pack_samples(tokens: list[list[int]], response_lengths: list[int], sample_indices: list[int],
                 multimodal_train_inputs: list[dict | None] | None = None) -> PackedMicroBatch:
    """Concatenate the given samples (full token lists, prompt + response) into one packed row. Index arithmetic in
    numpy: building the row element by element in Python cost ~20 ms per 80k tokens, with the GPU waiting.
    `multimodal_train_inputs`: per sample of the rank's lists, its images' processor outputs or None."""
    sample_lengths, lengths = [], []
    for index in sample_indices:
        num_tokens, response_length = len(tokens[index]), response_lengths[index]
        if not 0 < response_length < num_tokens:
            raise ValueError(f"sample {index}: response_length {response_length} must be in [1, {num_tokens - 1}] "
                             "(a sample needs at least one prompt token and one response token)")
        sample_lengths.append(num_tokens)
        lengths.append(response_length)
    input_ids = np.concatenate([np.asarray(tokens[index], dtype=np.int64) for index in sample_indices])
    num_tokens = np.asarray(sample_lengths, dtype=np.int64)
    starts = np.cumsum(num_tokens) - num_tokens
    position_ids = np.arange(len(input_ids)) - np.repeat(starts, num_tokens)
    # Response token j of a sample (0-based) is predicted by the hidden state one position before it.
    num_response = np.asarray(lengths, dtype=np.int64)
    first_predictor = starts + num_tokens - num_response - 1
    response_offsets = np.arange(num_response.sum()) - np.repeat(np.cumsum(num_response) - num_response, num_response)
    logit_index = np.repeat(first_predictor, num_response) + response_offsets
    return PackedMicroBatch(
        input_ids=torch.from_numpy(input_ids)[None],
        position_ids=torch.from_numpy(position_ids)[None],
        logit_index=torch.from_numpy(logit_index),
        target_ids=torch.from_numpy(input_ids[logit_index + 1]),
        sample_indices=list(sample_indices),
        response_lengths=lengths,
        cu_seqlens=cu_seqlens_of(sample_lengths),
        max_seqlen=max(sample_lengths),
        **_packed_images(multimodal_train_inputs, sample_indices),
    )


def _packed_images(multimodal_train_inputs: list[dict | None] | None, sample_indices: list[int]) -> dict:
    """The row's pixel_values / image_grid_thw / num_images (PackedMicroBatch fields), {} when no sample has images."""
    if multimodal_train_inputs is None:
        return {}
    inputs = [multimodal_train_inputs[index] or {} for index in sample_indices]
    for index, sample_inputs in zip(sample_indices, inputs):
        unknown = sorted(set(sample_inputs) - {"pixel_values", "image_grid_thw"})
        if unknown:
            raise ValueError(f"sample {index}: multimodal_train_inputs has {unknown}; the trainer takes images only "
                             "(pixel_values, image_grid_thw)")
    num_images = [len(sample_inputs["image_grid_thw"]) if "image_grid_thw" in sample_inputs else 0
                  for sample_inputs in inputs]
    if not any(num_images):
        return {}
    with_images = [sample_inputs for sample_inputs, count in zip(inputs, num_images) if count]
    return {"pixel_values": torch.cat([torch.as_tensor(x["pixel_values"]) for x in with_images]),
            "image_grid_thw": torch.cat([torch.as_tensor(x["image_grid_thw"]) for x in with_images]),
            "num_images": num_images}


def step_sample_indices(num_samples: int, num_steps: int) -> list[list[int]]:
    """Sample i of a rank's lists belongs to step i // (num_samples // num_steps) (docs/contracts/train-data.md)."""
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


def cu_seqlens_of(sample_lengths: list[int]) -> torch.Tensor:
    """[0, l0, l0 + l1, ...] as int32, the sample boundaries within a packed row (varlen attention kernels)."""
    cumulative = [0]
    for length in sample_lengths:
        cumulative.append(cumulative[-1] + length)
    return torch.tensor(cumulative, dtype=torch.int32)
