"""Held-out accuracy of a vl_shapes checkpoint, greedy, with transformers `generate` (independent of the engine):
the share of test rows whose first answer word is the label.

    python -m examples.vl_shapes.evaluate CHECKPOINT TEST_JSONL
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from examples.vl_shapes.reward import first_word
from slime.rollout.multimodal_data import messages_with_images, messages_without_pixels, row_images
from slime.utils.image_policy import load_vl_processor


def accuracy(checkpoint: str | Path, test_file: str | Path, max_new_tokens: int = 4) -> float:
    from transformers import AutoModelForImageTextToText

    processor = load_vl_processor(checkpoint)
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in Path(test_file).read_text().splitlines() if line.strip()]
    correct = 0
    for number, row in enumerate(rows, start=1):
        location = f"{test_file}:{number}"
        images = row_images(row, location, {"image": "images"})
        text = processor.apply_chat_template(messages_without_pixels(messages_with_images(row["prompt"], images,
                                                                                          location)))
        encoded = processor.encode(text, images)
        ids = torch.tensor([encoded.input_ids])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 mm_token_type_ids=torch.tensor([encoded.mm_token_type_ids]),
                                 pixel_values=encoded.pixel_values, image_grid_thw=encoded.image_grid_thw,
                                 max_new_tokens=max_new_tokens, do_sample=False)
        answer = processor.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=False)
        correct += first_word(answer) == str(row["label"]).lower()
    return correct / len(rows)


if __name__ == "__main__":
    print(json.dumps({"accuracy": accuracy(sys.argv[1], sys.argv[2])}))
