"""slime's plugin-hook flags beyond the core rollout / loss hooks: per-sample rollout hooks, reward and train-data
hooks, rollout log hooks, trainer loss hooks, and `--custom-config-path` (a YAML of extra attributes set on args).

Registration only (`add_hook_arguments`); every dotted path here is imported and checked callable at parse time
(`validate_args.HOOK_FLAGS`). Signatures are slime's (docs/reference/slime-flags.md lists them).
"""

from __future__ import annotations

HOOK_PATH_FLAGS = {
    "custom_rollout_log_function_path": "fn(rollout_id, args, samples, extra_metrics, rollout_time) -> bool "
                                        "(True: skip the default rollout log)",
    "custom_eval_rollout_log_function_path": "fn(rollout_id, args, data, extra_metrics) -> bool "
                                             "(True: skip the default eval log)",
    "custom_reward_post_process_path": "fn(args, samples) -> (raw_rewards, rewards): replaces group normalisation",
    "custom_convert_samples_to_train_data_path": "fn(args, samples) -> train-data dict (the keys of "
                                                 "slime.ray.train_data.samples_to_train_data)",
    "rollout_sample_filter_path": "fn(args, groups) -> None: sets Sample.remove_sample on samples not to train on",
    "rollout_all_samples_process_path": "fn(args, all_groups, data_source) -> None: sees every generated group, "
                                        "dropped ones included",
    "custom_tis_function_path": "fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, "
                                "total_lengths, response_lengths) -> (pg_loss, loss_masks, metrics)",
    "custom_pg_loss_reducer_function_path": "fn(total_lengths, response_lengths, loss_masks, "
                                            "calculate_per_token_loss) -> reducer(per-token losses) -> loss",
}


def add_hook_arguments(parser):
    g = parser.add_argument_group("plugin hooks (slime's signatures)")
    g.add_argument("--rollout-sample-hook-path", action="append", default=[], metavar="MODULE.FN",
                   help="[async] fn(args, sample, *, rollout_id=None, evaluation=False) -> Sample | None, run on "
                        "each generated sample before its reward; repeatable (run in order)")
    for dest, signature in HOOK_PATH_FLAGS.items():
        g.add_argument("--" + dest.replace("_", "-"), default=None, metavar="MODULE.FN", help=signature)
    g.add_argument("--custom-config-path", default=None, metavar="YAML",
                   help="YAML mapping of extra attributes set on args after validation (read by plugins)")
