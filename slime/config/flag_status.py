"""Which of slime's flags cannot act here, and what a run that sets one is told.

Two kinds, each with the reason (docs/reference/slime-flags.md lists every slime flag with its status):
- `INERT`: accepted, no effect here (a Megatron or CUDA-vendor switch, slime's own CI checks, a value only a
  plugin reads). A run that sets one to anything but its default gets one warning at start-up naming them all.
- `REFUSED`: a feature of slime this project does not have (yet); setting the flag to anything but its default is
  an error naming the flag and why, so a run never silently does less than it was asked to.
Not the flags' definitions (the `arguments*.py` modules) nor the rules between flags (`validate_args.py`).
"""

from __future__ import annotations

import logging

from slime.config.errors import ArgumentError, cli_flag

logger = logging.getLogger(__name__)

_CUDA_TOOLING = "CUDA memory / profiler tooling of slime's Megatron actor"
_SLIME_CI = "slime's own CI assertions (this project's tests check train/rollout agreement themselves)"
_ROLLOUT_BUFFER = "read only by rollout functions that talk to slime's external rollout buffer (args keeps it)"

INERT = {
    "model_name": "picks slime's Megatron -> HF weight converter; the FSDP trainer's weights are HF-named already",
    "recompute_loss_function": "Megatron recomputes the loss to save memory; the log-prob head here is chunked",
    "freeze_indexer": "DSA (GLM-5 sparse attention) models only",
    "allgather_cp": "DSA (GLM-5 sparse attention) models only, which this project does not train",
    "qwen_gdn_backend": "kernel choice for Qwen linear-attention (GDN) layers; no such model here",
    "data_pad_size_multiplier": "Megatron pads packed micro-batches; varlen packing here needs no padding",
    "loss_mask_type": "the SFT rollout finds assistant tokens from the tokenizer's own chat template, any model",
    "megatron_deepgemm_forward_layers": "DeepGEMM FP8 forward of Megatron layers",
    "megatron_deepgemm_forward_modules": "DeepGEMM FP8 forward of Megatron layers",
    "megatron_deepgemm_moe_forward_layers": "DeepGEMM FP8 forward of Megatron layers",
    "megatron_deepgemm_moe_forward_modules": "DeepGEMM FP8 forward of Megatron layers",
    "memory_snapshot_dir": _CUDA_TOOLING,
    "memory_snapshot_num_steps": _CUDA_TOOLING,
    "memory_recorder": _CUDA_TOOLING,
    "profile_target": _CUDA_TOOLING,
    "ci_test": _SLIME_CI,
    "ci_disable_kl_checker": _SLIME_CI,
    "ci_train_rollout_logprob_abs_diff_threshold": _SLIME_CI,
    "ci_save_grad_norm": _SLIME_CI,
    "ci_load_grad_norm": _SLIME_CI,
    "http_proxy": "engine and router traffic is never proxied (loopback); plugins may read args.http_proxy",
    "use_distributed_post": "requests are sent from the rollout process's one HTTP client, not spread over Ray "
                            "actors per node",
    "rollout_buffer_url": _ROLLOUT_BUFFER,
    "fetch_trajectory_retry_times": _ROLLOUT_BUFFER,
    "min_batch_collection_ratio": _ROLLOUT_BUFFER,
    "rollout_task_type": _ROLLOUT_BUFFER,
    "wandb_always_use_train_step": "metrics are logged once per rollout, against the rollout id",
    "log_multi_turn": "multi-turn metrics are always logged",
}

REFUSED = {
    "rollout_data_transport": "only the Ray object store carries rollout data (nixl is not supported)",
    "enable_mtp_training": "no model family either backend builds (Qwen2/2.5, Qwen3, Llama 3, Qwen3-MoE) has "
                           "multi-token-prediction layers",
}


def check_flag_status(args, defaults: dict) -> list[str]:
    """Raise ValueError for a REFUSED flag set to anything but its default; return the INERT flags that are set
    (and warn about them once)."""
    for dest, why in REFUSED.items():
        if getattr(args, dest) != defaults[dest]:
            raise ArgumentError(f"{cli_flag(dest)} {getattr(args, dest)!r}: {why}")
    inert = [dest for dest in INERT if getattr(args, dest) != defaults[dest]]
    if inert:
        logger.warning("these slime flags have no effect here (docs/reference/slime-flags.md says why): %s",
                       ", ".join(cli_flag(dest) for dest in inert))
    return inert

# slime flags defined by other parts of this project (so not in the modules next to this one).
_MEGATRON_FLAGS = "a Megatron flag whose default slime resets: slime/config/flags_megatron.py"
_FAULT_TOLERANCE = "fault tolerance: its flags live with the RolloutManager's engine health checks"
_ROUTING_REPLAY = "MoE routing replay (R3): its flags live with the MoE trainer support"
DEFINED_ELSEWHERE = {
    "padded_vocab_size": _MEGATRON_FLAGS, "distributed_backend": _MEGATRON_FLAGS,
    "distributed_timeout_minutes": _MEGATRON_FLAGS, "async_save": _MEGATRON_FLAGS,
    "record_memory_history": _MEGATRON_FLAGS, "mtp_num_layers": _MEGATRON_FLAGS,
    "mtp_loss_scaling_factor": _MEGATRON_FLAGS,
    "use_fault_tolerance": _FAULT_TOLERANCE, "rollout_health_check_interval": _FAULT_TOLERANCE,
    "rollout_health_check_timeout": _FAULT_TOLERANCE, "rollout_health_check_first_wait": _FAULT_TOLERANCE,
    "use_routing_replay": _ROUTING_REPLAY, "use_rollout_routing_replay": _ROUTING_REPLAY,
}

# Defaults that differ from slime's on purpose.
DEFAULTS_CHANGED = {
    "train_backend": "fsdp (slime's only backend is megatron; --train-backend megatron where Megatron is installed)",
    "actor_num_gpus_per_node": "1: one trainer process, so that a run on a laptop or one GPU needs no flag (slime: 8)",
}
