"""Images in prompt rows (slime's `--multimodal-keys`): the columns that hold them, the `<image>` placeholders of
the prompt text that they fill, and the chat messages that carry them to the checkpoint's chat template.

A row's image column holds one item or a list: a file path, a `file://` URL, a `data:image/...;base64,` URI or bare
base64 (or Qwen's rich form `{"type": "image", "image": ...}`). Each `<image>` in a string prompt (or in a string
message content) takes the next item, in order; a prompt without placeholders gets its images before the text. The
images are decoded here, once, so a missing or corrupt image is an error naming the data file, the row and the item.
The Sample keeps the decoded images as slime does (`multimodal_inputs = {"images": [PIL images]}`); the rollout's
processor turns them into prompt ids and pixel values (slime.rollout.generate_request).

Not here: resizing or image-token counts (slime.utils.image_policy, the one policy), the engine side.
"""

from __future__ import annotations

from slime.utils.image_inputs import ImageInputError, image_to_data_uri, load_image

IMAGE_PLACEHOLDER = "<image>"  # slime's MultimodalTypes placeholder for images in prompt text


def row_images(row: dict, location: str, multimodal_keys: dict[str, str]) -> list:
    """The decoded RGB images of a row's image column (`--multimodal-keys {"image": COLUMN}`)."""
    column = multimodal_keys["image"]
    if column not in row:
        raise ValueError(f"{location}: image column {column!r} (--multimodal-keys) not found; the row has keys "
                         f"{sorted(row)}")
    items = row[column]
    if items is None:
        return []
    if not isinstance(items, (list, tuple)):
        items = [items]
    return [load_image_named(item, f"{location}: column {column!r} item {index}") for index, item in enumerate(items)]


def load_image_named(item, what: str):
    """load_image, with `what` (where the image came from) in front of its error."""
    try:
        return load_image(item)
    except ImageInputError as error:
        raise ValueError(f"{what}: {error}") from None


def _content_parts(text: str, images: list, next_image: int, location: str) -> tuple[list[dict], int]:
    pieces = text.split(IMAGE_PLACEHOLDER)
    parts: list[dict] = []
    for position, piece in enumerate(pieces):
        if position > 0:
            if next_image >= len(images):
                raise ValueError(f"{location}: the prompt has more {IMAGE_PLACEHOLDER} placeholders than the "
                                 f"{len(images)} image(s) of its row")
            parts.append({"type": "image", "image": images[next_image]})
            next_image += 1
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts, next_image


def messages_with_images(prompt, images: list, location: str) -> list[dict]:
    """Chat messages whose contents hold the images as `{"type": "image", "image": PIL}` parts, each at its
    `<image>` placeholder. A prompt without any placeholder gets all its images at the start of the first user
    message. Every image must be placed exactly once."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    num_placeholders = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages if isinstance(m["content"], str))
    if num_placeholders == 0 and images:
        first_user = next((m for m in messages if m["role"] == "user"), None)
        if first_user is None or not isinstance(first_user["content"], str):
            raise ValueError(f"{location}: {len(images)} image(s) but no {IMAGE_PLACEHOLDER} placeholder and no "
                             "user message with text content to put them in")
        first_user["content"] = IMAGE_PLACEHOLDER * len(images) + first_user["content"]
    next_image = 0
    for message in messages:
        if isinstance(message["content"], str):
            message["content"], next_image = _content_parts(message["content"], images, next_image, location)
    if next_image != len(images):
        raise ValueError(f"{location}: the prompt has {next_image} {IMAGE_PLACEHOLDER} placeholder(s) but its row has "
                         f"{len(images)} image(s); put one placeholder per image")
    return messages


def messages_without_pixels(messages: list[dict]) -> list[dict]:
    """The messages with each image part reduced to `{"type": "image"}` (what the chat template needs; kept in the
    Sample's metadata, so the images themselves are held once, in `multimodal_inputs`)."""
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [{"type": "image"} if part.get("type") == "image" else part for part in content]
        out.append({**message, "content": content})
    return out


def sample_dict_to_json(sample_dict: dict) -> dict:
    """A `Sample.to_dict()` made JSON-safe for the data source's saved state: its images as lossless PNG data URIs,
    and no `multimodal_train_inputs` (the rollout derives them again from the prompt and the images)."""
    images = (sample_dict.get("multimodal_inputs") or {}).get("images")
    if images:
        sample_dict["multimodal_inputs"] = {**sample_dict["multimodal_inputs"],
                                            "images": [image_to_data_uri(image) for image in images]}
    if sample_dict.get("multimodal_train_inputs") is not None:
        sample_dict["multimodal_train_inputs"] = None
    return sample_dict


def sample_dict_from_json(sample_dict: dict) -> dict:
    """sample_dict_to_json's inverse: the images decoded again."""
    images = (sample_dict.get("multimodal_inputs") or {}).get("images")
    if images:
        sample_dict["multimodal_inputs"] = {**sample_dict["multimodal_inputs"],
                                            "images": [load_image(image) for image in images]}
    return sample_dict
