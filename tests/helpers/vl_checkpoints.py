"""Inputs for the vision-language tests: random RGB images of odd sizes (seeded) and a per-session cache of the tiny
Qwen2.5-VL / Qwen3-VL checkpoints (slime.utils.tiny_vl_model). Not the policy or the engine under test."""

from __future__ import annotations

from pathlib import Path

import numpy as np

_BUILT: dict[str, Path] = {}


def random_image(height: int, width: int, seed: int = 0):
    """A noise RGB image: every patch differs, so a wrong patch order or a dropped row changes the features."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def tiny_vl_checkpoint(arch: str, root: Path) -> Path:
    """Build (once per session and arch) a tiny VL checkpoint under `root` and return its folder."""
    from slime.utils.tiny_vl_model import build_tiny_vl_model

    if arch not in _BUILT or not _BUILT[arch].is_dir():
        _BUILT[arch] = build_tiny_vl_model(root / arch, arch)
    return _BUILT[arch]


def hf_log_probs(model, processor, token_ids, images, output_ids):
    """transformers' log-probs [len(output_ids)] of output_ids after a prompt with images (expanded by the image
    policy, mm_token_type_ids passed so its M-RoPE positions are the 3-D ones)."""
    import torch

    encoded = processor.expand_input_ids(list(token_ids), images)
    ids = encoded.input_ids + list(output_ids)
    types = encoded.mm_token_type_ids + [0] * len(output_ids)
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=device),
                       mm_token_type_ids=torch.tensor([types], device=device),
                       pixel_values=None if encoded.pixel_values is None else encoded.pixel_values.to(device),
                       image_grid_thw=None if encoded.image_grid_thw is None else encoded.image_grid_thw.to(device),
                       ).logits[0]
    log_probs = logits.float().log_softmax(-1).cpu()
    start = len(encoded.input_ids)
    return torch.stack([log_probs[start - 1 + i, token] for i, token in enumerate(output_ids)])
