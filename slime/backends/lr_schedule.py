"""The learning-rate schedule (warm-up, then constant, linear or cosine decay) both training backends follow."""

from __future__ import annotations

import math

import torch

LR_DECAY_STYLES = ("constant", "linear", "cosine")


def learning_rate(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int | None,
                  decay_style: str) -> float:
    """LR of optimizer step `step` (0-based)."""
    if decay_style not in LR_DECAY_STYLES:
        raise ValueError(f"unknown --lr-decay-style {decay_style!r}; choose {', '.join(LR_DECAY_STYLES)}")
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay_style == "constant" or not total_steps or total_steps <= warmup_steps:
        return lr
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    if decay_style == "linear":
        return min_lr + (lr - min_lr) * (1.0 - progress)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def total_optimizer_steps(args) -> int | None:
    if args.num_rollout is None or args.num_steps_per_rollout is None:
        return None
    return args.num_rollout * args.num_steps_per_rollout


def trainable_parameters(params) -> list[torch.nn.Parameter]:
    params = [param for param in params if param.requires_grad]
    if not params:
        raise ValueError("no trainable parameter: --only-train-params-name-list / --freeze-params-name-list "
                         "froze every parameter of the model")
    return params
