"""The rules of the fully asynchronous flags (slime/config/flags_async.py, docs/guides/fully-async.md); each raises
`ArgumentError` naming the flag and the fix. Derived: `--async-max-concurrent-samples` gets its default (one batch, or
the over-sampling batch when that is larger). Not the admission rule itself (slime/rollout/fully_async/deadlines.py).
"""

from __future__ import annotations

from slime.config.errors import require

DEFAULT_ROLLOUT = "slime.rollout.sglang_rollout.generate_rollout"


def check_fully_async_flags(args) -> None:
    if not args.fully_async:
        require(args.max_weight_staleness is None, "--max-weight-staleness bounds --fully-async training; add "
                                                   "--fully-async (train_async.py) or drop it")
        require(args.async_max_concurrent_samples is None, "--async-max-concurrent-samples needs --fully-async")
        return
    require(not args.colocate, "--fully-async needs engines on their own devices (they never stop generating): drop "
                               "--colocate")
    require(args.rollout_function_path == DEFAULT_ROLLOUT,
            f"--fully-async streams groups through the default rollout's generate_group; --rollout-function-path "
            f"{args.rollout_function_path} replaces the whole rollout. Keep the default and customise with "
            "--custom-generate-function-path / --dynamic-sampling-filter-path")
    require(args.rollout_global_dataset, "--fully-async draws prompts from the global dataset: pass "
                                         "--rollout-global-dataset with --prompt-data")
    require(not (args.debug_rollout_only or args.debug_train_only or args.load_debug_rollout_data),
            "--fully-async runs engines and trainer together; drop --debug-rollout-only / --debug-train-only / "
            "--load-debug-rollout-data")
    require(args.use_tis and not args.use_rollout_logprobs,
            "--fully-async trains tokens of older policies: pass --use-tis (decoupled PPO: the trust region is "
            "anchored on the weights at the step start, recomputed; tokens are reweighted by exp(old - behaviour) "
            "with the engines' log-probs, see --tis-clip / --tis-mode) and drop --use-rollout-logprobs")
    require(not args.rollout_all_samples_process_path,
            "--rollout-all-samples-process-path sees every group of a rollout; a fully async stream has no rollout "
            "boundary: drop it (--rollout-sample-filter-path and --dynamic-sampling-filter-path apply per batch / group)")
    require(not args.keep_old_actor, "--keep-old-actor keeps the last two pushed versions; under --fully-async a batch "
                                     "spans up to --max-weight-staleness + 1 versions: drop it (--use-tis corrects)")
    require(not args.release_train, "--release-train restarts the trainer between steps; --fully-async keeps it "
                                    "running: drop --release-train")
    staleness = args.max_weight_staleness
    if staleness is not None:
        require(staleness >= 0, f"--max-weight-staleness must be >= 0, got {staleness}")
        require(staleness >= args.update_weights_interval - 1,
                f"--max-weight-staleness {staleness} is below what --update-weights-interval "
                f"{args.update_weights_interval} already implies (the engines lag the trainer by up to "
                f"{args.update_weights_interval - 1} versions): raise it to >= {args.update_weights_interval - 1} or "
                "push more often")
    group_size = args.n_samples_per_prompt
    if args.async_max_concurrent_samples is None:
        groups = max(args.rollout_batch_size, args.over_sampling_batch_size or 0)
        args.async_max_concurrent_samples = groups * group_size
    require(args.async_max_concurrent_samples >= group_size,
            f"--async-max-concurrent-samples {args.async_max_concurrent_samples} is below one group "
            f"(--n-samples-per-prompt {group_size}): groups are admitted whole")
    require(args.async_data_buffer_capacity_factor >= 1.0,
            f"--async-data-buffer-capacity-factor {args.async_data_buffer_capacity_factor} must be >= 1 (the buffer "
            "holds at least one batch)")
