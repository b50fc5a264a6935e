"""The tiny VL checkpoints load in transformers with their processor, spread their logits, and see the image."""

import pytest
import torch

from slime.utils.image_policy import IMAGE_PLACEHOLDER, load_vl_processor
from tests.helpers.vl_checkpoints import random_image, tiny_vl_checkpoint


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_checkpoint_loads_and_the_image_matters(arch, tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    path = tiny_vl_checkpoint(arch, tmp_path_factory.mktemp("vl"))
    processor = load_vl_processor(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    assert model.config.model_type == arch
    text = f"<|im_start|>user\n{IMAGE_PLACEHOLDER}count<|im_end|>\n<|im_start|>assistant\n"

    def logits(image):
        encoded = processor.encode(text, [image])
        with torch.no_grad():
            return model(input_ids=torch.tensor([encoded.input_ids]),
                         mm_token_type_ids=torch.tensor([encoded.mm_token_type_ids]),
                         pixel_values=encoded.pixel_values, image_grid_thw=encoded.image_grid_thw).logits[0]

    first, second = logits(random_image(61, 97, seed=0)), logits(random_image(61, 97, seed=1))
    assert first.std() > 0.5  # wide enough that a wrong computation shows
    assert (first[-1] - second[-1]).abs().max() > 1e-2  # the last text token attends to the image
