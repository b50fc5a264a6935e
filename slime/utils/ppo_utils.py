"""Pure RL math: KL estimators, policy/value losses, advantage estimators, reward normalisation, loss reducers.

Every function here is a stateless torch function with no I/O and no distributed calls, so it tests on a CPU.
Conventions: a 1-D tensor holds the per-token values of one response; `loss_mask` is 1 for tokens the policy is
trained on and 0 otherwise. Functions that need sequence boundaries (GSPO, sequence-level TIS, loss aggregation)
take either one 1-D tensor, a padded `[batch, tokens]` tensor, or a list of 1-D tensors (one per response).

What this module is not: it does not decide which estimator runs, gather tensors across ranks or log metrics. Where
a quantity needs global statistics (advantage whitening, loss denominators) the caller passes the already reduced
numbers in, see `masked_whiten_from_sums` and `aggregate_loss`.
"""

from __future__ import annotations

import torch

# Re-exported: custom loss code imports everything from ppo_utils.
from slime.utils.loss_aggregation import LOSS_AGGREGATION_MODES, aggregate_loss, loss_denominator
from slime.utils.off_policy import TIS_MODES, compute_mismatch_metrics, compute_tis_weights

__all__ = [
    "KL_TYPES", "LOSS_AGGREGATION_MODES", "TIS_MODES", "aggregate_loss", "apply_opd_advantage", "compute_approx_kl",
    "compute_discounted_returns", "compute_gae", "compute_gspo_kl", "compute_mismatch_metrics",
    "compute_policy_loss", "compute_rloo_advantages", "compute_tis_weights", "compute_value_loss",
    "loss_denominator", "masked_moments", "masked_whiten", "masked_whiten_from_sums", "normalize_group_rewards",
    "reinforce_plus_plus_token_rewards",
]

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")

# Reverse scans (GAE, discounted returns) run over chunks of this many tokens: one small matrix product per chunk
# instead of one Python step per token.
_SCAN_CHUNK_SIZE = 128


# --------------------------------------------------------------------------------------------- KL and policy loss


def compute_approx_kl(
    log_probs: torch.Tensor,
    log_probs_base: torch.Tensor,
    kl_loss_type: str,
    importance_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate with d = log_probs - log_probs_base (slime's signature).

    k1 = d; k2 = d^2 / 2; k3 = low_var_kl = exp(-d) - 1 + d. With `importance_ratio` (= exp(log_probs -
    old_log_probs), `--use-unbiased-kl`) the estimate is multiplied by it; low_var_kl is then clamped to [-10, 10]
    (slime's order: the clamp bounds the product the loss sees, not the factor before it).
    """
    if kl_loss_type not in KL_TYPES:
        raise ValueError(f"unknown kl_type {kl_loss_type!r} (--kl-loss-type); valid: {', '.join(KL_TYPES)}")
    log_ratio = log_probs - log_probs_base
    if kl_loss_type == "k1":
        kl = log_ratio
    elif kl_loss_type == "k2":
        kl = log_ratio.square() / 2.0
    else:
        kl = torch.exp(-log_ratio) - 1.0 + log_ratio
    if importance_ratio is not None:
        kl = kl * importance_ratio
    if kl_loss_type == "low_var_kl":
        kl = kl.clamp(min=-10.0, max=10.0)
    return kl


def compute_opsm_mask(args, full_log_probs: list[torch.Tensor], full_old_log_probs: list[torch.Tensor],
                      advantages: list[torch.Tensor], loss_masks: list[torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Off-policy sequence masking (OPSM, slime's `--use-opsm`): a token is masked (0) when its advantage is
    negative and its sequence drifted from the old policy by more than `args.opsm_delta` (the masked token mean of
    old - new log-probs). Returns (the concatenated per-token mask, the sum over sequences of the masked share)."""
    masks, clipfrac = [], torch.zeros((), device=advantages[0].device)
    for log_probs, old_log_probs, advantage, loss_mask in zip(full_log_probs, full_old_log_probs, advantages,
                                                              loss_masks, strict=True):
        seq_kl = ((old_log_probs - log_probs) * loss_mask).sum() / loss_mask.sum().clamp(min=1)
        masked = ((advantage < 0) & (seq_kl > args.opsm_delta)).float()
        clipfrac = clipfrac + masked.sum() / loss_mask.sum().clamp(min=1)
        masks.append(1.0 - masked)
    return torch.cat(masks), clipfrac


def compute_cispo_loss(ppo_kl: torch.Tensor, log_probs: torch.Tensor, advantages: torch.Tensor, eps_clip: float,
                       eps_clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): -sg(clip(ratio, 1 - eps_clip, 1 + eps_clip_high)) * A * log_probs,
    ratio = exp(-ppo_kl). The clipped ratio is a constant, so every token (clipped or not) passes gradient through
    its log-prob. Returns (pg_losses, clipfrac = float(ratio was clipped))."""
    ratio = torch.exp(-ppo_kl)
    clipped = ratio.clamp(min=1.0 - eps_clip, max=1.0 + eps_clip_high)
    return -clipped.detach() * advantages * log_probs, (clipped != ratio).to(log_probs.dtype)


def compute_policy_loss(
    ppo_kl: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate, elementwise. Returns `(pg_losses, clipfrac)`.

    ppo_kl = old_log_probs - log_probs, ratio = exp(-ppo_kl); L1 = -A * ratio; L2 = -A * clip(ratio, 1 - eps_clip,
    1 + eps_clip_high) (eps_clip_high None means eps_clip); L = max(L1, L2); clipfrac = float(L2 > L1).
    Dual clip (`eps_clip_c` = c > 1): where A < 0, L = min(L, -c * A).
    """
    if eps_clip_c is not None and not eps_clip_c > 1.0:
        raise ValueError(f"--eps-clip-c must be > 1 for dual-clip PPO, got {eps_clip_c}")
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    ratio = torch.exp(-ppo_kl)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    pg_losses = torch.maximum(loss_unclipped, loss_clipped)
    clipfrac = (loss_clipped > loss_unclipped).to(pg_losses.dtype)
    if eps_clip_c is not None:
        dual_clipped = torch.minimum(pg_losses, -eps_clip_c * advantages)
        pg_losses = torch.where(advantages < 0, dual_clipped, pg_losses)
    return pg_losses, clipfrac


def compute_gspo_kl(ppo_kl, loss_mask):
    """GSPO sequence-level ppo_kl: each sequence's masked token mean of `ppo_kl`, broadcast to all its tokens.

    mean_i = sum_t ppo_kl_it * m_it / max(sum_t m_it, 1). Accepts a 1-D tensor (one sequence), a `[batch, tokens]`
    tensor (one sequence per row), or a list of 1-D tensors (returns a list). exp(-result) is the geometric-mean
    sequence ratio; gradients flow to every token through the mean.
    """
    if isinstance(ppo_kl, (list, tuple)):
        return [compute_gspo_kl(kl, mask) for kl, mask in zip(ppo_kl, loss_mask, strict=True)]
    mask = loss_mask.to(ppo_kl.dtype)
    seq_mean = (ppo_kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return seq_mean.expand_as(ppo_kl)


def compute_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    value_clip: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped critic loss, elementwise (slime: no 0.5 factor). Returns `(loss, clipfrac)`.

    V_clip = clamp(V, V_old - value_clip, V_old + value_clip) (slime's V_old + clamp(V - V_old, ±value_clip));
    loss = max((V_clip - R)^2, (V - R)^2); clipfrac = float((V_clip - R)^2 > (V - R)^2), i.e. where the clipped
    term is the one taken. Clamping V itself keeps V_clip == V bit for bit inside the range: V_old + (V - V_old)
    is V only up to rounding, which counted unclipped tokens as clipped on some CPUs and not on others.
    """
    values_clipped = torch.maximum(torch.minimum(values, old_values + value_clip), old_values - value_clip)
    loss_clipped = (values_clipped - returns).square()
    loss_unclipped = (values - returns).square()
    return torch.maximum(loss_clipped, loss_unclipped), (loss_clipped > loss_unclipped).to(values.dtype)


# ------------------------------------------------------------------------------------------- advantages / returns


def _reverse_discounted_cumsum(x: torch.Tensor, discount: float) -> torch.Tensor:
    """y_t = sum_{k >= t} discount^(k - t) x_k along the last dim (chunked: one matmul per chunk)."""
    length = x.shape[-1]
    if length == 0:
        return x.clone()
    chunk = min(_SCAN_CHUNK_SIZE, length)
    offsets = torch.arange(chunk, device=x.device)
    lag = offsets.view(1, -1) - offsets.view(-1, 1)  # lag[t, k] = k - t
    # Built in float64 so that discount^lag for lags up to the chunk size keeps full precision.
    powers = torch.where(lag >= 0, torch.tensor(discount, dtype=torch.float64) ** lag.clamp(min=0), 0.0).to(x.dtype)
    tail_powers = (torch.tensor(discount, dtype=torch.float64) ** (chunk - offsets)).to(x.dtype)  # discount^(e+1-t)
    chunks_reversed = []
    carry = torch.zeros_like(x[..., :1])  # y at the first token after the current chunk
    for end in range(length, 0, -chunk):
        start = max(0, end - chunk)
        size = end - start
        block = x[..., start:end]
        local = block @ powers[:size, :size].transpose(0, 1) if block.dim() > 1 else powers[:size, :size] @ block
        chunk_out = local + carry * tail_powers[chunk - size :]
        chunks_reversed.append(chunk_out)
        carry = chunk_out[..., :1]
    return torch.cat(chunks_reversed[::-1], dim=-1)


def compute_discounted_returns(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{k >= t} gamma^(k - t) r_k along the last dim (REINFORCE / REINFORCE++ returns)."""
    return _reverse_discounted_cumsum(rewards, gamma)


def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, gamma: float, lambd: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation for one sequence (or a batch along the leading dims).

    delta_t = r_t + gamma * V_{t+1} - V_t with V beyond the end = 0; A_t = sum_k (gamma * lambd)^k delta_{t+k};
    returns = A + V. Loss masks are not looked at (as in slime). Returns `(advantages, returns)`.
    """
    if rewards.shape != values.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and values {tuple(values.shape)} must have the same shape")
    next_values = torch.cat([values[..., 1:], torch.zeros_like(values[..., :1])], dim=-1)
    deltas = rewards + gamma * next_values - values
    advantages = _reverse_discounted_cumsum(deltas, gamma * lambd)
    return advantages, advantages + values


def reinforce_plus_plus_token_rewards(
    reward: float | torch.Tensor, kl: torch.Tensor, loss_mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """REINFORCE++ per-token rewards of one response: r_t = -kl_coef * kl_t * m_t, plus the scalar `reward` at the
    last token with m_t = 1 (the last token if none is masked in). Feed the result to `compute_discounted_returns`.
    """
    token_rewards = -kl_coef * kl * loss_mask.to(kl.dtype)
    if token_rewards.numel() == 0:
        return token_rewards
    masked_in = loss_mask.nonzero()
    last = int(masked_in[-1]) if masked_in.numel() else token_rewards.shape[-1] - 1
    bonus = torch.zeros_like(token_rewards)
    bonus[last] = reward
    return token_rewards + bonus


# slime's names for the chunked scans (its ppo_utils API).
chunked_discounted_returns = compute_discounted_returns
chunked_gae = compute_gae


def vanilla_gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lambd: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """slime's step-by-step GAE over `[batch, tokens]` (the recurrence A_t = delta_t + gamma * lambd * A_{t+1});
    the reference `chunked_gae` / `compute_gae` must equal."""
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[..., 0])
    next_value = torch.zeros_like(values[..., 0])
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[..., t] + gamma * next_value - values[..., t]
        running = delta + gamma * lambd * running
        advantages[..., t] = running
        next_value = values[..., t]
    return advantages, advantages + values


def get_reinforce_plus_plus_returns(rewards: torch.Tensor, kl: list[torch.Tensor], loss_masks: list[torch.Tensor],
                                    response_lengths: list[int], total_lengths: list[int], kl_coef: float,
                                    gamma: float) -> list[torch.Tensor]:
    """slime's REINFORCE++ returns per sample: discounted sums of `reinforce_plus_plus_token_rewards`. The lengths
    are slime's context-parallel bookkeeping; without context parallelism each sample is whole."""
    if not len(kl) == len(loss_masks) == len(response_lengths) == len(total_lengths) == len(rewards):
        raise ValueError("get_reinforce_plus_plus_returns: one reward, kl, loss mask and length per sample")
    return [compute_discounted_returns(reinforce_plus_plus_token_rewards(reward, sample_kl, mask, kl_coef), gamma)
            for reward, sample_kl, mask in zip(rewards, kl, loss_masks)]


def apply_opd_advantage(
    advantages: torch.Tensor, old_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, coef: float
) -> torch.Tensor:
    """On-policy distillation: A - coef * (old_log_probs - teacher_log_probs) (a one-sample reverse-KL penalty)."""
    return advantages - coef * (old_log_probs - teacher_log_probs)


# ------------------------------------------------------------------------------------------------ group rewards


def _group_index(rewards: torch.Tensor, group_ids) -> tuple[torch.Tensor, int]:
    """Dense group index per sample from arbitrary group ids (a tensor, or a sequence of any hashable ids)."""
    if isinstance(group_ids, torch.Tensor):
        ids = group_ids.to(rewards.device)
    else:
        dense: dict = {}
        dense_ids = [dense.setdefault(g, len(dense)) for g in group_ids]
        ids = torch.tensor(dense_ids, dtype=torch.long, device=rewards.device)
    if ids.shape != rewards.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards and group_ids must be 1-D of the same length, got {tuple(rewards.shape)} and {tuple(ids.shape)}"
        )
    _, inverse = torch.unique(ids, return_inverse=True)
    return inverse, int(inverse.max()) + 1 if inverse.numel() else 0


def _group_sums(x: torch.Tensor, inverse: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, inverse, x)


def group_mean_std(rewards: torch.Tensor, group_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element, the mean and the unbiased (n - 1) standard deviation of its group (0 for a group of one)."""
    inverse, num_groups = _group_index(rewards, group_ids)
    counts = _group_sums(torch.ones_like(rewards), inverse, num_groups)
    means = _group_sums(rewards, inverse, num_groups) / counts
    sum_sq = _group_sums((rewards - means[inverse]).square(), inverse, num_groups)
    stds = torch.where(counts > 1, sum_sq / (counts - 1).clamp(min=1), 0.0).sqrt()
    return means[inverse], stds[inverse]


def normalize_group_rewards(
    rewards: torch.Tensor, group_ids, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO reward normalisation by explicit group id (never by position; groups may be interleaved and unequal).

    r_i <- r_i - mean_g; with `std_normalize`, r_i <- (r_i - mean_g) / (std_g + eps) where std_g is the unbiased
    (n - 1) standard deviation of group g, taken as 0 for a group of one sample (whose centred value is 0).
    """
    rewards = torch.as_tensor(rewards)
    if not rewards.is_floating_point():
        rewards = rewards.float()
    means, stds = group_mean_std(rewards, group_ids)
    centred = rewards - means
    return centred / (stds + eps) if std_normalize else centred


def compute_rloo_advantages(rewards: torch.Tensor, group_ids) -> torch.Tensor:
    """RLOO: A_i = r_i - mean_{j != i, j in group(i)} r_j. A group of one sample has no baseline and gets 0."""
    rewards = torch.as_tensor(rewards)
    if not rewards.is_floating_point():
        rewards = rewards.float()
    inverse, num_groups = _group_index(rewards, group_ids)
    counts = _group_sums(torch.ones_like(rewards), inverse, num_groups)[inverse]
    sums = _group_sums(rewards, inverse, num_groups)[inverse]
    others_mean = (sums - rewards) / (counts - 1).clamp(min=1)
    return torch.where(counts > 1, rewards - others_mean, torch.zeros_like(rewards))


# ---------------------------------------------------------------------------------------------------- whitening


def masked_moments(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Local `(sum, sum_of_squares, count)` of the masked-in values; all-reduce (SUM) them across ranks and pass the
    results to `masked_whiten_from_sums` for whitening with global statistics."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(), (values.square() * mask).sum(), mask.sum()


def masked_whiten_from_sums(
    values: torch.Tensor,
    global_sum,
    global_sum_sq,
    global_count,
    eps: float = 1e-8,
    shift_mean: bool = True,
) -> torch.Tensor:
    """Whiten with pre-reduced global statistics (slime's `--normalize-advantages` over the DP x CP group).

    mean = S / n; var = (Q / n - mean^2) * n / (n - 1) (Bessel correction, skipped when n <= 1);
    out = (values - mean) / sqrt(var + eps), plus mean again when not `shift_mean`. Every position is transformed,
    masked-out ones included (the loss ignores them). With n = 0 there is nothing to normalise: values are returned
    unchanged.
    """
    count = float(global_count)
    if count <= 0:
        return values.clone()
    mean = torch.as_tensor(global_sum, dtype=values.dtype, device=values.device) / count
    mean_sq = torch.as_tensor(global_sum_sq, dtype=values.dtype, device=values.device) / count
    var = (mean_sq - mean.square()).clamp(min=0.0)  # E[x^2] - mean^2 can round below zero
    if count > 1:
        var = var * (count / (count - 1))
    whitened = (values - mean) * torch.rsqrt(var + eps)
    return whitened if shift_mean else whitened + mean


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, shift_mean: bool = True):
    """Single-process `masked_whiten_from_sums(values, *masked_moments(values, mask), ...)`."""
    return masked_whiten_from_sums(values, *masked_moments(values, mask), eps=eps, shift_mean=shift_mean)
