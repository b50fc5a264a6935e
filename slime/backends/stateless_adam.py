"""slime's --use-stateless-adam: AdamW whose moments start from zero at every step, kept nowhere.

With zero moments and bias correction, one Adam step is `p -= lr * g / (|g| + eps)` (a per-element normalised
gradient) after the decoupled weight decay `p *= 1 - lr * weight_decay`: exactly what AdamW gives for a fresh
optimizer's first step, so a run that resets AdamW before every step trains the same weights with no optimizer
memory. There is no state to checkpoint (slime requires --no-save-optim).

Not the learning-rate schedule (fsdp_utils/optimizer.py sets each group's lr as for AdamW).
"""

from __future__ import annotations

import torch


class StatelessAdam(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        if lr < 0.0 or eps < 0.0:
            raise ValueError(f"StatelessAdam: lr ({lr}) and eps ({eps}) must be >= 0")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if group["weight_decay"] != 0:
                    param.mul_(1.0 - group["lr"] * group["weight_decay"])
                param.addcdiv_(param.grad, param.grad.abs().add_(group["eps"]), value=-group["lr"])
        return loss
