"""Every rule that ties slime's flags together, and the fields derived from them, in one place.

Each rule raises `ArgumentError` (a ValueError) that names the flag and says how to fix it. Before anything
starts: every numeric flag is range-checked (`FLAG_RANGES`, flag_ranges.py), every dotted-path hook (`HOOK_FLAGS`) is imported and
checked callable, and `--load` must name a complete checkpoint (or nothing, with `--load-if-exists`). Derived fields:
device, world_size, rollout_num_engines, rollout_external and rollout_external_engine_urls, use_critic, critic_lr,
loss_agg_mode, loss_agg_constant, eps_clip_high, global_batch_size / num_steps_per_rollout, over_sampling_batch_size,
offload_train / offload_rollout, output_dir, eval_datasets. The trainer-side flags' rules (freezing, reducers, token
budgets, debug dumps) are in `validate_trainer_flags.py`, the weight-sync flags' in `validate_weight_sync.py`; the
Megatron flags' rules, the training backend and the parallel layout (train_backend, data_parallel_size, ...) are in
`validate_megatron_args.py`, run from here.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from slime.config.engine_layout import builtin_engine_gaps, check_engine_layout
from slime.config.errors import ArgumentError, cli_flag, require
from slime.config.flag_ranges import ANY, FLAG_RANGES
from slime.config.flags_lora import check_lora_args
from slime.config.flags_moe import check_moe_args
from slime.config.flags_on_policy import check_on_policy_args
from slime.config.validate_async import check_fully_async_flags
from slime.config.validate_megatron import validate_megatron_args, validate_megatron_batches
from slime.config.validate_trainer import check_trainer_flags
from slime.config.validate_vision import check_vision_language_flags
from slime.config.validate_weight_sync import check_release_train, check_weight_sync_flags
from slime.utils.checkpoint_state import (
    CheckpointError,
    critic_checkpoint,
    resume_dir,
    starts_fresh_without_checkpoint,
    weights_at_step,
)
from slime.utils.engine_access import external_engine_url
from slime.utils.eval_config import resolve_eval_datasets
from slime.utils.megatron_layout import is_megatron_checkpoint, is_torch_dist_folder
from slime.utils.misc import load_function, load_functions

logger = logging.getLogger(__name__)


# Flags naming a user function by dotted path: imported and checked callable before anything starts.
HOOK_FLAGS = (
    "rollout_function_path", "custom_generate_function_path", "dynamic_sampling_filter_path", "buffer_filter_path",
    "data_source_path", "custom_rm_path", "rollout_data_postprocess_path", "eval_function_path",
    "custom_loss_function_path", "custom_advantage_function_path", "custom_init_path",
    "custom_before_log_prob_hook_path", "custom_before_train_step_hook_path", "env_path",
    "custom_rollout_log_function_path", "custom_eval_rollout_log_function_path", "custom_reward_post_process_path",
    "custom_tis_function_path", "custom_pg_loss_reducer_function_path", "custom_model_provider_path",
    "custom_convert_samples_to_train_data_path", "rollout_sample_filter_path", "rollout_all_samples_process_path",
    "custom_update_weight_post_write_path",
)


def resolve_rollout_backend(args) -> None:
    """--rollout-backend's default: the built-in engine, for any --rollout-num-gpus-per-engine (an engine of N
    devices is N ranks of one built-in engine: engine/parallel/), unless the run's engine layout is one only SGLang
    runs (engines spanning nodes, SGLang's pp / dp reshaping, as slime's DeepSeek and Kimi recipes ask): then
    SGLang, said in the log. `--rollout-backend slime` with such a layout is refused by name instead."""
    if args.rollout_backend is None:
        gaps = builtin_engine_gaps(args)
        args.rollout_backend = "sglang" if gaps else "slime"
        if gaps:
            logger.info("rolling out with SGLang (--rollout-backend sglang): the built-in engine does not run %s",
                        "; ".join(gaps))


CKPT_STEP_FLAGS = {"ref_load": "ref_ckpt_step", "opd_teacher_load": "opd_teacher_ckpt_step"}


def _check_ranges(args) -> None:
    for dest, allowed in FLAG_RANGES.items():
        value = getattr(args, dest)
        for item in value if isinstance(value, list) else [value]:
            require(allowed is ANY or item is None or allowed.allows(item),
                     f"{cli_flag(dest)} {item}: must be {allowed}")


def _check_hooks(args) -> None:
    paths = [(dest, getattr(args, dest)) for dest in HOOK_FLAGS]
    paths += [("rollout_sample_hook_path", path) for path in args.rollout_sample_hook_path]
    for dest, path in paths:
        if path is not None:
            try:
                load_function(path, cli_flag(dest))
            except ValueError as exc:
                raise ArgumentError(str(exc)) from None
    _check_tools(args)


def _check_tools(args) -> None:
    """--tool-functions-path entries import (a callable or a list of callables); --tool-call-parser is known."""
    from slime.utils.tool_parsers import get_parser

    for path in args.tool_functions_path or []:
        try:
            load_functions(path, "--tool-functions-path")
        except ValueError as exc:
            raise ArgumentError(str(exc)) from None
    try:
        get_parser(args.tool_call_parser)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None
    require(args.max_turns > 1 or not (args.tool_functions_path or args.env_path),
             "--tool-functions-path / --env-path need --max-turns > 1 (a conversation of one turn never uses them)")


def _check_resume(args) -> None:
    """--load must name a complete checkpoint (the critic's too under ppo), or nothing with --load-if-exists (or
    with --save naming the same folder)."""
    try:
        actor_dir = resume_dir(args.load, load_if_exists=starts_fresh_without_checkpoint(args), step=args.ckpt_step)
        if actor_dir is not None and args.use_critic:
            critic_checkpoint(actor_dir)
    except CheckpointError as exc:
        raise ArgumentError(str(exc)) from None
    require(not args.load_if_exists or args.load, "--load-if-exists needs --load (the folder to resume from)")
    _check_megatron_checkpoints(args, actor_dir)


def _check_megatron_checkpoints(args, actor_dir) -> None:
    """Megatron checkpoints (torch_dist) are read by the Megatron backend only."""
    if args.train_backend == "megatron":
        return
    paths = [("load", actor_dir)] + [(flag, getattr(args, flag))
                                     for flag in ("ref_load", "opd_teacher_load", "critic_load")]
    for flag, path in paths:
        require(path is None or not (is_megatron_checkpoint(path) or is_torch_dist_folder(path)),
                 f"{cli_flag(flag)} {path}: a Megatron torch_dist checkpoint, which --train-backend "
                 f"{args.train_backend} cannot read; pass --train-backend megatron, or convert it with "
                 "tools/convert_torch_dist_to_hf.py and pass the HF folder")


def _check_paths(args) -> None:
    if args.load_debug_rollout_data is None or not args.debug_train_only:
        require(args.hf_checkpoint is not None, "--hf-checkpoint is required: a Hugging Face model folder")
    if args.hf_checkpoint is not None:
        config = Path(args.hf_checkpoint) / "config.json"
        require(config.is_file(), f"--hf-checkpoint {args.hf_checkpoint}: no config.json there; "
                                   "point it at a Hugging Face model folder")
    for flag in ("ref_load", "opd_teacher_load", "critic_load"):
        path = getattr(args, flag)
        step_flag = CKPT_STEP_FLAGS.get(flag)
        step = getattr(args, step_flag) if step_flag else None
        if step is not None:  # slime's: a step of a --save folder's checkpoints
            require(path is not None, f"{cli_flag(step_flag)} picks a checkpoint step of {cli_flag(flag)}; pass it")
        if step is not None or (path is not None and is_megatron_checkpoint(path)):
            try:
                path = weights_at_step(path, step, cli_flag(step_flag if step is not None else flag))
            except CheckpointError as exc:
                raise ArgumentError(str(exc)) from None
        if path is not None and not is_megatron_checkpoint(path):  # a Megatron one: --hf-checkpoint's architecture
            require((Path(path) / "config.json").is_file(),
                     f"--{flag.replace('_', '-')} {path}: not a Hugging Face model folder (no config.json) nor a "
                     "Megatron checkpoint (no latest_checkpointed_iteration.txt, not an iter_<7 digits> or release "
                     "folder of torch_dist files)")
    if args.prompt_data is not None:
        data_path = args.prompt_data.split("@[")[0]
        require(Path(data_path).is_file(), f"--prompt-data {data_path}: file not found")


def _resolve_cluster(args) -> None:
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.world_size = args.actor_num_nodes * args.actor_num_gpus_per_node
    args.rollout_external = args.rollout_external_engine_addrs is not None  # slime's name
    if args.rollout_external:
        require(not args.colocate, "--colocate shares this run's devices with engines it starts; external engines "
                                    "(--rollout-external-engine-addrs) run elsewhere: drop one of the two")
        try:
            args.rollout_external_engine_urls = [external_engine_url(a) for a in args.rollout_external_engine_addrs]
        except ValueError as error:
            raise ArgumentError(str(error)) from None
        args.rollout_num_gpus = 0  # the engines hold devices of their own, not this run's
    if args.colocate:
        args.offload_train = True if args.offload_train is None else args.offload_train
        args.offload_rollout = True if args.offload_rollout is None else args.offload_rollout
        if args.rollout_num_gpus is None:  # slime's rule: an explicit --rollout-num-gpus is kept
            args.rollout_num_gpus = args.world_size
    else:
        args.offload_train = bool(args.offload_train or args.offload)
        args.offload_rollout = bool(args.offload_rollout or args.offload)
    if args.rollout_num_gpus is None:
        args.rollout_num_gpus = 1
    check_engine_layout(args)
    args.rollout_num_engines = (len(args.rollout_external_engine_urls) if args.rollout_external
                                else args.rollout_num_gpus // args.rollout_num_gpus_per_engine)
    external_router = args.sglang_router_ip is not None or args.sglang_router_port is not None
    require(not external_router or (args.sglang_router_ip and args.sglang_router_port),
             "--sglang-router-ip and --sglang-router-port go together")
    args.use_external_router = bool(external_router)


def _resolve_batches(args) -> None:
    require(args.rollout_batch_size is not None, "--rollout-batch-size (prompts per rollout) is required")
    samples_per_rollout = args.rollout_batch_size * args.n_samples_per_prompt
    if args.num_steps_per_rollout is not None:
        derived = samples_per_rollout // args.num_steps_per_rollout
        require(args.global_batch_size in (None, derived) and derived * args.num_steps_per_rollout == samples_per_rollout,
                 f"--rollout-batch-size x --n-samples-per-prompt ({samples_per_rollout}) must equal "
                 f"--global-batch-size ({args.global_batch_size}) x --num-steps-per-rollout ({args.num_steps_per_rollout})")
        args.global_batch_size = derived
    elif args.global_batch_size is None:
        args.global_batch_size = samples_per_rollout
    require(samples_per_rollout % args.global_batch_size == 0,
             f"--rollout-batch-size x --n-samples-per-prompt ({samples_per_rollout}) must be a multiple of "
             f"--global-batch-size ({args.global_batch_size})")
    args.num_steps_per_rollout = samples_per_rollout // args.global_batch_size
    require(args.global_batch_size % args.data_parallel_size == 0,
             f"--global-batch-size {args.global_batch_size} must divide evenly over {args.data_parallel_size} "
             "data-parallel ranks (--actor-num-nodes x --actor-num-gpus-per-node trainer processes over "
             "--tensor-model-parallel-size x --pipeline-model-parallel-size x --context-parallel-size)")
    if args.use_dynamic_batch_size:
        require(args.max_tokens_per_gpu is not None, "--use-dynamic-batch-size needs --max-tokens-per-gpu")
    if args.over_sampling_batch_size is None:
        args.over_sampling_batch_size = args.rollout_batch_size
    require(args.over_sampling_batch_size >= args.rollout_batch_size,
             f"--over-sampling-batch-size {args.over_sampling_batch_size} must be >= "
             f"--rollout-batch-size {args.rollout_batch_size}")
    require(args.num_rollout is not None or args.num_epoch is not None or args.debug_train_only
             or args.load_debug_rollout_data is not None,
             "give --num-rollout or --num-epoch (how long to train)")


def _resolve_algorithm(args) -> None:
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
    uses_kl = args.kl_coef != 0 or args.use_kl_loss
    require(not uses_kl or args.ref_load is not None or args.lora_rank > 0,
             "KL (--kl-coef or --use-kl-loss) needs a reference model: pass --ref-load (usually the "
             "--hf-checkpoint folder; with --lora-rank > 0 the reference is the frozen base)")
    require(not (args.kl_coef != 0 and args.use_kl_loss and args.kl_loss_coef != 0),
             "--kl-coef (KL in the reward) and --use-kl-loss --kl-loss-coef (KL in the loss) exclude each other")
    if args.advantage_estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        require(args.normalize_advantages, f"--advantage-estimator {args.advantage_estimator} needs "
                                            "--normalize-advantages")
    require(not (args.use_rollout_logprobs and args.use_tis),
             "--use-rollout-logprobs and --use-tis exclude each other (TIS corrects recomputed old log-probs "
             "towards the rollout's)")
    require(args.loss_type != "custom_loss" or args.custom_loss_function_path,
             "--loss-type custom_loss needs --custom-loss-function-path")
    custom_rollout = (args.custom_generate_function_path is not None
                      or args.rollout_function_path != "slime.rollout.sglang_rollout.generate_rollout")
    require(not args.use_opd or args.opd_teacher_load or custom_rollout,
             "--use-opd needs teacher log-probs: --opd-teacher-load DIR (the trainer computes them), or a custom "
             "--custom-generate-function-path / --rollout-function-path that sets Sample.teacher_log_probs")
    require(args.opd_teacher_load is None or args.use_opd, "--opd-teacher-load is only used with --use-opd")
    if args.use_opd and args.opd_type is None:  # slime requires it; the teacher folder says which one is meant
        args.opd_type = "megatron" if args.opd_teacher_load else "sglang"
    require(args.opd_type != "megatron" or args.opd_teacher_load,
             "--opd-type megatron: the trainer computes the teacher log-probs, so it needs --opd-teacher-load DIR")
    require(args.opd_type != "sglang" or args.opd_teacher_load is None,
             "--opd-type sglang: teacher log-probs come from the rollout (Sample.teacher_log_probs); drop "
             "--opd-teacher-load or use --opd-type megatron")
    require(args.opd_type is None or args.use_opd, "--opd-type is only used with --use-opd")
    require(args.compute_advantages_and_returns or args.loss_type != "policy_loss",
             "--disable-compute-advantages-and-returns leaves the policy loss without advantages; use it with "
             "--loss-type sft_loss or custom_loss")
    if args.advantage_estimator == "cispo" and args.eps_clip < 1.0:  # slime's warning
        logger.warning("CISPO is canonically single-sided, but --eps-clip=%s keeps the lower clip bound %s active; "
                       "set --eps-clip 1.0 (and tune --eps-clip-high, e.g. 4.0) for the canonical wide setting",
                       args.eps_clip, 1.0 - args.eps_clip)
    if args.n_samples_per_prompt == 1:
        args.grpo_std_normalization = False
    args.use_critic = args.advantage_estimator == "ppo"
    require(args.use_critic or args.critic_load is None, "--critic-load is only used with --advantage-estimator ppo")
    if args.critic_lr is None:
        args.critic_lr = args.lr
    if args.loss_agg_mode is None:
        args.loss_agg_mode = "token_mean" if args.calculate_per_token_loss else "sample_mean"
    require(not args.calculate_per_token_loss or args.loss_agg_mode == "token_mean",
             f"--calculate-per-token-loss contradicts --loss-agg-mode {args.loss_agg_mode}; pass only one")
    args.calculate_per_token_loss = args.loss_agg_mode == "token_mean"
    if args.loss_agg_mode == "constant" and args.loss_agg_constant is None:
        require(args.rollout_max_response_len is not None,
                 "--loss-agg-mode constant needs --loss-agg-constant or --rollout-max-response-len (its default)")
        args.loss_agg_constant = float(args.rollout_max_response_len)
    require(args.loss_agg_constant is None or args.loss_agg_mode == "constant",
             "--loss-agg-constant is only used with --loss-agg-mode constant")
    require(args.tis_mode == "truncate" or args.use_tis, f"--tis-mode {args.tis_mode} needs --use-tis")
    require(args.custom_tis_function_path is None or args.use_tis,
             "--custom-tis-function-path replaces the TIS weights of --use-tis; pass --use-tis too")
    if args.loss_type == "policy_loss" and not args.debug_rollout_only:
        # A custom generate function may set each sample's reward itself (slime's agent examples grade their
        # episodes); a sample still without one fails at scoring, naming the flags.
        require(args.rm_type is not None or args.custom_rm_path is not None
                 or args.rollout_function_path != "slime.rollout.sglang_rollout.generate_rollout"
                 or getattr(args, "custom_generate_function_path", None) is not None,
                 "no reward: pass --rm-type (e.g. math, deepscaler, dapo, f1, gpqa, remote_rm) or --custom-rm-path "
                 "(or a --custom-generate-function-path that sets sample.reward)")
    require(args.rm_type != "remote_rm" or args.rm_url, "--rm-type remote_rm needs --rm-url")


def _resolve_eval_and_output(args) -> None:
    try:
        args.eval_datasets = resolve_eval_datasets(args)
    except (ValueError, TypeError) as exc:
        raise ArgumentError(str(exc)) from None
    source = "--eval-config" if args.eval_config else "--eval-prompt-data"
    for dataset in args.eval_datasets:
        require(Path(dataset.path.split("@[")[0]).is_file(),
                 f"{source} {dataset.name}: file {dataset.path} not found")
    if args.eval_datasets:  # slime's: the flat name/path list of every dataset
        args.eval_prompt_data = [item for dataset in args.eval_datasets for item in (dataset.name, dataset.path)]
    if args.eval_max_context_len is None:  # slime's default
        args.eval_max_context_len = args.rollout_max_context_len
    require(args.eval_interval is None or args.eval_datasets,
             "--eval-interval needs eval datasets (--eval-prompt-data or --eval-config)")
    require(args.save_interval is None or args.save, "--save-interval needs --save")
    if args.output_dir is None:
        args.output_dir = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}")


def _resolve_debug(args) -> None:
    """slime's debug and replay flags (docs/guides/fault-tolerance.md): a replay of saved rollouts needs no engines."""
    from slime.config.validate_trainer import resolve_debug_dumps

    resolve_debug_dumps(args)
    for flag in ("save_debug_rollout_data", "load_debug_rollout_data"):
        template = getattr(args, flag)
        require(template is None or "{rollout_id}" in template,
                 f"{cli_flag(flag)} {template}: the path needs a {{rollout_id}} placeholder (one file per rollout), "
                 "e.g. runs/debug/rollout_{rollout_id}.json")
    if args.load_debug_rollout_data is not None:
        args.debug_train_only = True  # as slime: training replays the saved rollouts, no engine starts
    require(not (args.debug_rollout_only and args.debug_train_only),
             "--debug-rollout-only (engines only) and --debug-train-only / --load-debug-rollout-data (trainer only) "
             "exclude each other")
    require(not (args.use_fault_tolerance and args.debug_train_only),
             "--use-fault-tolerance watches rollout engines; --debug-train-only / --load-debug-rollout-data start none")


# slime's dest names for the trainer hooks, whose flags are aliases of --custom-init-path & co. here.
SLIME_HOOK_DESTS = {"custom_megatron_init_path": "custom_init_path",
                    "custom_megatron_before_log_prob_hook_path": "custom_before_log_prob_hook_path",
                    "custom_megatron_before_train_step_hook_path": "custom_before_train_step_hook_path"}


def validate_args(args) -> None:
    for slime_dest, dest in SLIME_HOOK_DESTS.items():
        setattr(args, slime_dest, getattr(args, dest))

    _resolve_debug(args)
    _check_ranges(args)
    _check_hooks(args)
    _check_paths(args)
    check_moe_args(args, require)
    _resolve_cluster(args)
    check_weight_sync_flags(args)
    validate_megatron_args(args)
    check_lora_args(args)
    check_on_policy_args(args, require)
    _resolve_batches(args)
    validate_megatron_batches(args)
    _resolve_algorithm(args)
    check_vision_language_flags(args)
    check_release_train(args)
    check_trainer_flags(args)
    check_fully_async_flags(args)
    _resolve_eval_and_output(args)
    _check_resume(args)
