"""The one image-size policy of slime: how an image is resized, patched, and how many image tokens it expands to.

Rollout, engine and trainer all go through `VLProcessor` (built by `load_vl_processor` from the checkpoint's own
`preprocessor_config.json`, tokenizer and chat template), so the image-token count of a prompt can never differ
between them (slime #1803's failure). The count is the checkpoint's HF processor's: the image processor's
`smart_resize` to multiples of patch_size * merge_size within [min_pixels, max_pixels], then
`grid_t * grid_h * grid_w / merge_size**2` tokens, exactly what `Qwen2_5_VLProcessor` / `Qwen3VLProcessor` put in.

The image processor always runs its PIL backend: the torchvision backend resizes with different interpolation
code, so a machine with torchvision and one without would give different pixel values for the same image.
Images only: the HF processors' video sub-processor needs torchvision, and videos are refused by name.

Not here: decoding image references (image_inputs.py), the vision encoder (the engine and the trainers).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from slime.utils.image_inputs import load_image

VL_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl")
IMAGE_PAD = "<|image_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
# what one image looks like in a prompt before expansion (the chat template writes it)
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END


@dataclass
class EncodedPrompt:
    """A prompt with its images as the model consumes it: `input_ids` with every image's pad token repeated
    `num_image_tokens` times, `mm_token_type_ids` (0 text, 1 image) for M-RoPE, and the image processor's
    `pixel_values` [sum of patches, C * T * P * P] and `image_grid_thw` [num_images, 3] (None without images)."""

    input_ids: list[int]
    mm_token_type_ids: list[int]
    pixel_values: object | None
    image_grid_thw: object | None


def image_token_counts(image_grid_thw, merge_size: int):
    """Image tokens per image in the language model: t * h * w / merge_size**2 (the processor's rule)."""
    grid = image_grid_thw.tolist() if hasattr(image_grid_thw, "tolist") else image_grid_thw
    return [t * h * w // (merge_size * merge_size) for t, h, w in grid]


def _processor_class(model_type: str):
    from transformers import Qwen2_5_VLProcessor, Qwen3VLProcessor

    base = {"qwen2_5_vl": Qwen2_5_VLProcessor, "qwen3_vl": Qwen3VLProcessor}[model_type]

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template)

    # The HF processor class, less its video sub-processor (whose class needs torchvision): its text expansion,
    # mm_token_type_ids and image handling are HF's own code.
    return type(f"{base.__name__}ImagesOnly", (base,), {"__init__": __init__})


class VLProcessor:
    """The checkpoint's HF processor (images only) plus the policy's few derived facts. Build with
    `load_vl_processor`."""

    def __init__(self, hf_processor, model_type: str):
        self.hf_processor = hf_processor
        self.model_type = model_type
        self.tokenizer = hf_processor.tokenizer
        self.image_processor = hf_processor.image_processor
        self.merge_size = int(self.image_processor.merge_size)
        self.patch_size = int(self.image_processor.patch_size)
        self.image_token_id = int(hf_processor.image_token_id)
        self.video_token_id = int(hf_processor.video_token_id)
        self.vision_start_token_id = int(self.tokenizer.convert_tokens_to_ids(VISION_START))
        self.vision_end_token_id = int(self.tokenizer.convert_tokens_to_ids(VISION_END))

    def image_grid(self, image) -> tuple[int, int, int]:
        """(t, h, w) in patches of one image after the processor's resize."""
        features = self.image_processor(images=[load_image(image)], return_tensors="pt")
        return tuple(int(v) for v in features["image_grid_thw"][0].tolist())

    def num_image_tokens(self, image) -> int:
        """How many image-pad tokens one image expands to in the language model."""
        return image_token_counts([self.image_grid(image)], self.merge_size)[0]

    def process_images(self, images):
        """pixel_values [sum of patches, C*T*P*P] and image_grid_thw [num_images, 3] of a list of images."""
        features = self.image_processor(images=[load_image(image) for image in images], return_tensors="pt")
        return features["pixel_values"], features["image_grid_thw"]

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text of chat messages (images as one placeholder each, unexpanded)."""
        return self.hf_processor.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)

    def encode(self, text: str, images=()) -> EncodedPrompt:
        """Tokenize `text`, expanding its i-th image placeholder to the i-th image's tokens (the HF processor's
        own expansion). The number of placeholders must equal the number of images."""
        images = [load_image(image) for image in images]
        num_placeholders = text.count(IMAGE_PAD)
        if num_placeholders != len(images):
            raise ValueError(f"the prompt has {num_placeholders} image placeholder(s) ({IMAGE_PLACEHOLDER}) but "
                             f"{len(images)} image(s) were given; put one placeholder per image, in order")
        features = self.hf_processor(text=[text], images=images or None, return_tensors="pt",
                                     return_mm_token_type_ids=True)
        return EncodedPrompt(
            input_ids=features["input_ids"][0].tolist(),
            mm_token_type_ids=features["mm_token_type_ids"][0].tolist(),
            pixel_values=features.get("pixel_values") if images else None,
            image_grid_thw=features.get("image_grid_thw") if images else None,
        )

    def expand_input_ids(self, input_ids: list[int], images) -> EncodedPrompt:
        """Token ids with images, as SGLang's `/generate` accepts them: each image either as ONE pad token (expanded
        here) or already expanded to its processor count. Any other count is refused, naming the image."""
        images = [load_image(image) for image in images]
        runs = image_pad_runs(input_ids, self.image_token_id)
        if len(runs) != len(images):
            raise ValueError(f"input_ids hold {len(runs)} run(s) of image pad tokens (id {self.image_token_id}) but "
                             f"{len(images)} image(s) were given in image_data; one run per image, in order")
        pixel_values, image_grid_thw = self.process_images(images) if images else (None, None)
        counts = image_token_counts(image_grid_thw, self.merge_size) if images else []
        expanded, cursor = [], 0
        for index, ((start, length), count) in enumerate(zip(runs, counts)):
            if length not in (1, count):
                raise ValueError(f"image {index} has {length} pad tokens in input_ids but the processor expands it "
                                 f"to {count}; send one pad token per image or the processor's expansion")
            expanded += input_ids[cursor:start] + [self.image_token_id] * count
            cursor = start + length
        expanded += input_ids[cursor:]
        mm_token_type_ids = [1 if token == self.image_token_id else 0 for token in expanded]
        return EncodedPrompt(expanded, mm_token_type_ids, pixel_values, image_grid_thw)


def image_pad_runs(input_ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of image pad tokens."""
    runs, index = [], 0
    while index < len(input_ids):
        if input_ids[index] == image_token_id:
            start = index
            while index < len(input_ids) and input_ids[index] == image_token_id:
                index += 1
            runs.append((start, index - start))
        else:
            index += 1
    return runs


def vl_model_type(checkpoint: str | Path) -> str | None:
    """The checkpoint's model_type when it is a supported vision-language model, else None."""
    config_path = Path(checkpoint) / "config.json"
    if not config_path.is_file():
        return None
    model_type = json.loads(config_path.read_text()).get("model_type")
    return model_type if model_type in VL_MODEL_TYPES else None


def load_vl_processor(checkpoint: str | Path) -> VLProcessor:
    """The image policy of a Qwen2.5-VL / Qwen3-VL checkpoint, from its own processor files (offline)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    model_type = vl_model_type(checkpoint)
    if model_type is None:
        raise ValueError(f"{checkpoint} is not a vision-language checkpoint this project supports "
                         f"(config.json model_type must be one of {VL_MODEL_TYPES})")
    if not (Path(checkpoint) / "preprocessor_config.json").is_file():
        raise ValueError(f"{checkpoint} has no preprocessor_config.json: a vision-language checkpoint needs its "
                         f"image processor's settings (copy them from the model's release)")
    image_processor = AutoImageProcessor.from_pretrained(str(checkpoint), backend="pil")
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    chat_template = tokenizer.chat_template
    template_file = Path(checkpoint) / "chat_template.jinja"
    if template_file.is_file():
        chat_template = template_file.read_text()
    hf_processor = _processor_class(model_type)(image_processor, tokenizer, chat_template=chat_template)
    return VLProcessor(hf_processor, model_type)
