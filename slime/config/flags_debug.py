"""slime's debug, profiling and CI flags (the debug-rollout / fault-tolerance flags live with their features).

Registration only. Most of these drive Megatron / CUDA tooling that has no counterpart here; `flag_status.INERT`
says which, and a run that sets one is told so once at start-up.
"""

from __future__ import annotations


def add_debug_arguments(parser):
    g = parser.add_argument_group("debug and profiling")
    g.add_argument("--debug-rollout-only", action="store_true")
    g.add_argument("--debug-train-only", action="store_true")
    g.add_argument("--save-debug-rollout-data", default=None)
    g.add_argument("--load-debug-rollout-data", default=None)
    g.add_argument("--check-weight-update-equal", action="store_true")
    g.add_argument("--save-debug-train-data", default=None, metavar="PATH_TEMPLATE",
                   help="save each rollout's train data (template with {rollout_id})")
    g.add_argument("--dump-details", default=None, metavar="DIR",
                   help="= --save-debug-rollout-data DIR/rollout_data/{rollout_id}.pt and --save-debug-train-data "
                        "DIR/train_data/{rollout_id}.pt")
    g.add_argument("--load-forge-rollout-data", default=None)
    g.add_argument("--load-debug-rollout-data-subsample", type=float, default=None)
    g.add_argument("--memory-snapshot-dir", default=".")
    g.add_argument("--memory-snapshot-num-steps", type=int, default=None)
    g.add_argument("--memory-recorder", choices=["torch", "memray"], default="torch")
    g.add_argument("--profile-target", nargs="+", choices=["train_overall", "train_actor", "train_log_probs"],
                   default=["train_overall"])
    g.add_argument("--ci-test", action="store_true")
    g.add_argument("--ci-disable-kl-checker", action="store_true")
    g.add_argument("--ci-train-rollout-logprob-abs-diff-threshold", type=float, default=0.1)
    g.add_argument("--ci-save-grad-norm", default=None)
    g.add_argument("--ci-load-grad-norm", default=None)
