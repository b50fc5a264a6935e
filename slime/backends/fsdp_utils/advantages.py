"""Per-token advantages of a rank's rollout data (slime's `compute_advantages_and_returns` for the estimators the
FSDP trainer runs without a critic). Rewards arrive already post-processed by the RolloutManager (group-normalised
for GRPO-family estimators); the math is in `ppo_utils`, global whitening statistics are all-reduced here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slime.utils.ppo_utils import (
    compute_approx_kl,
    compute_discounted_returns,
    masked_moments,
    masked_whiten_from_sums,
    reinforce_plus_plus_token_rewards,
)

BROADCAST_ESTIMATORS = ("grpo", "gspo", "rloo")
SUPPORTED_ESTIMATORS = BROADCAST_ESTIMATORS + ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


def check_estimator(args) -> None:
    if args.advantage_estimator not in SUPPORTED_ESTIMATORS and not args.custom_advantage_function_path:
        raise ValueError(f"--advantage-estimator {args.advantage_estimator} needs a critic, which the FSDP trainer "
                         f"does not have; choose one of {', '.join(SUPPORTED_ESTIMATORS)}")


def compute_advantages(args, rewards: list[float], loss_masks: list[torch.Tensor],
                       old_log_probs: list[torch.Tensor] | None, ref_log_probs: list[torch.Tensor] | None,
                       rollout_data: dict) -> list[torch.Tensor]:
    """One fp32 tensor per sample (length = response length)."""
    estimator = args.advantage_estimator
    uses_reward_kl = estimator.startswith("reinforce_plus_plus") and args.kl_coef != 0
    if uses_reward_kl and (old_log_probs is None or ref_log_probs is None):
        raise ValueError(f"--kl-coef with {estimator} needs a reference model (--ref-load)")
    kls = [compute_approx_kl(o, r, args.kl_loss_type) for o, r in zip(old_log_probs, ref_log_probs)] \
        if uses_reward_kl else [torch.zeros(len(m)) for m in loss_masks]
    if args.custom_advantage_function_path:
        from slime.utils.misc import load_function

        fn = load_function(args.custom_advantage_function_path, "--custom-advantage-function-path")
        rollout_data.update(kl=kls, log_probs=old_log_probs, ref_log_probs=ref_log_probs)
        fn(args, rollout_data)
        advantages = [torch.as_tensor(a, dtype=torch.float32) for a in rollout_data["advantages"]]
    elif estimator in BROADCAST_ESTIMATORS:
        advantages = [torch.full((len(m),), float(r)) for r, m in zip(rewards, loss_masks)]
    elif estimator == "reinforce_plus_plus_baseline":
        advantages = [float(r) - args.kl_coef * kl for r, kl in zip(rewards, kls)]
    else:
        advantages = [
            compute_discounted_returns(reinforce_plus_plus_token_rewards(float(r), kl, m, args.kl_coef), args.gamma)
            for r, kl, m in zip(rewards, kls, loss_masks)
        ]
    if args.normalize_advantages:
        advantages = whiten_globally(advantages, loss_masks)
    return advantages


def whiten_globally(values: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Masked whitening with mean/variance over every rank's tokens."""
    flat, flat_mask = torch.cat(values), torch.cat(masks)
    moments = torch.stack([m.double() for m in masked_moments(flat.double(), flat_mask)])
    if dist.is_initialized():
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        moments = moments.to(device)
        dist.all_reduce(moments)
        moments = moments.cpu()
    whitened = masked_whiten_from_sums(flat.double(), *moments).float()
    return list(torch.split(whitened, [len(v) for v in values]))
