"""Mixture-of-experts flags: slime's routing replay (--use-routing-replay, --use-rollout-routing-replay) and
Megatron's MoE flags as slime's model presets pass them (scripts/models/qwen3-30B-A3B.sh), with their meaning for
these backends. Parsing (`add_moe_arguments`, registered in arguments.py) and the MoE rules
(`check_moe_args`, called from validate_args.py) in one file, so the MoE surface reads in one place.

Meaning on the FSDP backend (the HF model's own router and experts):
- shape flags (--num-experts, --moe-router-topk, --moe-ffn-hidden-size, --moe-shared-expert-intermediate-size,
  --moe-layer-freq, --moe-router-score-function) must agree with the checkpoint's config.json;
- --moe-aux-loss-coeff with --moe-router-load-balancing-type (aux_loss: over the micro-batch's tokens; seq_aux_loss:
  per sample, then averaged) and --moe-z-loss-coeff add to the policy loss;
- --moe-router-dtype: the dtype of the router's logits (fp32 / fp64; default: the model's compute dtype);
- kernel and dispatch choices (--moe-grouped-gemm, --moe-token-dispatcher-type, --moe-permute-fusion) select
  Megatron kernels; the FSDP backend always runs grouped GEMM experts (transformers' grouped_mm) and never drops
  tokens, which is what they ask for.
On the Megatron backend the replay flags and router losses mean the same (megatron_utils/moe_router.py and
router_losses.py); --moe-grouped-gemm picks grouped experts (megatron_utils/grouped_experts.py, or TE's) over
megatron-core's SequentialMLP and --moe-token-dispatcher-type its token dispatcher (alltoall by default; the
layouts a type cannot run in are validate_megatron_args.py's rules); --moe-permute-fusion changes nothing.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")


def add_moe_arguments(parser):
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--use-routing-replay", action="store_true",
                   help="record the MoE routing in the old-policy log-prob pass and replay it in the training "
                        "forward and backward, so every optimizer step sees the routing the old log-probs saw")
    g.add_argument("--use-rollout-routing-replay", action="store_true",
                   help="R3 (arXiv 2510.11370): the engines return the experts they routed every token to "
                        "(Sample.rollout_routed_experts) and every trainer pass of the policy replays them; the "
                        "reference and teacher passes route freely")
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--moe-router-topk", type=int, default=None)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g.add_argument("--moe-layer-freq", default=None,
                   help="Megatron's: an int N (every N-th layer is MoE) or a list expression like '([1]*48)'")
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"], default=None)
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="weight of the load-balancing loss num_experts * sum_e f_e * P_e (Switch Transformer; f_e: "
                        "fraction of routed token slots, P_e: mean router probability), averaged over MoE layers")
    g.add_argument("--moe-router-load-balancing-type", choices=LOAD_BALANCING_TYPES, default="aux_loss",
                   help="aux_loss: f and P over the micro-batch's tokens; seq_aux_loss: per sample, then the mean; "
                        "none: no load-balancing loss")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None,
                   help="weight of the router z-loss mean(logsumexp(router logits)^2) (ST-MoE)")
    g.add_argument("--moe-router-dtype", choices=["fp32", "fp64"], default=None)
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="Megatron backend: all local experts of a layer in one grouped GEMM per projection "
                        "(torch grouped_mm, or Transformer Engine's grouped experts) instead of one MLP per expert")
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall", "flex"], default=None,
                   help="Megatron backend: megatron-core's token dispatcher (default alltoall; flex is refused, "
                        "allgather only where the gathering ranks are tensor-parallel peers)")
    g.add_argument("--moe-permute-fusion", action="store_true")


def _layer_pattern(value: str, num_layers: int) -> list[int]:
    """Megatron's --moe-layer-freq as a 0/1 list per layer: an int N, or an expression of int lists, `*` and `+`."""

    def evaluate(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List):
            return [evaluate(element) for element in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Add)):
            left, right = evaluate(node.left), evaluate(node.right)
            return left * right if isinstance(node.op, ast.Mult) else left + right
        raise ValueError(f"--moe-layer-freq {value!r}: expected an int or a list expression like '([1]*48)'")

    try:
        tree = ast.parse(value.strip().strip("'\""), mode="eval").body
    except SyntaxError:
        raise ValueError(f"--moe-layer-freq {value!r}: expected an int or a list expression like '([1]*48)'") from None
    pattern = evaluate(tree)
    if isinstance(pattern, int):
        return [int(index % pattern == 0) for index in range(num_layers)]
    return pattern


def check_moe_args(args, require) -> None:
    """The MoE rules; `require(condition, message)` raises the parser's ArgumentError."""
    from slime.config.validate_families import check_router_flags
    from slime.utils.moe_config import checkpoint_moe_flags, moe_layer_indices

    replay = args.use_routing_replay or args.use_rollout_routing_replay
    moe_flags = [flag for flag in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
                                   "moe_shared_expert_intermediate_size", "moe_router_score_function")
                 if getattr(args, flag) is not None]
    if args.use_rollout_routing_replay:
        args.engine_config["enable_return_routed_experts"] = True  # the built-in engine's server flag
    if args.hf_checkpoint is None or not (replay or moe_flags or args.moe_aux_loss_coeff or args.moe_z_loss_coeff):
        return
    config = json.loads((Path(args.hf_checkpoint) / "config.json").read_text())
    layers = moe_layer_indices(config)
    if not layers:
        used = ("--use-rollout-routing-replay" if args.use_rollout_routing_replay else
                "--use-routing-replay" if args.use_routing_replay else
                "--" + (moe_flags[0] if moe_flags else "moe_aux_loss_coeff").replace("_", "-"))
        require(False, f"{used}: {args.hf_checkpoint} is not a mixture-of-experts model "
                       f"(model_type {config.get('model_type')!r})")
    expected = checkpoint_moe_flags(config)
    score_function = expected.pop("moe_router_score_function")
    for flag, actual in expected.items():
        value = getattr(args, flag)
        require(value is None or value == actual,
                f"--{flag.replace('_', '-')} {value} does not match the checkpoint's {actual} "
                f"({args.hf_checkpoint}/config.json); fix the model preset or the checkpoint")
    if args.moe_layer_freq is not None:
        pattern = _layer_pattern(args.moe_layer_freq, config["num_hidden_layers"])
        actual = [int(index in layers) for index in range(config["num_hidden_layers"])]
        require(pattern == actual, f"--moe-layer-freq {args.moe_layer_freq} gives MoE layers {pattern}, the "
                                   f"checkpoint has {actual}")
    require(args.moe_router_score_function in (None, score_function),
            f"--moe-router-score-function {args.moe_router_score_function}: {config.get('model_type')} routes by "
            f"{score_function}")
    check_router_flags(args, config, require)
