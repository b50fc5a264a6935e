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
