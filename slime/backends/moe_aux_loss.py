"""Router losses of MoE policies with Megatron's definitions and flags (pure torch, per MoE layer, summed over
layers as Megatron attaches one per layer):

- load balancing (--moe-aux-loss-coeff, --moe-router-load-balancing-type): the Switch Transformer loss
  num_experts * sum_e f_e * P_e, f_e the fraction of the top-k slots routed to expert e and P_e its mean router
  probability, over the micro-batch's tokens (aux_loss) or per sample and then averaged (seq_aux_loss);
- z-loss (--moe-z-loss-coeff): mean over tokens of logsumexp(router logits)^2 (ST-MoE).

Also the expert load of a micro-batch (routed slots per expert), for the load-balance metric. Not the router (the
backend's) and not routing replay (routing_replay.py).
"""

from __future__ import annotations

import torch


def load_balancing_loss(probs: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """probs [num_tokens, num_experts] (softmax over all experts), expert_ids [num_tokens, top_k] -> scalar."""
    slots = torch.zeros(num_experts, dtype=probs.dtype, device=probs.device)
    slots.scatter_add_(0, expert_ids.reshape(-1), torch.ones(expert_ids.numel(), dtype=probs.dtype,
                                                             device=probs.device))
    fraction = slots / expert_ids.numel()
    return num_experts * (fraction.detach() * probs.mean(dim=0)).sum()


def sequence_load_balancing_loss(probs: torch.Tensor, expert_ids: torch.Tensor, num_experts: int,
                                 sample_lengths: list[int]) -> torch.Tensor:
    """The same loss per sample of a packed row (`sample_lengths` tokens each), averaged over the samples."""
    losses = [load_balancing_loss(p, ids, num_experts)
              for p, ids in zip(probs.split(sample_lengths), expert_ids.split(sample_lengths))]
    return torch.stack(losses).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def router_losses(args, layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], num_experts: int,
                  sample_lengths: list[int]) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """(the weighted sum to add to the loss, or None when no router loss is on; unweighted per-layer means and the
    expert load imbalance for the metrics) from each MoE layer's (logits, probs, expert_ids) of one micro-batch.
    Load imbalance: the busiest expert's routed slots over the mean, averaged over layers (1 = even)."""
    total = None
    metrics = {}
    with torch.no_grad():
        loads = []
        for _, _, expert_ids in layers:
            counts = torch.bincount(expert_ids.reshape(-1), minlength=num_experts).double()
            loads.append(counts.max() / counts.mean())
        metrics["moe_load_imbalance"] = torch.stack(loads).mean()
    balance_type = args.moe_router_load_balancing_type
    if args.moe_aux_loss_coeff > 0 and balance_type != "none":
        if balance_type == "seq_aux_loss":
            values = [sequence_load_balancing_loss(p, ids, num_experts, sample_lengths) for _, p, ids in layers]
        else:
            values = [load_balancing_loss(p, ids, num_experts) for _, p, ids in layers]
        aux = torch.stack(values).sum()
        total = args.moe_aux_loss_coeff * aux
        metrics["moe_aux_loss"] = aux.detach() / len(layers)
    if args.moe_z_loss_coeff:
        z = torch.stack([z_loss(logits) for logits, _, _ in layers]).sum()
        total = args.moe_z_loss_coeff * z if total is None else total + args.moe_z_loss_coeff * z
        metrics["moe_z_loss"] = z.detach() / len(layers)
    return total, metrics
