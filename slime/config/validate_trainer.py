"""The rules of slime's trainer-side flags around the loss, the parameters, the optimizer, the token budgets, the
debug dumps and the Megatron-backend hooks, and the fields derived from them (`validate_args` calls these).

Each rule raises `ArgumentError` naming the flag and how to fix it. Derived: --dump-details sets
--save-debug-rollout-data and --save-debug-train-data (slime's paths); --log-probs-max-tokens-per-gpu defaults to
--max-tokens-per-gpu with dynamic batch sizes; --balance-by-flops turns on --balance-data.

Not the features themselves (slime/backends/, slime/utils/debug_dump.py, slime/config/megatron_role_config.py).
"""

from __future__ import annotations

import re

from slime.config.errors import ArgumentError, cli_flag, require

# Flags of slime's Megatron actor that only the Megatron backend here implements.
MEGATRON_BACKEND_ONLY = ("custom_model_provider_path", "megatron_config_path")


def resolve_debug_dumps(args) -> None:
    """slime's --dump-details DIR: the rollout and train data of every rollout under DIR (before the paths'
    checks)."""
    if args.dump_details is not None:
        args.save_debug_rollout_data = f"{args.dump_details}/rollout_data/{{rollout_id}}.pt"
        args.save_debug_train_data = f"{args.dump_details}/train_data/{{rollout_id}}.pt"
    require(args.save_debug_train_data is None or args.save_debug_train_data != args.save_debug_rollout_data,
             "--save-debug-train-data must differ from --save-debug-rollout-data (the two dumps would overwrite "
             "each other)")
    require(args.save_debug_train_data is None or "{rollout_id}" in args.save_debug_train_data,
             f"--save-debug-train-data {args.save_debug_train_data}: the path needs a {{rollout_id}} placeholder "
             "(one file per rollout), e.g. runs/debug/train_{rollout_id}.pt")
    require(args.load_debug_rollout_data_subsample is None or args.load_debug_rollout_data is not None,
             "--load-debug-rollout-data-subsample subsamples the rollouts of --load-debug-rollout-data; pass both")
    forge = "slime.rollout.forge_load.generate_rollout"
    require(args.load_forge_rollout_data is None or forge in (args.rollout_function_path, args.eval_function_path),
             f"--load-forge-rollout-data is read by slime's forge rollout function: pass --rollout-function-path "
             f"{forge}")


def check_trainer_flags(args) -> None:
    """Once the loss aggregation mode and the batch sizes are resolved."""
    require(not (args.only_train_params_name_list and args.freeze_params_name_list),
             "pass only one of --only-train-params-name-list and --freeze-params-name-list (as slime)")
    for dest in ("only_train_params_name_list", "freeze_params_name_list"):
        for pattern in getattr(args, dest) or []:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ArgumentError(f"{cli_flag(dest)} {pattern!r}: not a Python regular expression ({exc})") from None
    require(args.custom_pg_loss_reducer_function_path is None or args.loss_agg_mode != "constant",
             "--custom-pg-loss-reducer-function-path returns slime's per-sample or per-token sums; use it with "
             "--loss-agg-mode sample_mean or token_mean, not constant")
    require(not args.use_stateless_adam or args.no_save_optim,
             "--use-stateless-adam keeps no optimizer state to save; pass --no-save-optim too (as slime)")
    require(not args.balance_by_flops or args.use_dynamic_batch_size,
             "--balance-by-flops sizes micro-batches by --max-tokens-per-gpu: pass --use-dynamic-batch-size (as slime)")
    if args.balance_by_flops:
        args.balance_data = True  # slime: FLOPs balance the ranks too
    if args.use_dynamic_batch_size and args.log_probs_max_tokens_per_gpu is None:
        args.log_probs_max_tokens_per_gpu = args.max_tokens_per_gpu  # slime's default
    require(args.log_probs_max_tokens_per_gpu is None or args.use_dynamic_batch_size,
             "--log-probs-max-tokens-per-gpu is the forward-only passes' budget of --use-dynamic-batch-size; "
             "pass that flag too (without it --micro-batch-size sets every pass's micro-batches)")
    require(args.log_probs_max_tokens_per_gpu == args.max_tokens_per_gpu or not args.use_routing_replay,
             "--use-routing-replay replays the old-policy pass's routing micro-batch by micro-batch in training, "
             "so that pass needs the train micro-batches: drop --log-probs-max-tokens-per-gpu")
    for dest in MEGATRON_BACKEND_ONLY:
        require(getattr(args, dest) is None or args.train_backend == "megatron",
                 f"{cli_flag(dest)} is a Megatron-backend feature: it needs --train-backend megatron")
    if args.megatron_config_path is not None:
        from slime.config.megatron_role_config import role_overrides

        try:
            for role in ("actor", "critic") if args.use_critic else ("actor",):
                role_overrides(args, args.megatron_config_path, role)
        except ValueError as exc:
            raise ArgumentError(str(exc)) from None
