"""The FSDP backend's MoE routers: transformers' top-k softmax routers (Qwen3-MoE, Qwen2-MoE `mlp.gate`) and biased,
group-limited sigmoid routers (GLM-4.5 `Glm4MoeTopkRouter`, DeepSeek-V3 / Kimi K2 / Moonlight `DeepseekV3TopkRouter`,
GLM-4.7-Flash) re-bound so that the expert ids come from the routing replay object (routing_replay.py: free,
recorded or replayed) and the router outputs of a training forward are kept for the router losses and the load
metric.

Same math as transformers' router when routing freely. Softmax: logits = hidden @ gate.T (in --moe-router-dtype if
set), softmax in float32, top-k, routing weights = the probabilities at the chosen experts (renormalized with
norm_topk_prob). Sigmoid (`engine/layers/grouped_router.py`, shared with the engine): float32 logits, scores =
sigmoid, the ids chosen on scores + e_score_correction_bias after the group mask (what replay records and replays),
weights = the UNBIASED scores at the ids used, renormalised with norm_topk_prob, times routed_scaling_factor; the
trace keeps the scores normalised over the experts as the "probs" of the load-balancing loss (Megatron's rule for
sigmoid routers). The experts stay transformers' (`grouped_mm`: tokens sorted by expert, one grouped GEMM per
projection). Not the replay policy (the train flow sets stages) and not the loss math (moe_aux_loss.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from slime.backends.routing_replay import RoutingReplay
from slime.engine.layers.grouped_router import choice_scores, routed_weights
from slime.utils.moe_config import moe_layer_indices

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
SOFTMAX_ROUTER_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")
SIGMOID_ROUTER_MODEL_TYPES = ("glm4_moe", "deepseek_v3", "glm4_moe_lite")


class RouterTrace:
    """(logits, probs, expert ids) of each MoE layer of the forward in flight, while `active`."""

    def __init__(self):
        self.active = False
        self.layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def start(self) -> None:
        self.active, self.layers = True, []

    def stop(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        layers, self.active, self.layers = self.layers, False, []
        return layers


def moe_routers(hf_model: nn.Module) -> list[nn.Module]:
    """The router of every sparse decoder layer, in layer order (empty for a dense model)."""
    return [layer.mlp.gate for layer in hf_model.get_decoder().layers if hasattr(layer.mlp, "experts")]


def install_routers(hf_model: nn.Module, router_dtype: str | None) -> tuple[RoutingReplay, RouterTrace] | None:
    """Re-bind every MoE router of `hf_model`; returns the replay object and the trace they use (None: dense)."""
    routers = moe_routers(hf_model)
    if not routers:
        return None
    config = hf_model.config
    if config.model_type in SOFTMAX_ROUTER_MODEL_TYPES:
        forward = _routed_forward
    elif config.model_type in SIGMOID_ROUTER_MODEL_TYPES:
        forward = _sigmoid_routed_forward
    else:
        raise ValueError(f"MoE model_type {config.model_type!r}: the FSDP backend's router knows "
                         f"{', '.join(SOFTMAX_ROUTER_MODEL_TYPES + SIGMOID_ROUTER_MODEL_TYPES)}")
    layer_indices = moe_layer_indices(config.to_dict())
    assert len(layer_indices) == len(routers), f"MoE layers {layer_indices} but {len(routers)} routers"
    replay = RoutingReplay(len(routers), routers[0].top_k, routers[0].num_experts, layer_indices=layer_indices,
                           num_hidden_layers=config.num_hidden_layers)
    trace = RouterTrace()
    dtype = ROUTER_DTYPES[router_dtype] if router_dtype else None
    for layer, router in enumerate(routers):
        router.forward = functools.partial(forward, router, layer, replay, trace, dtype)
    return replay, trace


def _routed_forward(router: nn.Module, layer: int, replay: RoutingReplay, trace: RouterTrace,
                    logits_dtype: torch.dtype | None, hidden_states: torch.Tensor):
    hidden = hidden_states.reshape(-1, router.hidden_dim)
    weight = router.weight
    if logits_dtype is not None:
        hidden, weight = hidden.to(logits_dtype), weight.to(logits_dtype)
    logits = F.linear(hidden, weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32 if logits_dtype is None else logits_dtype)
    expert_ids = replay.select(layer, probs)
    weights = probs.gather(1, expert_ids)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if trace.active:
        trace.layers.append((logits, probs, expert_ids))
    return logits, weights.to(hidden_states.dtype), expert_ids


def _sigmoid_routed_forward(router: nn.Module, layer: int, replay: RoutingReplay, trace: RouterTrace,
                            logits_dtype: torch.dtype | None, hidden_states: torch.Tensor):
    dtype = logits_dtype or torch.float32  # transformers computes these routers in float32
    logits = F.linear(hidden_states.reshape(-1, router.hidden_dim).to(dtype), router.weight.to(dtype))
    scores = logits.sigmoid()
    with torch.no_grad():  # the choice (bias, group mask) takes no gradient; the weights below do
        choice = choice_scores(scores, router.e_score_correction_bias, router.num_group, router.topk_group)
    expert_ids = replay.select(layer, choice)
    weights = routed_weights(scores, expert_ids, router.routed_scaling_factor, router.norm_topk_prob)
    if trace.active:
        trace.layers.append((logits, scores / (scores.sum(dim=-1, keepdim=True) + 1e-20), expert_ids))
    return logits, weights, expert_ids
