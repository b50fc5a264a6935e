"""Per-micro-batch losses of both training backends: policy (PPO/GRPO family), value (critic), SFT and user-defined.

Each function returns this micro-batch's share of the GLOBAL-batch loss plus its metric shares, all reduced with
`ppo_utils.aggregate_loss` against a denominator fixed for the whole optimizer step, so the sum over any split into
micro-batches and ranks is the same number (and the same gradient). The math itself lives in `ppo_utils`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slime.utils.ppo_utils import (
    aggregate_loss,
    compute_approx_kl,
    compute_cispo_loss,
    compute_gspo_kl,
    compute_opsm_mask,
    compute_policy_loss,
    compute_tis_weights,
    compute_value_loss,
)


@dataclass
class MicroBatchTensors:
    """Flat per-response-token tensors of one packed micro-batch (samples concatenated in packed order)."""

    loss_masks: list[torch.Tensor]  # one per sample
    advantages: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None  # critic: values before this rollout's updates
    returns: torch.Tensor | None = None  # critic: value targets
    total_lengths: list[int] | None = None  # prompt + response tokens per sample (slime's custom TIS hook gets them)
    old_entropy: torch.Tensor | None = None  # --use-rollout-entropy: the old-policy pass's entropy (custom losses)
    ref_entropy: torch.Tensor | None = None  # --use-rollout-entropy: the reference pass's entropy


def aggregation_mode(args) -> str:
    """sample_mean (slime's default), token_mean (--calculate-per-token-loss) or constant (Dr.GRPO)."""
    return args.loss_agg_mode


class LossReducer:
    """aggregate_loss with the step's global denominator and this micro-batch's masks bound."""

    def __init__(self, args, loss_masks: list[torch.Tensor], global_denominator: float,
                 sample_token_counts: list[float] | None = None):
        self.mode = aggregation_mode(args)
        self.loss_masks = loss_masks
        self.global_denominator = global_denominator
        # Host-side per-sample mask sums spare one device sync per sample.
        self.sample_token_counts = sample_token_counts

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        return aggregate_loss(values, self.loss_masks, self.mode, self.global_denominator, self.sample_token_counts)


def policy_loss(args, log_probs, entropy, batch: MicroBatchTensors, reduce: LossReducer):
    """PPO-clip (GSPO, CISPO) surrogate + optional KL loss to the reference - entropy bonus, with optional OPSM
    and TIS."""
    old_log_probs = batch.old_log_probs if batch.old_log_probs is not None else log_probs.detach()
    ppo_kl = old_log_probs - log_probs
    metrics = {}
    if args.use_opsm:  # from the token-level drift, before GSPO turns it into a sequence mean
        lengths = _lengths(batch)
        opsm_mask, opsm_clipfrac = compute_opsm_mask(
            args, list(torch.split(log_probs.detach(), lengths)), list(torch.split(old_log_probs, lengths)),
            list(torch.split(batch.advantages, lengths)), batch.loss_masks)
        metrics["opsm_clipfrac"] = opsm_clipfrac.detach()
    if args.advantage_estimator == "gspo":
        ppo_kl = torch.cat(compute_gspo_kl(list(torch.split(ppo_kl, _lengths(batch))), batch.loss_masks))
    if args.advantage_estimator == "cispo":
        pg_losses, clipfrac = compute_cispo_loss(ppo_kl, log_probs, batch.advantages, args.eps_clip,
                                                 args.eps_clip_high)
    else:
        pg_losses, clipfrac = compute_policy_loss(ppo_kl, batch.advantages, args.eps_clip, args.eps_clip_high,
                                                  args.eps_clip_c)
    if args.use_opsm:
        pg_losses = pg_losses * opsm_mask
    if args.use_tis and args.custom_tis_function_path:
        pg_losses, reduce, tis_metrics = _custom_tis(args, pg_losses, old_log_probs, batch, reduce)
        metrics.update(tis_metrics)
    elif args.use_tis:
        # Per-sample pieces: mask_sequence needs each sequence's boundaries.
        lengths = _lengths(batch)
        weights, _ = compute_tis_weights(
            list(torch.split(old_log_probs, lengths)), list(torch.split(batch.rollout_log_probs, lengths)),
            batch.loss_masks, args.tis_clip_low, args.tis_clip, mode=args.tis_mode)
        weights = torch.cat(weights)
        raw = torch.exp(old_log_probs.detach() - batch.rollout_log_probs)
        pg_losses = pg_losses * weights
        metrics["tis_abs"] = reduce((raw - 1).abs())
        metrics["tis_clipfrac"] = reduce((weights != raw).float())
    pg_loss = _reduce_pg_loss(args, pg_losses, batch, reduce)
    loss = pg_loss
    if args.entropy_coef != 0:
        entropy_loss = reduce(entropy)
        loss = loss - args.entropy_coef * entropy_loss
    else:
        entropy_loss = reduce(entropy.detach())
    kl_loss = torch.zeros(())
    if args.use_kl_loss:
        importance_ratio = torch.exp(log_probs - old_log_probs) if args.use_unbiased_kl else None
        kl = compute_approx_kl(log_probs, batch.ref_log_probs, args.kl_loss_type, importance_ratio)
        kl_loss = reduce(kl)
        loss = loss + args.kl_loss_coef * kl_loss
    metrics.update(
        loss=loss.detach(), pg_loss=pg_loss.detach(), entropy_loss=entropy_loss.detach(),
        pg_clipfrac=reduce(clipfrac), ppo_kl=reduce(ppo_kl.detach()), kl_loss=kl_loss.detach(),
    )
    if batch.rollout_log_probs is not None:
        metrics["train_rollout_logprob_abs_diff"] = reduce((old_log_probs.detach() - batch.rollout_log_probs).abs())
        # --true-on-policy-mode's check: the share of tokens whose two log-probs are the same bits
        metrics["train_rollout_logprob_exact_fraction"] = reduce(
            (old_log_probs.detach() == batch.rollout_log_probs).float())
    return loss, metrics


def _custom_tis(args, pg_losses, old_log_probs, batch: MicroBatchTensors, reduce: LossReducer):
    """slime's --custom-tis-function-path: fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks,
    total_lengths, response_lengths) -> (pg_loss, loss_masks, metrics). The rest of the loss is reduced over the
    masks it returns (a rejected token leaves the denominators, as in slime); its metrics over the original ones."""
    from slime.utils.misc import load_function

    lengths = _lengths(batch)
    hook = load_function(args.custom_tis_function_path, "--custom-tis-function-path")
    pg_losses, loss_masks, hook_metrics = hook(
        args, pg_loss=pg_losses, train_log_probs=list(torch.split(old_log_probs, lengths)),
        rollout_log_probs=list(torch.split(batch.rollout_log_probs, lengths)), loss_masks=batch.loss_masks,
        total_lengths=batch.total_lengths, response_lengths=lengths)
    metrics = {key: reduce(value.detach()) for key, value in (hook_metrics or {}).items()}
    return pg_losses, LossReducer(args, list(loss_masks), reduce.global_denominator), metrics


def _reduce_pg_loss(args, pg_losses, batch: MicroBatchTensors, reduce: LossReducer) -> torch.Tensor:
    """The policy-gradient term reduced by `reduce`, or by slime's --custom-pg-loss-reducer-function-path:
    fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer, where reducer(per-token
    losses) is this micro-batch's sum in slime's space (per-sample means summed, or token sums with
    calculate_per_token_loss) and the step's global denominator (rollouts or tokens) then divides it, as slime's
    loss scaling does. The masks are those the rest of the loss uses (a custom TIS hook's). Every other term and
    metric keeps the default reduction."""
    if not args.custom_pg_loss_reducer_function_path:
        return reduce(pg_losses)
    from slime.utils.misc import load_function

    make_reducer = load_function(args.custom_pg_loss_reducer_function_path, "--custom-pg-loss-reducer-function-path")
    reducer = make_reducer(batch.total_lengths, _lengths(batch), reduce.loss_masks, args.calculate_per_token_loss)
    return reducer(pg_losses) / reduce.global_denominator


def value_loss(args, values, batch: MicroBatchTensors, reduce: LossReducer):
    """The critic's clipped value loss (spec 4.5), aggregated like the policy loss."""
    losses, clipfrac = compute_value_loss(values, batch.old_values, batch.returns, args.value_clip)
    loss = reduce(losses)
    return loss, {"value_loss": loss.detach(), "value_clipfrac": reduce(clipfrac),
                  "values": reduce(values.detach())}


def sft_loss(args, log_probs, entropy, batch: MicroBatchTensors, reduce: LossReducer):
    loss = reduce(-log_probs)
    return loss, {"loss": loss.detach(), "entropy_loss": reduce(entropy.detach())}


def _lengths(batch: MicroBatchTensors) -> list[int]:
    return [int(m.numel()) for m in batch.loss_masks]


def get_loss_function(args):
    """The loss for args.loss_type: fn(args, log_probs, entropy, batch, reduce) -> (loss, metrics)."""
    if args.loss_type == "policy_loss":
        return policy_loss
    if args.loss_type == "sft_loss":
        return sft_loss
    if args.loss_type == "custom_loss":
        from slime.utils.misc import load_function

        return load_function(args.custom_loss_function_path, "--custom-loss-function-path")
    raise ValueError(f"unknown --loss-type {args.loss_type!r}; choose policy_loss, sft_loss or custom_loss")


def can_reuse_log_probs_in_loss(args, num_steps_per_rollout: int) -> bool:
    """slime's shortcut (spec 4.8): with one on-policy step per rollout the old log-probs equal the current ones,
    so the separate forward is skipped and the loss uses the detached current log-probs."""
    return (num_steps_per_rollout == 1 and args.loss_type == "policy_loss" and args.kl_coef == 0
            and not args.use_rollout_logprobs and not args.get_mismatch_metrics and not args.keep_old_actor
            and not args.use_opd and args.advantage_estimator != "gspo"
            and not args.use_critic)
