"""The train flow's metrics that span the data-parallel ranks: a masked mean of per-token values, the train /
rollout log-prob mismatch, and R3's router agreement. Each rank passes its own samples; the backend's `all_reduce`
sums over the data-parallel group, so every rank returns the same numbers.

Not here: the per-token math (ppo_utils.py's compute_mismatch_metrics, routing_replay.py's agreement_metrics).
"""

from __future__ import annotations

import torch

from slime.backends.backend import TrainBackend
from slime.backends.routing_replay import agreement_metrics
from slime.utils.ppo_utils import compute_mismatch_metrics


def global_masked_mean(backend: TrainBackend, values: list[torch.Tensor], masks: list[torch.Tensor],
                       device: torch.device) -> float:
    """sum(value * mask) / sum(mask) over every rank's tokens (0 when no token counts)."""
    sums = torch.tensor([float(sum((v * m).sum() for v, m in zip(values, masks))),
                         float(sum(m.sum() for m in masks))], dtype=torch.float64, device=device)
    total, count = backend.all_reduce(sums).tolist()
    return total / max(count, 1.0)


def mismatch_metrics(backend: TrainBackend, args, old_log_probs, rollout_log_probs, loss_masks,
                     device: torch.device) -> dict:
    """Rank-local distribution of exp(train - rollout); quantiles averaged over ranks (approximate)."""
    local = compute_mismatch_metrics(old_log_probs, rollout_log_probs, loss_masks, args.eps_clip, args.eps_clip_high)
    local.pop("train_rollout_logprob_abs_diff")
    keys = sorted(local)
    values = torch.stack([local[k].float().nan_to_num(0.0) for k in keys]).to(device)
    values = backend.all_reduce(values) / backend.dp_size
    return {f"train/{k}": float(v) for k, v in zip(keys, values.tolist())}


def router_agreement_metrics(backend: TrainBackend, args, device: torch.device) -> dict:
    """R3: how often the trainer's free routing matched the engine's in the old-policy pass, over all ranks."""
    replay = backend.routing_replay
    if replay is None or not args.use_rollout_routing_replay:
        return {}
    return agreement_metrics(backend.all_reduce(replay.take_agreement().to(device)).cpu())
