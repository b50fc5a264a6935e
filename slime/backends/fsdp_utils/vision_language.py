"""The FSDP trainer's forward over a transformers vision-language model (Qwen2.5-VL, Qwen3-VL) on a packed row.

One packed row holds several samples back to back, each with its prompt's images. The vision tower encodes every
image of the row in one call (its own block-diagonal attention over the images, sdpa); the language model then runs
once over the row with the image embeddings in place of the image tokens and M-RoPE positions built per sample by the
model's own `get_rope_index` (so they restart at 0 for every sample, as the engine's do). The positions go to the
language model as transformers' packed form, `[4, 1, T]`: row 0 the plain per-sample text positions (the attention
kernels see where samples start), rows 1-3 the temporal / height / width positions.

`mm_token_type_ids` (0 text, 1 image) is derived from the image token id: transformers 5's M-RoPE needs it, and
without it Qwen2.5-VL silently falls back to 1-D positions. Not here: the images' pixels (the rollout's processor
makes them, carried on the Sample as `multimodal_train_inputs`), the log-prob head (model.py).
"""

from __future__ import annotations

import torch
from torch import nn

from slime.utils.image_policy import VL_MODEL_TYPES


def is_vision_language(config) -> bool:
    """A checkpoint config of a vision-language model (one with a vision tower)."""
    return getattr(config, "vision_config", None) is not None


def check_supported(config, flag: str = "--hf-checkpoint") -> None:
    """Refuse a vision-language model this trainer cannot run, by its model type."""
    if is_vision_language(config) and config.model_type not in VL_MODEL_TYPES:
        raise ValueError(f"{flag}: vision-language model type {config.model_type!r} is not supported by the FSDP "
                         f"trainer; supported: {', '.join(VL_MODEL_TYPES)}")


def attention_implementations(text_attention: str) -> dict[str, str]:
    """Per sub-config attention: the packed-row kernel for the language model, sdpa for the vision tower (its
    attention is bidirectional within each image: the causal varlen kernel must never see it)."""
    return {"": text_attention, "text_config": text_attention, "vision_config": "sdpa"}


def image_token_mask(ids: list[int], counts: list[int], image_token_id: int, vision_start_token_id: int,
                     where: str) -> list[bool]:
    """Which of a sample's tokens are its images' tokens: for each image in order, the next run of exactly its
    `count` image-pad ids right after a vision-start id. Other image-pad ids are text: a sampled response token may
    be the pad id (a random or young model samples anything), and the engine treats a sampled token as text."""
    mask = [False] * len(ids)
    position, image = 0, 0
    while position < len(ids) and image < len(counts):
        if ids[position] != image_token_id:
            position += 1
            continue
        run_end = position
        while run_end < len(ids) and ids[run_end] == image_token_id:
            run_end += 1
        if run_end - position == counts[image] and position > 0 and ids[position - 1] == vision_start_token_id:
            mask[position:run_end] = [True] * (run_end - position)
            image += 1
        position = run_end
    if image < len(counts):
        raise ValueError(f"{where}: image {image} of {len(counts)} has no run of {counts[image]} image tokens after a "
                         "vision-start token; the prompt ids and the pixel values must come from the same processor "
                         "call")
    return mask


def packed_image_mask(hf_model: nn.Module, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                      image_grid_thw: torch.Tensor | None, num_images: list[int]) -> torch.Tensor:
    """[1, T] bool: image_token_mask of every sample of a packed row, each with its own images."""
    config = hf_model.config
    merge = hf_model.model.visual.spatial_merge_size
    counts = [] if image_grid_thw is None else (image_grid_thw.prod(-1) // merge ** 2).tolist()
    ids = input_ids[0].tolist()
    bounds = cu_seqlens.tolist()
    mask, first_image = [], 0
    for index, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        sample_counts = counts[first_image:first_image + num_images[index]]
        first_image += num_images[index]
        mask += image_token_mask(ids[start:end], sample_counts, config.image_token_id, config.vision_start_token_id,
                                 f"packed sample {index}")
    return torch.tensor(mask, device=input_ids.device)[None]


def packed_mrope_position_ids(hf_model: nn.Module, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                              image_grid_thw: torch.Tensor | None, num_images: list[int],
                              image_mask: torch.Tensor) -> torch.Tensor:
    """[4, 1, T]: per sample, its text positions (0..L-1) and its 3-D M-RoPE positions from the model's
    `get_rope_index` over that sample alone with that sample's image grids and image tokens (`image_mask`)."""
    model = hf_model.model
    bounds = cu_seqlens.tolist()
    grids = image_grid_thw.split(num_images) if image_grid_thw is not None else [None] * len(num_images)
    pieces = []
    for index, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        ids = input_ids[:, start:end]
        token_types = image_mask[:, start:end].to(torch.int32)
        grid = grids[index] if num_images[index] else None
        mrope, _ = model.get_rope_index(ids, mm_token_type_ids=token_types, image_grid_thw=grid)
        text = torch.arange(end - start, device=ids.device, dtype=mrope.dtype).view(1, 1, -1)
        pieces.append(torch.cat([text, mrope], dim=0))
    return torch.cat(pieces, dim=2)


def _placeholder_image(hf_model: nn.Module, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values, image_grid_thw) of the smallest image the vision tower takes: one merged patch of zeros."""
    vision = hf_model.config.vision_config
    merge = vision.spatial_merge_size
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    return (torch.zeros(merge * merge, width, device=device),
            torch.tensor([[1, merge, merge]], device=device))


def vision_language_hidden_states(hf_model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                                  pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None,
                                  image_mask: torch.Tensor, language_kwargs: dict) -> torch.Tensor:
    """Final hidden states [T, hidden] of a packed VL row: the image features in place of the tokens `image_mask`
    marks (packed_image_mask; not every image-pad id), Qwen3-VL's deepstack features added at the same tokens. A row
    without images still runs the vision tower, on a placeholder image whose output enters times zero: FSDP's
    collectives of the sharded vision blocks (all-gathers forward, reduce-scatters backward) must pair up across ranks
    whose rows differ.
    `position_ids`: packed_mrope_position_ids's [4, 1, T]; `language_kwargs`: the attention kernel's packed-row
    arguments (cu_seq_lens_q ...), for the language model only."""
    model = hf_model.model
    embeds = model.get_input_embeddings()(input_ids)
    deepstack = {}
    if pixel_values is None:  # every rank runs the (sharded) vision tower in step, images or not
        features = model.get_image_features(*_placeholder_image(hf_model, embeds.device), return_dict=True)
        outputs = list(features.pooler_output) + [t for layer in getattr(features, "deepstack_features", None) or []
                                                  for t in layer]
        embeds = embeds + sum(output.sum() for output in outputs).to(embeds.dtype) * 0.0
    else:
        features = model.get_image_features(pixel_values, image_grid_thw, return_dict=True)
        image_embeds = torch.cat(features.pooler_output).to(embeds.dtype)
        embeds = embeds.masked_scatter(image_mask[..., None].expand_as(embeds), image_embeds)
        if getattr(features, "deepstack_features", None):
            deepstack = {"visual_pos_masks": image_mask,
                         "deepstack_visual_embeds": [torch.cat(layer).to(embeds.dtype)
                                                     for layer in features.deepstack_features]}
    outputs = model.language_model(inputs_embeds=embeds, position_ids=position_ids, use_cache=False, **deepstack,
                                   **language_kwargs)
    return outputs.last_hidden_state[0]
