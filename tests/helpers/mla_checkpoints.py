"""Tiny DeepSeek-V3-family checkpoints for tests, built with transformers (slime.utils.tiny_model): wide weights
(std 0.3) and norm weights, expert-score biases and projection biases away from their init values (1 and 0), so a
swapped norm, a dropped bias or a wrong rope layout changes the logits. `kimi_k2` is the deepseek_v3 checkpoint copied with Kimi's
model_type (transformers has none, so its reference model loads the deepseek_v3 copy)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from slime.utils.tiny_model import build_tiny_model

# A dense layer, then sparse ones (routed experts, shared expert, the variant's router groups).
LAYERS = dict(num_hidden_layers=3, first_k_dense_replace=1, num_dense_layers=1)


def perturb_norms_and_biases(path: Path, seed: int) -> None:
    from safetensors.torch import load_file, save_file

    generator = torch.Generator().manual_seed(seed + 1000)
    weights = load_file(str(path / "model.safetensors"))
    for name, tensor in weights.items():
        if name.endswith("norm.weight"):
            weights[name] = 1 + 0.3 * torch.randn(tensor.shape, generator=generator)
        elif name.endswith("e_score_correction_bias") or name.endswith("_proj.bias"):
            weights[name] = 0.5 * torch.randn(tensor.shape, generator=generator)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


def rewrite_config(path: Path, **fields) -> None:
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    config.update(fields)
    config_file.write_text(json.dumps(config))


def build_mla_checkpoint(out_dir: Path, variant: str, seed: int = 0, perturb_seed: int | None = None,
                         **overrides) -> tuple[Path, Path]:
    """(the engine's checkpoint, transformers' checkpoint of the same weights) of `variant`: deepseek_v3,
    moonlight, kimi_k2 or glm4_moe_lite. `perturb_seed` (default `seed`) draws the norms and expert biases."""
    out_dir = Path(out_dir)
    arch = "deepseek_v3" if variant == "kimi_k2" else variant
    path = build_tiny_model(out_dir / arch, arch=arch, seed=seed, **{"initializer_range": 0.3, **LAYERS, **overrides})
    perturb_norms_and_biases(path, seed if perturb_seed is None else perturb_seed)
    if variant != "kimi_k2":
        return path, path
    kimi = out_dir / "kimi_k2"
    shutil.copytree(path, kimi)
    rewrite_config(kimi, model_type="kimi_k2")
    return kimi, path
