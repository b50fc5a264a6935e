"""M-RoPE (Qwen2.5-VL, Qwen3-VL): a prompt's 3-D positions (time, row, column) and the rotary cos/sin they give.

Text tokens advance all three axes together; an image's tokens sit on its merged (h / m) x (w / m) grid, offset by
the position where the image starts, and the text after it resumes one past the image's largest index. A token
past the prompt (every generated one) has all three axes equal to `position + rope_delta`, and M-RoPE with equal
axes is plain RoPE at that position: decode steps (and their CUDA graphs) run the text path with shifted positions.

Each frequency of a head's rotary half takes its angle from one axis: in sections (Qwen2.5-VL: the first
mrope_section[0] frequencies from t, the next from h, the rest from w) or interleaved (Qwen3-VL: frequency f from
h when f % 3 == 1 and f < 3 * section[1], from w when f % 3 == 2 and f < 3 * section[2], else from t).
Not here: which tokens are image tokens (image_policy.py), the vision encoder.
"""

from __future__ import annotations

import numpy as np
import torch


def mrope_positions(mm_token_type_ids: list[int], image_grid_thw: list[list[int]], merge_size: int):
    """([3, num_tokens] int64 positions, rope_delta) of a prompt whose image tokens (type 1) come in runs, one run per
    image of `image_grid_thw`, in order."""
    types = np.asarray(mm_token_type_ids, dtype=np.int64)
    positions = np.empty((3, len(types)), dtype=np.int64)
    index, next_position, image = 0, 0, 0
    while index < len(types):
        if types[index] == 0:
            end = index
            while end < len(types) and types[end] == 0:
                end += 1
            positions[:, index:end] = next_position + np.arange(end - index)
            next_position += end - index
            index = end
            continue
        if types[index] != 1:
            raise ValueError("video tokens are not supported (only images)")
        if image >= len(image_grid_thw):
            raise ValueError(f"the prompt has more image-token runs than the {len(image_grid_thw)} image(s) given")
        t, h, w = (int(v) for v in image_grid_thw[image])
        h, w = h // merge_size, w // merge_size
        count = t * h * w
        grid_t, grid_h, grid_w = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        block = np.stack([grid_t.ravel(), grid_h.ravel(), grid_w.ravel()]) + next_position
        if index + count > len(types) or not (types[index:index + count] == 1).all():
            raise ValueError(f"image {image} needs {count} consecutive image tokens in the prompt")
        positions[:, index:index + count] = block
        next_position = int(block.max()) + 1
        index += count
        image += 1
    if image != len(image_grid_thw):
        raise ValueError(f"{len(image_grid_thw)} image(s) given but the prompt has {image} image-token run(s)")
    return positions, next_position - len(types)


def mrope_axis_of_frequency(section: tuple[int, ...], interleaved: bool) -> np.ndarray:
    """[head_dim / 2] which axis (0 t, 1 h, 2 w) each rotary frequency reads its position from."""
    num_freqs = sum(section)
    axis = np.zeros(num_freqs, dtype=np.int64)
    if interleaved:
        f = np.arange(num_freqs)
        axis[(f % 3 == 1) & (f < 3 * section[1])] = 1
        axis[(f % 3 == 2) & (f < 3 * section[2])] = 2
    else:
        axis[section[0]:section[0] + section[1]] = 1
        axis[section[0] + section[1]:] = 2
    return axis


def mrope_cos_sin(cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
                  axis_of_frequency: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rows [num_tokens, head_dim] of the rotate-half cos/sin tables for 3-D positions [3, num_tokens]."""
    axis = torch.cat([axis_of_frequency, axis_of_frequency])  # the table repeats the frequencies for both halves
    columns = torch.arange(axis.numel(), device=cos_table.device)
    rows = positions[axis.to(positions.device)]  # [head_dim, num_tokens]: each column's position
    return cos_table[rows, columns[:, None]].T.contiguous(), sin_table[rows, columns[:, None]].T.contiguous()
