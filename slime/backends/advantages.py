"""Per-token advantages and returns of a rank's rollout data (slime's `compute_advantages_and_returns`). Rewards
arrive already post-processed by the RolloutManager (group-normalised for GRPO-family estimators); ppo gets the
critic's values of the same samples. The math is in `ppo_utils`; global whitening statistics are all-reduced here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slime.utils.ppo_utils import (
    compute_approx_kl,
    compute_discounted_returns,
    compute_gae,
    masked_moments,
    masked_whiten_from_sums,
    reinforce_plus_plus_token_rewards,
)

BROADCAST_ESTIMATORS = ("grpo", "gspo", "cispo", "rloo")
REWARD_KL_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")


def compute_advantages(args, rewards: list[float], loss_masks: list[torch.Tensor],
                       old_log_probs: list[torch.Tensor] | None, ref_log_probs: list[torch.Tensor] | None,
                       rollout_data: dict, values: list[torch.Tensor] | None = None):
    """`(advantages, returns)`: one fp32 tensor per sample (length = response length) each. Returns differ from
    the advantages only for ppo (GAE: returns = advantages + values, the critic's targets)."""
    estimator = args.advantage_estimator
    uses_reward_kl = estimator in REWARD_KL_ESTIMATORS and args.kl_coef != 0
    if uses_reward_kl and (old_log_probs is None or ref_log_probs is None):
        raise ValueError(f"--kl-coef with {estimator} needs a reference model (--ref-load)")
    kls = [compute_approx_kl(o, r, args.kl_loss_type) for o, r in zip(old_log_probs, ref_log_probs)] \
        if uses_reward_kl else [torch.zeros(len(m)) for m in loss_masks]
    if args.custom_advantage_function_path:
        from slime.utils.misc import load_function

        fn = load_function(args.custom_advantage_function_path, "--custom-advantage-function-path")
        rollout_data.update(kl=kls, log_probs=old_log_probs, ref_log_probs=ref_log_probs, values=values)
        fn(args, rollout_data)
        advantages = [torch.as_tensor(a, dtype=torch.float32) for a in rollout_data["advantages"]]
        returns = [torch.as_tensor(r, dtype=torch.float32) for r in rollout_data.get("returns", advantages)]
        return _maybe_whiten(args, advantages, loss_masks), returns
    if estimator == "ppo":
        if values is None:
            raise ValueError("--advantage-estimator ppo: no critic values reached the actor")
        advantages, returns = [], []
        for r, kl, v in zip(rewards, kls, values):
            token_rewards = -args.kl_coef * kl
            token_rewards[-1] += float(r)
            a, g = compute_gae(token_rewards, v.float(), args.gamma, args.lambd)
            advantages.append(a)
            returns.append(g)
        return _maybe_whiten(args, advantages, loss_masks), returns
    if estimator in BROADCAST_ESTIMATORS:
        advantages = [torch.full((len(m),), float(r)) for r, m in zip(rewards, loss_masks)]
    elif estimator == "reinforce_plus_plus_baseline":
        advantages = [float(r) - args.kl_coef * kl for r, kl in zip(rewards, kls)]
    else:
        advantages = [
            compute_discounted_returns(reinforce_plus_plus_token_rewards(float(r), kl, m, args.kl_coef), args.gamma)
            for r, kl, m in zip(rewards, kls, loss_masks)
        ]
    return _maybe_whiten(args, advantages, loss_masks), advantages


def _maybe_whiten(args, advantages, loss_masks):
    return whiten_globally(advantages, loss_masks) if args.normalize_advantages else advantages


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
