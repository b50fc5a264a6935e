"""Build tiny random Qwen2.5-VL and Qwen3-VL checkpoints offline, with everything their processor needs: a
byte-level BPE tokenizer holding Qwen's vision special tokens, a chat template that renders image items as
`<|vision_start|><|image_pad|><|vision_end|>`, and the image processor's `preprocessor_config.json`.

Load the processor back with `slime.utils.image_policy.load_vl_processor` (the one image-size policy). The shapes
are for CPU tests and the CPU example: a 2-layer language model of width 64 and a 2-block vision tower of width 32,
initialised wide (`initializer_range`) so that a wrong computation moves the logits. Not a model zoo.
"""

from __future__ import annotations

import json
from pathlib import Path

from slime.utils.image_policy import IMAGE_PAD, VISION_END, VISION_START
from slime.utils.tiny_model import DEFAULT_CORPUS, build_tokenizer

TINY_VL_ARCHES = ("qwen2_5_vl", "qwen3_vl")
VL_SPECIAL_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, "<|video_pad|>"]

VL_CORPUS = DEFAULT_CORPUS + [
    "How many circles are in the image? Answer: \\boxed{3}",
    "What colour is the square? red green blue yellow black white",
    "Which shape is largest: circle, square or triangle?",
]

# Qwen-VL's layout: string content as is, list content item by item (text, or one placeholder per image).
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] or [] %}"
    "{% if item['type'] == 'image' or 'image' in item %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Pixel bounds of the tiny processor: small images stay small (the CPU budget), odd sizes still get resized.
TINY_MIN_PIXELS = 4 * 28 * 28
TINY_MAX_PIXELS = 256 * 28 * 28


def build_vl_tokenizer(out_dir: str | Path, corpus: list[str] | None = None, vocab_size: int = 512):
    """A byte-level BPE tokenizer with Qwen's chat and vision special tokens and the VL chat template."""
    tokenizer = build_tokenizer(out_dir, corpus or VL_CORPUS, vocab_size=vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": VL_SPECIAL_TOKENS})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def tiny_vl_config(arch: str, vocab_size: int, special_ids: dict, initializer_range: float, **overrides):
    """The transformers config of a tiny Qwen2.5-VL (patch 14, windowed vision attention, sectioned M-RoPE) or
    Qwen3-VL (patch 16, learned position embeddings, deepstack, interleaved M-RoPE)."""
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    text = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                rms_norm_eps=1e-6, initializer_range=initializer_range, pad_token_id=special_ids["pad_token_id"], bos_token_id=None,
                eos_token_id=special_ids["eos_token_id"])
    tokens = {key: special_ids[key] for key in
              ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    if arch == "qwen2_5_vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, window_size=56,
                      fullatt_block_indexes=[1], initializer_range=initializer_range)
        text.update(overrides.pop("text_config", {}))
        vision.update(overrides.pop("vision_config", {}))
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **tokens,
                                **overrides)
    if arch == "qwen3_vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                   "mrope_interleaved": True}
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64,
                      deepstack_visual_indexes=[0], initializer_range=initializer_range)
        text.update(overrides.pop("text_config", {}))
        vision.update(overrides.pop("vision_config", {}))
        return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **tokens,
                             **overrides)
    raise ValueError(f"unknown tiny vision-language architecture {arch!r}; choose one of {TINY_VL_ARCHES}")


def build_tiny_vl_model(
    out_dir: str | Path,
    arch: str = "qwen2_5_vl",
    corpus: list[str] | None = None,
    vocab_size: int = 512,
    seed: int = 0,
    initializer_range: float = 0.2,
    min_pixels: int = TINY_MIN_PIXELS,
    max_pixels: int = TINY_MAX_PIXELS,
    device: str = "cpu",
    dtype: str = "float32",
    **config_overrides,
) -> Path:
    """Write tokenizer, image processor and a random-init `arch` model (safetensors) to `out_dir`; return it.
    `config_overrides` may hold `text_config` / `vision_config` dicts (a full-size shape for a GPU test: built on
    `device` in `dtype`)."""
    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if arch not in TINY_VL_ARCHES:
        raise ValueError(f"unknown tiny vision-language architecture {arch!r}; choose one of {TINY_VL_ARCHES}")
    out_dir = Path(out_dir)
    tokenizer = build_vl_tokenizer(out_dir, corpus, vocab_size=vocab_size)
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(VL_SPECIAL_TOKENS)))
    ids.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = tiny_vl_config(arch, len(tokenizer), ids, initializer_range, **config_overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(out_dir, safe_serialization=True)
    del model

    patch_size = config.vision_config.patch_size
    image_mean = [0.48145466, 0.4578275, 0.40821073] if arch == "qwen2_5_vl" else [0.5, 0.5, 0.5]
    image_std = [0.26862954, 0.26130258, 0.27577711] if arch == "qwen2_5_vl" else [0.5, 0.5, 0.5]
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, patch_size=patch_size,
        temporal_patch_size=config.vision_config.temporal_patch_size,
        merge_size=config.vision_config.spatial_merge_size, image_mean=image_mean, image_std=image_std)
    image_processor.save_pretrained(out_dir)
    (out_dir / "chat_template.jinja").write_text(VL_CHAT_TEMPLATE)
    generation_config = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config))
    return out_dir
