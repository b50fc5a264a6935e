"""A step's vision-language inputs: each token's M-RoPE positions and, for the image tokens the step computes, the
vision encoder's rows (the encoder run once, batched, over the images of every sequence that needs them).

Called by the model runner for a VL model on steps outside the decode CUDA graphs; decode graphs only shift their
positions by each row's rope_delta (`decode_rope_deltas`). Text sequences in the same batch keep 1-D positions on
all three axes. A sequence's encoder output is dropped once its prompt is computed (recomputed if it is preempted).
"""

from __future__ import annotations

import numpy as np
import torch

from slime.engine.scheduled_batch import ScheduledSequence


def decode_rope_deltas(seqs) -> np.ndarray:
    """Each row's rope_delta (0 for a text sequence): a generated token at p rotates as p + rope_delta."""
    return np.fromiter((seq.image_prompt.rope_delta if seq.image_prompt is not None else 0 for seq in seqs),
                       dtype=np.int64, count=len(seqs))


def _encode_missing(model, items: list[ScheduledSequence], device) -> None:
    """Run the vision encoder once over every image of the sequences in `items` that have no embeddings yet."""
    prompts = [item.seq.image_prompt for item in items if item.seq.image_prompt.embeds is None]
    if not prompts:
        return
    pixel_values = torch.cat([prompt.pixel_values for prompt in prompts]).to(device)
    grids = torch.cat([torch.as_tensor(prompt.image_grid_thw) for prompt in prompts]).to(device)
    embeds, deepstack = model.encode_images(pixel_values, grids)
    sizes = [prompt.num_image_tokens for prompt in prompts]
    for index, prompt in enumerate(prompts):
        start = sum(sizes[:index])
        prompt.embeds = embeds[start:start + sizes[index]]
        prompt.deepstack = [feature[start:start + sizes[index]] for feature in deepstack]


def vision_step_inputs(model, scheduled: list[ScheduledSequence], device):
    """(positions, image_embeds, deepstack) of a flat batch: positions [3, num_tokens] when a scheduled chunk holds
    prompt tokens of a sequence with images, else [num_tokens] shifted by rope_delta; the encoder rows of the
    step's image tokens in flat order (None when it has none)."""
    pieces, need_3d, image_items = [], False, []
    for item in scheduled:
        prompt = item.seq.image_prompt
        positions = np.arange(item.start, item.start + item.num_new_tokens, dtype=np.int64)
        if prompt is None:
            pieces.append(np.broadcast_to(positions, (3, len(positions))))
            continue
        in_prompt = positions < prompt.positions.shape[1]
        rows = np.broadcast_to(positions + prompt.rope_delta, (3, len(positions))).copy()
        rows[:, in_prompt] = prompt.positions[:, positions[in_prompt]]
        need_3d |= bool(in_prompt.any())
        pieces.append(rows)
        image_positions = prompt.image_token_positions
        lo, hi = np.searchsorted(image_positions, [item.start, item.start + item.num_new_tokens])
        if hi > lo:
            image_items.append((item, int(lo), int(hi)))
    positions = np.concatenate(pieces, axis=1)
    positions_t = torch.from_numpy(positions if need_3d else positions[0].copy()).to(device)
    if not image_items:
        return positions_t, None, None
    _encode_missing(model, [item for item, _, _ in image_items], device)
    embeds = torch.cat([item.seq.image_prompt.embeds[lo:hi] for item, lo, hi in image_items])
    num_deepstack = len(image_items[0][0].seq.image_prompt.deepstack)
    deepstack = [torch.cat([item.seq.image_prompt.deepstack[k][lo:hi] for item, lo, hi in image_items])
                 for k in range(num_deepstack)]
    for item, _, _ in image_items:  # the prompt's last chunk: its encoder rows are no longer needed
        prompt = item.seq.image_prompt
        if item.start + item.num_new_tokens >= prompt.positions.shape[1]:
            prompt.embeds, prompt.deepstack = None, None
    return positions_t, embeds, deepstack
