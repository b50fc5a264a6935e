"""The accepted values of every numeric flag (`FLAG_RANGES`, checked by validate_args before anything starts):
a `Range` per flag, sglang-router's numeric --router-* flags included. Data only; the checks are validate_args'."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """The values a numeric flag accepts: [low, high] (either end open or absent), plus sentinel `also` values."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple = ()
    why: str = ""

    def allows(self, value) -> bool:
        if value in self.also:
            return True
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            text = f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {self.low}"
        else:
            text = f"{'<' if self.high_open else '<='} {self.high}"
        return text + "".join(f" or {value}" for value in self.also) + (f" ({self.why})" if self.why else "")


ANY = None  # a numeric flag with no range (a seed, a sentinel-only value)
AT_LEAST_1 = Range(low=1)
NON_NEGATIVE = Range(low=0)
POSITIVE = Range(low=0, low_open=True)
PROBABILITY = Range(low=0, high=1)
TOP_P = Range(low=0, high=1, low_open=True)
TOP_K = Range(low=1, also=(-1,), why="-1 = off")
ADAM_BETA = Range(low=0, high=1, high_open=True)

# Every int / float flag -> the values it accepts (None values, i.e. flags left unset, are not checked). A test
# checks that every numeric flag of the parser is listed here.
FLAG_RANGES = {
    # cluster
    "actor_num_nodes": AT_LEAST_1, "actor_num_gpus_per_node": AT_LEAST_1, "rollout_num_gpus": AT_LEAST_1,
    "rollout_num_gpus_per_engine": AT_LEAST_1, "num_gpus_per_node": AT_LEAST_1,
    # model
    "save_interval": AT_LEAST_1, "log_probs_chunk_size": ANY,
    "num_layers": AT_LEAST_1, "hidden_size": AT_LEAST_1, "ffn_hidden_size": AT_LEAST_1,
    "num_attention_heads": AT_LEAST_1, "num_query_groups": AT_LEAST_1, "kv_channels": AT_LEAST_1,
    "vocab_size": AT_LEAST_1, "rotary_base": POSITIVE, "layernorm_epsilon": POSITIVE, "seq_length": AT_LEAST_1,
    "max_position_embeddings": AT_LEAST_1, "rotary_percent": TOP_P,
    # megatron (slime/config/flags_megatron.py)
    "tensor_model_parallel_size": AT_LEAST_1, "pipeline_model_parallel_size": AT_LEAST_1,
    "num_layers_per_virtual_pipeline_stage": AT_LEAST_1, "num_virtual_stages_per_pipeline_rank": AT_LEAST_1,
    "context_parallel_size": AT_LEAST_1, "expert_model_parallel_size": AT_LEAST_1,
    "expert_tensor_parallel_size": AT_LEAST_1, "recompute_num_layers": AT_LEAST_1, "lr_warmup_fraction": PROBABILITY,
    "attention_dropout": PROBABILITY, "hidden_dropout": PROBABILITY, "rotary_scaling_factor": POSITIVE,
    "mscale": POSITIVE, "mscale_all_dim": NON_NEGATIVE, "q_lora_rank": AT_LEAST_1, "kv_lora_rank": AT_LEAST_1,
    "qk_head_dim": AT_LEAST_1, "qk_pos_emb_head_dim": AT_LEAST_1, "v_head_dim": AT_LEAST_1,
    "moe_router_topk_scaling_factor": POSITIVE, "moe_router_num_groups": AT_LEAST_1,
    "moe_router_group_topk": AT_LEAST_1, "moe_router_bias_update_rate": NON_NEGATIVE,
    "make_vocab_size_divisible_by": AT_LEAST_1, "decoder_first_pipeline_num_layers": NON_NEGATIVE,
    "decoder_last_pipeline_num_layers": NON_NEGATIVE, "ckpt_step": NON_NEGATIVE, "padded_vocab_size": AT_LEAST_1,
    "distributed_timeout_minutes": AT_LEAST_1, "mtp_num_layers": NON_NEGATIVE, "mtp_loss_scaling_factor": NON_NEGATIVE,
    # LoRA (slime/config/flags_lora.py)
    "lora_rank": NON_NEGATIVE, "lora_alpha": POSITIVE,
    "max_weight_staleness": NON_NEGATIVE, "async_max_concurrent_samples": AT_LEAST_1,
    "async_data_buffer_capacity_factor": Range(low=1, why="the buffer holds at least one batch"),
    "lora_dropout": Range(low=0, high=1, high_open=True, why="a dropout probability below 1"),
    # data
    "rollout_seed": ANY, "num_rollout": NON_NEGATIVE, "num_epoch": AT_LEAST_1, "start_rollout_id": NON_NEGATIVE,
    # rollout
    "rollout_batch_size": AT_LEAST_1, "n_samples_per_prompt": AT_LEAST_1,
    "rollout_temperature": Range(low=0, low_open=True, why="log-probs are taken at this temperature"),
    "rollout_top_p": TOP_P, "rollout_top_k": TOP_K, "rollout_max_response_len": AT_LEAST_1,
    "rollout_max_prompt_len": AT_LEAST_1, "rollout_max_context_len": AT_LEAST_1, "rollout_stop_token_ids": NON_NEGATIVE,
    "over_sampling_batch_size": AT_LEAST_1, "sglang_router_port": Range(low=1, high=65535),
    "sglang_server_concurrency": AT_LEAST_1, "update_weight_buffer_size": AT_LEAST_1,
    "update_weights_interval": AT_LEAST_1,
    # fault tolerance
    "rollout_health_check_interval": POSITIVE, "rollout_health_check_timeout": POSITIVE,
    "rollout_health_check_first_wait": NON_NEGATIVE, "max_engine_restarts": NON_NEGATIVE,
    # multi-turn
    "max_turns": AT_LEAST_1, "tool_timeout": POSITIVE, "max_tool_response_chars": AT_LEAST_1,
    # reward
    "reward_timeout": POSITIVE, "reward_failure_value": ANY,
    # training
    "global_batch_size": AT_LEAST_1, "num_steps_per_rollout": AT_LEAST_1, "micro_batch_size": AT_LEAST_1,
    "max_tokens_per_gpu": AT_LEAST_1, "lr": NON_NEGATIVE, "min_lr": NON_NEGATIVE, "lr_warmup_iters": NON_NEGATIVE,
    "weight_decay": NON_NEGATIVE, "adam_beta1": ADAM_BETA, "adam_beta2": ADAM_BETA, "adam_eps": NON_NEGATIVE,
    "clip_grad": Range(low=0, why="0 = no clipping"), "seed": Range(low=0, high=2**32 - 1),
    # algorithm
    "eps_clip": NON_NEGATIVE, "eps_clip_high": NON_NEGATIVE, "eps_clip_c": Range(low=1, low_open=True, why="dual clip"),
    "value_clip": NON_NEGATIVE, "critic_lr": NON_NEGATIVE, "kl_coef": NON_NEGATIVE, "kl_loss_coef": NON_NEGATIVE,
    "ref_update_interval": AT_LEAST_1, "entropy_coef": NON_NEGATIVE, "gamma": PROBABILITY, "lambd": PROBABILITY,
    "loss_agg_constant": POSITIVE, "tis_clip": POSITIVE, "tis_clip_low": NON_NEGATIVE,
    "num_critic_only_steps": NON_NEGATIVE, "opd_kl_coef": NON_NEGATIVE,
    # mixture of experts
    "num_experts": AT_LEAST_1, "moe_router_topk": AT_LEAST_1, "moe_ffn_hidden_size": AT_LEAST_1,
    "moe_shared_expert_intermediate_size": AT_LEAST_1, "moe_aux_loss_coeff": NON_NEGATIVE,
    "moe_z_loss_coeff": NON_NEGATIVE,
    # eval
    "eval_interval": AT_LEAST_1, "n_samples_per_eval_prompt": AT_LEAST_1,
    "eval_temperature": Range(low=0, why="0 = greedy"), "eval_top_p": TOP_P, "eval_top_k": TOP_K, "eval_max_response_len": AT_LEAST_1,
    "eval_max_prompt_len": AT_LEAST_1, "eval_min_new_tokens": NON_NEGATIVE, "eval_max_context_len": AT_LEAST_1,
    # more of slime's flags (arguments_*.py)
    "sglang_router_request_timeout_secs": POSITIVE, "prefill_num_servers": AT_LEAST_1,
    "ci_train_rollout_logprob_abs_diff_threshold": NON_NEGATIVE, "data_pad_size_multiplier": AT_LEAST_1,
    "fetch_trajectory_retry_times": Range(low=0, also=(-1,), why="-1 = forever"),
    "load_debug_rollout_data_subsample": Range(low=0, high=1, low_open=True),
    "log_probs_max_tokens_per_gpu": AT_LEAST_1, "megatron_deepgemm_forward_layers": NON_NEGATIVE,
    "megatron_deepgemm_moe_forward_layers": NON_NEGATIVE, "memory_snapshot_num_steps": AT_LEAST_1,
    "min_batch_collection_ratio": Range(low=0, high=1, low_open=True), "opd_teacher_ckpt_step": NON_NEGATIVE,
    "opsm_delta": NON_NEGATIVE, "ref_ckpt_step": NON_NEGATIVE,
}


def _router_flag_ranges() -> dict:
    """sglang-router's numeric --router-* flags: non-negative, its -1 sentinels and ports as such."""
    import argparse

    from sglang_router.launch_router import RouterArgs

    parser = argparse.ArgumentParser(add_help=False)
    RouterArgs.add_cli_args(parser, use_router_prefix=True, exclude_host_port=True)
    ranges = {}
    for action in parser._actions:
        if action.dest.startswith("router_") and action.type in (int, float):
            ranges[action.dest] = Range(low=1, high=65535) if action.dest.endswith("_port") else \
                Range(low=0, also=(-1,), why="-1 = no limit") if action.default == -1 else NON_NEGATIVE
    return ranges


FLAG_RANGES.update(_router_flag_ranges())
