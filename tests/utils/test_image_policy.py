"""The one image-size policy: odd image sizes give the token counts of Qwen's published resize rule, the prompt
expansion (from text or from token ids) agrees with itself, and mismatched inputs are refused by name."""

import json
import math

import pytest

from slime.utils.image_policy import IMAGE_PLACEHOLDER, image_pad_runs, load_vl_processor, vl_model_type
from slime.utils.tiny_vl_model import TINY_MAX_PIXELS, TINY_MIN_PIXELS
from tests.helpers.vl_checkpoints import random_image, tiny_vl_checkpoint

ARCHES = ["qwen2_5_vl", "qwen3_vl"]
ODD_SIZES = [(1, 1), (7, 300), (61, 97), (33, 33), (129, 17), (250, 251), (400, 600)]


def reference_tokens(height, width, patch, merge, min_pixels, max_pixels):
    """Qwen-VL's resize, written from its description: both sides to the nearest multiple of patch * merge, then
    scaled down (floor) above max_pixels or up (ceil) below min_pixels, aspect ratio kept."""
    factor = patch * merge
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return (h // patch) * (w // patch) // (merge * merge)


@pytest.fixture(scope="module", params=ARCHES)
def processor(request, tmp_path_factory):
    return load_vl_processor(tiny_vl_checkpoint(request.param, tmp_path_factory.mktemp("vl")))


def test_odd_sizes_match_the_published_rule(processor):
    patch = {"qwen2_5_vl": 14, "qwen3_vl": 16}[processor.model_type]
    assert processor.patch_size == patch and processor.merge_size == 2
    for height, width in ODD_SIZES:
        expected = reference_tokens(height, width, patch, 2, TINY_MIN_PIXELS, TINY_MAX_PIXELS)
        image = random_image(height, width)
        assert processor.num_image_tokens(image) == expected, (height, width)
        encoded = processor.encode(f"a {IMAGE_PLACEHOLDER} b", [image])
        assert encoded.input_ids.count(processor.image_token_id) == expected
        assert sum(encoded.mm_token_type_ids) == expected
        assert encoded.pixel_values.shape[0] == expected * 4  # patches = tokens * merge**2


def test_text_and_token_id_routes_expand_identically(processor):
    images = [random_image(61, 97, seed=3), random_image(130, 45, seed=4)]
    text = f"<|im_start|>user\n{IMAGE_PLACEHOLDER} and {IMAGE_PLACEHOLDER}?<|im_end|>\n"
    from_text = processor.encode(text, images)
    unexpanded = processor.tokenizer(text)["input_ids"]
    assert [length for _, length in image_pad_runs(unexpanded, processor.image_token_id)] == [1, 1]
    from_ids = processor.expand_input_ids(unexpanded, images)
    assert from_ids.input_ids == from_text.input_ids
    assert from_ids.mm_token_type_ids == from_text.mm_token_type_ids
    assert from_ids.image_grid_thw.tolist() == from_text.image_grid_thw.tolist()
    assert (from_ids.pixel_values == from_text.pixel_values).all()
    # already expanded ids pass through unchanged
    assert processor.expand_input_ids(from_text.input_ids, images).input_ids == from_text.input_ids
    counts = [length for _, length in image_pad_runs(from_text.input_ids, processor.image_token_id)]
    assert counts == [processor.num_image_tokens(image) for image in images]


def test_mismatches_are_refused(processor):
    image = random_image(61, 97)
    with pytest.raises(ValueError, match="1 image placeholder.*2 image"):
        processor.encode(f"x {IMAGE_PLACEHOLDER}", [image, image])
    ids = processor.tokenizer(f"x {IMAGE_PLACEHOLDER}")["input_ids"]
    with pytest.raises(ValueError, match="1 run.*0 image"):
        processor.expand_input_ids(ids, [])
    pad = processor.image_token_id
    start = ids.index(pad)
    wrong = ids[:start] + [pad] * 2 + ids[start + 1:]
    with pytest.raises(ValueError, match="image 0 has 2 pad tokens"):
        processor.expand_input_ids(wrong, [image])


def test_chat_template_places_one_placeholder_per_image(processor):
    messages = [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "hi"},
                                             {"type": "image", "image": "b.png"}]}]
    text = processor.apply_chat_template(messages)
    assert text.count(IMAGE_PLACEHOLDER) == 2 and text.endswith("<|im_start|>assistant\n")


def test_non_vl_checkpoints_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert vl_model_type(tmp_path) is None
    with pytest.raises(ValueError, match="model_type must be one of"):
        load_vl_processor(tmp_path)


@pytest.mark.parametrize("arch, config, size, expected_tokens", [
    # Qwen2.5-VL's release: min_pixels / max_pixels keys, the slow processor's name
    ("qwen2_5_vl", {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                    "merge_size": 2, "image_processor_type": "Qwen2VLImageProcessor"}, (224, 300), 88),
    # Qwen3-VL's release form: a size dict, the fast processor's name (loaded with the PIL backend all the same)
    ("qwen3_vl", {"size": {"longest_edge": 100000, "shortest_edge": 4000}, "patch_size": 16, "temporal_patch_size": 2,
                  "merge_size": 2, "image_processor_type": "Qwen2VLImageProcessorFast"}, (1000, 1500), 96),
])
def test_release_style_processor_configs(arch, config, size, expected_tokens, tmp_path_factory):
    import shutil

    source = tiny_vl_checkpoint(arch, tmp_path_factory.mktemp("vl"))
    target = tmp_path_factory.mktemp("release") / arch
    shutil.copytree(source, target)
    (target / "preprocessor_config.json").write_text(json.dumps(config))
    processor = load_vl_processor(target)
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    height, width = size
    patch = config["patch_size"]
    bounds = (config.get("min_pixels") or config["size"]["shortest_edge"],
              config.get("max_pixels") or config["size"]["longest_edge"])
    assert reference_tokens(height, width, patch, 2, *bounds) == expected_tokens
    assert processor.num_image_tokens(random_image(height, width)) == expected_tokens
