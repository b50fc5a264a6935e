"""`--true-on-policy-mode` and `--deterministic-mode` (Miles' names; the latter also Megatron's): the flags and
their rules, checked before anything starts. What the modes do: docs/guides/true-on-policy.md."""

from __future__ import annotations

import json
from pathlib import Path

from slime.utils.true_on_policy_families import family_refusal


def add_on_policy_arguments(parser):
    g = parser.add_argument_group("true on-policy and deterministic runs")
    g.add_argument("--true-on-policy-mode", action="store_true",
                   help="the engine and the trainer run one batch-invariant implementation of the model, so the "
                        "engine's log-probs of its sampled tokens equal the trainer's bit for bit "
                        "(train/train_rollout_logprob_abs_diff exactly 0); refuses what it does not cover")
    # --deterministic-mode is registered with Megatron's flags (slime passes it to Megatron); its rules are here.


def check_on_policy_args(args, require) -> None:
    """The modes' rules; `require(condition, message)` raises the parser's ArgumentError. Sets the engine's
    batch-invariant forward (engine Config.true_on_policy) for either mode."""
    if args.deterministic_mode:
        _check_deterministic(args, require)
    if not (args.true_on_policy_mode or args.deterministic_mode):
        return
    mode = "--true-on-policy-mode" if args.true_on_policy_mode else "--deterministic-mode"
    require(args.rollout_backend == "slime", f"{mode} needs the built-in engine (--rollout-backend slime): it runs "
                                             "the batch-invariant decoder; SGLang's kernels are not the trainer's")
    require(args.rollout_num_gpus_per_engine == 1,
            f"{mode} with --rollout-num-gpus-per-engine {args.rollout_num_gpus_per_engine}: a sharded engine reduces "
            "over ranks in another order; use one device per engine")
    if args.hf_checkpoint and Path(args.hf_checkpoint, "config.json").is_file():
        model_type = json.loads(Path(args.hf_checkpoint, "config.json").read_text()).get("model_type")
        refusal = family_refusal(model_type)
        require(refusal is None, (refusal or "").replace("--true-on-policy-mode", mode))
    args.engine_config["true_on_policy"] = True
    if args.true_on_policy_mode:
        _check_true_on_policy(args, require)


def _check_true_on_policy(args, require) -> None:
    refused = [
        (args.lora_rank > 0 and args.train_backend != "fsdp",
         f"--lora-rank on the {args.train_backend} backend (LoRA is covered on --train-backend fsdp)"),
        (args.lora_rank > 0 and bool(args.lora_adapter_key),
         "--lora-adapter-key / --lora-adapter-names (several adapters; one adapter is covered)"),
        (args.lora_rank > 0 and args.lora_dropout > 0,
         f"--lora-dropout {args.lora_dropout} (the trainer's dropout mask is not the engine's; use 0)"),
        (args.lora_rank > 0 and _is_moe_checkpoint(args), "--lora-rank on a mixture-of-experts model"),
        (args.compile_model, "--compile-model (the decoder layers run the batch-invariant forward, uncompiled)"),
        (args.recompute_activations, "--recompute-activations (not tested with the batch-invariant layers)"),
        (args.use_routing_replay and not args.use_rollout_routing_replay,
         "--use-routing-replay (replaying the trainer's own old-policy routing; MoE models are covered with the "
         "engine's routing, --use-rollout-routing-replay)"),
        (args.moe_aux_loss_coeff > 0 or bool(args.moe_z_loss_coeff),
         "--moe-aux-loss-coeff / --moe-z-loss-coeff (router losses are not in the batch-invariant decoder; set them "
         "to 0)"),
        (args.moe_router_dtype is not None, "--moe-router-dtype (the batch-invariant router computes its logits in "
                                            "the model dtype and the softmax in float32, as the engine does)"),
        (args.partial_rollout and not args.mask_offpolicy_in_partial_rollout,
         "--partial-rollout without --mask-offpolicy-in-partial-rollout (tokens sampled before a weight update "
         "are off-policy under the new weights; pass --mask-offpolicy-in-partial-rollout so only the tokens of "
         "the current weights train)"),
    ]
    if args.train_backend == "megatron":
        refused.append((_is_moe_checkpoint(args), "a mixture-of-experts model on the Megatron backend (covered on "
                                                  "--train-backend fsdp)"))
        for flag in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "expert_model_parallel_size"):
            size = getattr(args, flag)
            refused.append((size != 1, f"--{flag.replace('_', '-')} {size} on the Megatron backend (covered at size "
                                       "1: a split layer reduces in a layout-dependent order)"))
    for is_refused, what in refused:
        require(not is_refused, f"--true-on-policy-mode does not cover {what}")


def _is_moe_checkpoint(args) -> bool:
    config = Path(args.hf_checkpoint or "", "config.json")
    return config.is_file() and json.loads(config.read_text()).get("model_type") == "qwen3_moe"


def _check_deterministic(args, require) -> None:
    """Runs whose trained samples depend on which requests finish first cannot repeat."""
    refused = [
        (args.over_sampling_batch_size not in (None, args.rollout_batch_size),
         f"--over-sampling-batch-size {args.over_sampling_batch_size} (the groups kept would be the first to "
         "finish)"),
        (args.dynamic_sampling_filter_path is not None,
         "--dynamic-sampling-filter-path (refills depend on which groups finish first)"),
        (args.partial_rollout, "--partial-rollout (what is aborted mid-generation depends on timing)"),
    ]
    for is_refused, what in refused:
        require(not is_refused, f"--deterministic-mode does not cover {what}")
