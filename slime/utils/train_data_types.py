"""The train data: the dict the RolloutManager hands each trainer rank for one rollout, as a TypedDict.

`slime.ray.train_data.samples_to_train_data` builds the per-sample lists (one entry per Sample, same order in every
list) and `split_train_data` cuts them into one dict per data-parallel rank, adding the three scalars at the end.
The trainers (`slime.backends.train_flow`, `critic_flow`, `schedule`, `routing_replay`) read it by these keys, and a
`--custom-advantage-function-path` function receives a copy of it. `total=False`: the optional keys are present
only when every sample (for `rollout_routed_experts`: any sample) carries the field. Not here: the keys a
`--custom-convert-samples-to-train-data-path` function may add beyond these, nor what the trainer adds to its own
copy (log-probs, advantages).
"""

from __future__ import annotations

from typing import Any, TypedDict


class TrainData(TypedDict, total=False):
    """One data-parallel rank's train data for one rollout; sample i belongs to optimizer step
    `i // (global_batch_size // data-parallel size)`."""

    tokens: list[list[int]]
    """Prompt + response token ids of each sample."""
    response_lengths: list[int]
    """Number of response tokens of each sample (the last `response_length` entries of `tokens`)."""
    loss_masks: list[list[int]]
    """Per response token, 1 if the loss counts it (tokens the policy sampled), 0 if not; all 0 for a removed sample."""
    rewards: list[float]
    """The reward the advantage uses: post-processed (group-normalised for GRPO-family estimators, RLOO baseline)."""
    raw_reward: list[float]
    """The reward as the reward function gave it (`Sample.get_reward_value`), before post-processing."""
    group_indices: list[int | None]
    """`Sample.group_index`: which prompt group the sample belongs to."""
    sample_indices: list[int | None]
    """`Sample.index`: the sample's index in the rollout (names it in errors and debug dumps)."""
    truncated: list[int]
    """1 if the sample stopped at the length limit (status TRUNCATED), else 0."""
    rollout_ids: list[int]
    """`Sample.rollout_id`: siblings of one fan-out share it; samples without one get a fresh id each."""
    rollout_mask_sums: list[float]
    """Loss-mask total over every sample of the sample's rollout (its siblings' share one per-token mean)."""
    rollout_num_samples: list[int]
    """Number of samples of the sample's rollout (1 unless a generate function fanned out)."""
    rollout_log_probs: list[list[float]]
    """The engine's log-prob of each response token (present when every sample has them)."""
    weight_versions: list[str]
    """The engine weight version that finished each sample (its last; present when every sample has one)."""
    teacher_log_probs: list[list[float]]
    """On-policy distillation teacher's log-prob of each response token (present when every sample has them)."""
    rollout_routed_experts: list[Any]
    """R3: per sample an int32 array [len(tokens) - 1, num_hidden_layers, top_k] of the engine's expert ids
    (SGLang's layout: every decoder layer, dense layers zeros)."""
    multimodal_train_inputs: list[dict | None]
    """Vision-language (present when any sample has images): per sample the processor's `pixel_values`
    [num_patches, patch_dim] and `image_grid_thw` [num_images, 3] of its prompt's images, or None."""
    rollout_id: int
    """The rollout step this data belongs to."""
    num_steps_per_rollout: int
    """Optimizer steps the trainer takes over this data."""
    global_batch_size: int
    """Samples per optimizer step over all data-parallel ranks (after the even split)."""
