"""A request's images as the engine keeps them: the processor's pixel values and grids, the prompt's M-RoPE
positions, where its image tokens are, and (while its prompt is being prefilled) the vision encoder's output.

The prompt's image-pad ids are replaced by content ids (`vocab_size + hash of the image's pixels`), so the block
manager's hash chain, which sees only token ids, reuses KV computed for the same image and never for a changed
one; the model embeds those rows from the vision encoder, not from the vocabulary. Plain data, no torch compute.
Not here: the processor's expansion (slime/utils/image_policy.py), the encoder (models/vl_model.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from slime.engine.models.mrope import mrope_positions
from slime.utils.image_inputs import image_content_key
from slime.utils.image_policy import EncodedPrompt, image_pad_runs, image_token_counts

CONTENT_ID_RANGE = 1 << 30


@dataclass
class ImagePrompt:
    pixel_values: object  # [sum of patches, C * T * P * P] (host)
    image_grid_thw: object  # [num_images, 3]
    positions: np.ndarray  # [3, num_prompt_tokens] M-RoPE positions
    rope_delta: int  # a position p past the prompt rotates as p + rope_delta on every axis
    image_token_positions: np.ndarray  # sorted prompt positions of the image tokens
    prompt_token_ids: list[int]  # the prompt with the real image-pad ids (what the caller sent, expanded)
    # the encoder's output for every image token of the prompt, on the device; None until needed (and after prefill)
    embeds: object | None = None
    deepstack: list | None = field(default=None)

    @property
    def num_image_tokens(self) -> int:
        return len(self.image_token_positions)


def build_image_prompt(encoded: EncodedPrompt, images, merge_size: int, image_token_id: int,
                       vocab_size: int) -> tuple[list[int], ImagePrompt]:
    """(the token ids the engine schedules: image pads replaced by content ids, the ImagePrompt) of an encoded
    prompt and its images (in order)."""
    grids = encoded.image_grid_thw.tolist()
    positions, rope_delta = mrope_positions(encoded.mm_token_type_ids, grids, merge_size)
    runs = image_pad_runs(encoded.input_ids, image_token_id)
    counts = image_token_counts(grids, merge_size)
    assert [length for _, length in runs] == counts, "the policy's expansion and the grids disagree"
    token_ids = list(encoded.input_ids)
    for (start, length), image in zip(runs, images):
        content_id = vocab_size + int(image_content_key(image)[:15], 16) % CONTENT_ID_RANGE
        token_ids[start:start + length] = [content_id] * length
    image_positions = np.flatnonzero(np.asarray(encoded.mm_token_type_ids) == 1)
    prompt = ImagePrompt(encoded.pixel_values, encoded.image_grid_thw, positions, rope_delta, image_positions,
                         list(encoded.input_ids))
    return token_ids, prompt
