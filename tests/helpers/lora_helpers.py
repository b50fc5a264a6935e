"""Shared helpers for the LoRA tests: a tiny checkpoint initialised wide enough that logits spread, adapters set to
non-zero values (a fresh adapter's B is zero, which would hide a wrong computation), and the hand-written
reference: the transformers model with W + s * B @ A substituted for each adapted weight, per sample (unpacked)."""

from __future__ import annotations

from pathlib import Path

import torch

from slime.utils.tiny_model import build_tiny_model

LORA_FLAGS = ("--lora-rank", "4", "--lora-alpha", "8", "--target-modules", "all-linear")
SCALE = 8 / 4


def wide_tiny_checkpoint(folder: Path, arch: str = "qwen3", seed: int = 2) -> Path:
    """A tiny model whose weights have std 0.15 (norms stay at 1): logits spread over several nats."""
    from transformers import AutoModelForCausalLM

    build_tiny_model(folder, arch=arch, seed=seed)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def random_adapter(names_and_shapes: dict[str, tuple], seed: int, std: float = 0.1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) * std for name, shape in sorted(names_and_shapes.items())}


def reference_log_probs(checkpoint, adapter: dict[str, torch.Tensor], scale: float, tokens: list[list[int]],
                        response_lengths: list[int], dtype=torch.float64):
    """Per-sample response log-probs of the transformers model with each adapted weight W + s * B @ A, where A and
    B are the leaves returned (requires_grad) so that a loss of the log-probs gives the reference gradients."""
    from torch.func import functional_call
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, attn_implementation="eager")
    leaves = {name: tensor.detach().to(dtype).requires_grad_(True) for name, tensor in adapter.items()}
    state = dict(model.named_parameters())
    merged = {}
    for name in leaves:
        if ".lora_A." in name:
            layer = name.split(".lora_A.")[0]
            merged[layer + ".weight"] = (state[layer + ".weight"]
                                         + scale * leaves[layer + ".lora_B.weight"] @ leaves[name])
    out = []
    for sample, response_length in zip(tokens, response_lengths):
        ids = torch.tensor([sample])
        logits = functional_call(model, merged, (ids,), {"use_cache": False}, strict=False).logits[0]
        log_probs = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None])[:, 0]
        out.append(log_probs[-response_length:])
    return out, leaves


def sample_mean_sft_loss(log_probs: list[torch.Tensor], loss_masks: list[list[int]]) -> torch.Tensor:
    """slime's default SFT loss: the mean over samples of each sample's masked token mean of -log p."""
    per_sample = []
    for lp, mask in zip(log_probs, loss_masks):
        mask = torch.tensor(mask, dtype=lp.dtype)
        per_sample.append(-(lp * mask).sum() / mask.sum().clamp(min=1))
    return torch.stack(per_sample).mean()
