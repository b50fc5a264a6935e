"""Loss aggregation over the GLOBAL batch: the denominators are computed once per optimizer step over every
micro-batch and rank, so summing micro-batch contributions gives the same loss and gradient for any split.
Pure torch, no I/O; re-exported by ppo_utils."""

from __future__ import annotations

from collections.abc import Sequence

import torch

LOSS_AGGREGATION_MODES = ("sample_mean", "token_mean", "constant")


def _split_per_sample(values, loss_masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(values, (list, tuple)):
        if len(values) != len(loss_masks):
            raise ValueError(f"got {len(values)} per-sample value tensors but {len(loss_masks)} loss masks")
        return list(values)
    lengths = [int(m.numel()) for m in loss_masks]
    if values.dim() != 1 or values.numel() != sum(lengths):
        raise ValueError(
            f"packed values must be 1-D with sum(len(mask)) = {sum(lengths)} elements, got shape {tuple(values.shape)}"
        )
    return list(torch.split(values, lengths))


def loss_denominator(mode: str, loss_masks: Sequence[torch.Tensor], constant: float | None = None,
                     sample_shares: Sequence[float] | None = None) -> float:
    """This rank's share of `aggregate_loss`'s `global_denominator` for the samples in `loss_masks`.

    sample_mean: number of rollouts; token_mean: number of masked-in tokens; constant: number of rollouts x
    `constant` (Dr.GRPO, e.g. the max response length). A sample counts as `sample_shares[i]` of a rollout (1 / its
    number of fan-out siblings; 1 when not given), so a rollout split into several Samples weighs what one Sample
    weighs. All three add up over disjoint sets of samples, so the global denominator is the SUM over every
    micro-batch of the global batch on every rank (one all-reduce).
    """
    if mode not in LOSS_AGGREGATION_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid: {', '.join(LOSS_AGGREGATION_MODES)}")
    if sample_shares is not None and len(sample_shares) != len(loss_masks):
        raise ValueError(f"got {len(sample_shares)} sample_shares for {len(loss_masks)} samples")
    num_rollouts = float(sum(sample_shares)) if sample_shares is not None else float(len(loss_masks))
    if mode == "sample_mean":
        return num_rollouts
    if mode == "token_mean":
        return float(sum(m.sum() for m in loss_masks)) if loss_masks else 0.0
    if constant is None or not constant > 0:
        raise ValueError(f"loss aggregation mode 'constant' needs a positive constant, got {constant!r}")
    return num_rollouts * float(constant)


def aggregate_loss(
    values,
    loss_masks: Sequence[torch.Tensor],
    mode: str,
    global_denominator: float,
    sample_token_counts: Sequence[float] | None = None,
) -> torch.Tensor:
    """Reduce per-token values (loss terms) of some samples to this micro-batch's share of the global-batch loss.

    `values` is a list of 1-D per-sample tensors or one packed 1-D tensor (samples concatenated in the order of
    `loss_masks`, each as long as its mask).
      sample_mean (slime default): sum_i (sum_t x_it m_it / max(D_i, 1)) / global_denominator, with D_i = sum_t m_it
          (or `sample_token_counts[i]`, e.g. the token total of the rollout sample i belongs to) and
          global_denominator = number of samples in the global batch.
      token_mean (--calculate-per-token-loss): sum x m / global_denominator = all masked-in tokens of the global batch.
      constant (Dr.GRPO): sum x m / global_denominator = samples in the global batch x constant.

    Invariance: the result is a sum of per-sample terms over a denominator fixed for the whole global batch (get it
    with `loss_denominator` summed over all micro-batches and ranks). Summing this function's outputs over ANY
    partition of the global batch into micro-batches and ranks therefore gives exactly the full-batch loss, and the
    same gradient. Backward each micro-batch's value as is (no division by the number of micro-batches); if the
    data-parallel gradient reduction averages over ranks (DDP / FSDP default), multiply by the number of ranks.
    """
    if mode not in LOSS_AGGREGATION_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid: {', '.join(LOSS_AGGREGATION_MODES)}")
    if not global_denominator > 0:
        raise ValueError(
            f"global_denominator must be > 0 (computed once over the global batch), got {global_denominator}"
        )
    per_sample = _split_per_sample(values, loss_masks)
    if not per_sample:
        return torch.zeros(())
    if sample_token_counts is not None and len(sample_token_counts) != len(per_sample):
        raise ValueError(f"got {len(sample_token_counts)} sample_token_counts for {len(per_sample)} samples")
    # Stays on the device: no per-sample .item() synchronisation.
    masked_sums = torch.stack([(x * mask.to(x)).sum() for x, mask in zip(per_sample, loss_masks)])
    if mode == "sample_mean":
        if sample_token_counts is None:
            counts = torch.stack([mask.to(masked_sums).sum() for mask in loss_masks])
        else:
            counts = torch.as_tensor(sample_token_counts).to(masked_sums)
        masked_sums = masked_sums / counts.clamp(min=1.0)
    return masked_sums.sum() / global_denominator
