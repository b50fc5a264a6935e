"""Train/rollout mismatch: truncated (or masked) importance weights between the trainer's old log-probs and the
rollout engine's, and the mismatch metrics logged every rollout. Pure torch, no I/O; re-exported by ppo_utils."""

from __future__ import annotations

import math

import torch

TIS_MODES = ("truncate", "mask_token", "mask_sequence")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _flatten(x) -> torch.Tensor:
    if isinstance(x, (list, tuple)):
        return torch.cat([t.reshape(-1) for t in x]) if x else torch.zeros(0)
    return x.reshape(-1)


def compute_tis_weights(
    old_log_probs,
    rollout_log_probs,
    loss_mask,
    clip_low: float,
    clip_high: float,
    mode: str = "truncate",
):
    """Importance weights w = exp(old_log_probs - rollout_log_probs) correcting train/rollout mismatch.

    Modes: "truncate" (vanilla TIS, `--use-tis`): w clamped to [clip_low, clip_high]; "mask_token" (icepop): w kept
    where clip_low <= w <= clip_high, else 0; "mask_sequence": a sequence whose masked-in tokens are not all inside
    [clip_low, clip_high] gets weight 0 on every token, the others keep w. Inputs are 1-D, `[batch, tokens]` (one
    sequence per row) or lists of 1-D tensors (then the weights are a list). Weights carry no gradient.
    Returns `(weights, metrics)`, metrics being 0-dim tensors over masked-in tokens: tis (mean raw w), tis_abs
    (mean |w - 1|), tis_clipfrac (fraction of tokens whose weight was changed), and for mask_sequence
    tis_seq_rejected_frac (fraction of sequences zeroed).
    """
    if mode not in TIS_MODES:
        raise ValueError(f"unknown TIS mode {mode!r}; valid: {', '.join(TIS_MODES)}")
    if clip_low > clip_high:
        raise ValueError(f"TIS clip_low {clip_low} (--tis-clip-low) must be <= clip_high {clip_high} (--tis-clip)")
    if isinstance(old_log_probs, (list, tuple)):
        pieces = [
            _tis_weights_tensor(o.detach(), r, m, clip_low, clip_high, mode)
            for o, r, m in zip(old_log_probs, rollout_log_probs, loss_mask, strict=True)
        ]
        weights = [p[0] for p in pieces]
        raw = _flatten([p[1] for p in pieces])
        rejected_seqs = torch.stack([p[2] for p in pieces]).reshape(-1) if pieces else torch.zeros(0)
        flat_weights = _flatten(weights)
    else:
        weights, raw, rejected_seqs = _tis_weights_tensor(
            old_log_probs.detach(), rollout_log_probs, loss_mask, clip_low, clip_high, mode
        )
        flat_weights = weights.reshape(-1)
        raw = raw.reshape(-1)
        rejected_seqs = rejected_seqs.reshape(-1)
    flat_mask = _flatten(loss_mask).to(raw.dtype)
    metrics = {
        "tis": _masked_mean(raw, flat_mask),
        "tis_abs": _masked_mean((raw - 1.0).abs(), flat_mask),
        "tis_clipfrac": _masked_mean((flat_weights != raw).to(raw.dtype), flat_mask),
    }
    if mode == "mask_sequence":
        rejected = rejected_seqs.to(raw.dtype)
        metrics["tis_seq_rejected_frac"] = rejected.mean() if rejected.numel() else raw.new_zeros(())
    return weights, metrics


def _tis_weights_tensor(old_log_probs, rollout_log_probs, loss_mask, clip_low, clip_high, mode):
    """Weights, raw ratios and per-sequence rejection flags for one tensor (sequence along the last dim)."""
    raw = torch.exp(old_log_probs - rollout_log_probs)
    inside = (raw >= clip_low) & (raw <= clip_high)
    if mode == "truncate":
        return raw.clamp(clip_low, clip_high), raw, torch.zeros_like(inside[..., 0])
    if mode == "mask_token":
        return torch.where(inside, raw, 0.0), raw, torch.zeros_like(inside[..., 0])
    outside_masked_in = (~inside) & loss_mask.bool()
    rejected = outside_masked_in.any(dim=-1)
    return torch.where(rejected.unsqueeze(-1), 0.0, raw), raw, rejected


def _quantile(sorted_values: torch.Tensor, q: float) -> torch.Tensor:
    """Linear-interpolated quantile of an ascending 1-D tensor (torch.quantile refuses > 16M elements)."""
    position = q * (sorted_values.numel() - 1)
    lower = math.floor(position)
    upper = min(lower + 1, sorted_values.numel() - 1)
    frac = position - lower
    return sorted_values[lower] + (sorted_values[upper] - sorted_values[lower]) * frac


def compute_mismatch_metrics(train_log_probs, rollout_log_probs, loss_mask, eps_clip: float, eps_clip_high: float):
    """Train/rollout log-prob mismatch as a distribution, over masked-in tokens (tensors or lists of 1-D tensors).

    Keys: train_rollout_logprob_abs_diff (mean |train - rollout|), mismatch_ratio_p1 / _p50 / _p99 (quantiles of
    ratio = exp(train - rollout)), mismatch_ratio_outside_clip_frac (fraction with ratio outside
    [1 - eps_clip, 1 + eps_clip_high]) and mismatch_num_tokens. With no masked-in tokens the quantiles are NaN and
    the means 0. Quantiles are of the tokens passed in (per rank; they do not all-reduce).
    """
    train = _flatten(train_log_probs).detach()
    rollout = _flatten(rollout_log_probs).to(train.dtype)
    keep = _flatten(loss_mask).bool()
    log_ratio = (train - rollout)[keep]
    ratio = torch.exp(log_ratio)
    num_tokens = log_ratio.numel()
    metrics = {"mismatch_num_tokens": train.new_tensor(float(num_tokens))}
    if num_tokens == 0:
        nan = train.new_tensor(float("nan"))
        metrics.update(
            train_rollout_logprob_abs_diff=train.new_tensor(0.0),
            mismatch_ratio_p1=nan, mismatch_ratio_p50=nan, mismatch_ratio_p99=nan,
            mismatch_ratio_outside_clip_frac=train.new_tensor(0.0),
        )
        return metrics
    sorted_ratio = ratio.sort().values
    outside = (ratio < 1.0 - eps_clip) | (ratio > 1.0 + eps_clip_high)
    metrics.update(
        train_rollout_logprob_abs_diff=log_ratio.abs().mean(),
        mismatch_ratio_p1=_quantile(sorted_ratio, 0.01),
        mismatch_ratio_p50=_quantile(sorted_ratio, 0.50),
        mismatch_ratio_p99=_quantile(sorted_ratio, 0.99),
        mismatch_ratio_outside_clip_frac=outside.to(train.dtype).mean(),
    )
    return metrics
