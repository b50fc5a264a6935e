"""slime's logging flags: wandb and TensorBoard options and the extra rollout logs (`--log-*`).

Registration only. `slime.utils.metrics.MetricsLogger` reads the wandb / TensorBoard ones; the `--log-*` switches
add metrics to the rollout's (slime.ray.train_data.rollout_log_metrics).
"""

from __future__ import annotations


def add_logging_arguments(parser):
    g = parser.add_argument_group("logging")
    g.add_argument("--output-dir", default=None, help="run folder (default: a fresh folder under ./runs/)")
    g.add_argument("--no-progress", action="store_true", help="hide progress bars")
    g.add_argument("--use-tensorboard", action="store_true")
    g.add_argument("--tb-project-name", default=None, help="TensorBoard folder name under the run folder")
    g.add_argument("--tb-experiment-name", default=None, help="TensorBoard run name under --tb-project-name")
    g.add_argument("--use-wandb", action="store_true")
    g.add_argument("--wandb-mode", choices=["online", "offline", "disabled"], default=None)
    g.add_argument("--wandb-dir", default=None)
    g.add_argument("--wandb-key", default=None, help="wandb API key (prefer the WANDB_API_KEY environment variable)")
    g.add_argument("--wandb-host", default=None)
    g.add_argument("--wandb-team", default=None)
    g.add_argument("--wandb-group", default=None)
    g.add_argument("--wandb-project", default=None)
    g.add_argument("--wandb-run-id", default=None, help="resume this wandb run")
    g.add_argument("--disable-wandb-random-suffix", action="store_false", dest="wandb_random_suffix",
                   help="use --wandb-group as the run name without a random suffix")
    g.add_argument("--wandb-always-use-train-step", action="store_true",
                   help="log every metric against the train step instead of the rollout id")
    g.add_argument("--log-multi-turn", action="store_true", help="log multi-turn statistics of each rollout")
    g.add_argument("--log-passrate", action="store_true", help="log pass@2^k of each rollout's groups")
    g.add_argument("--log-reward-category", default=None, metavar="METADATA_KEY",
                   help="log the mean reward per value of sample.metadata[KEY]")
    g.add_argument("--log-correct-samples", action="store_true",
                   help="log the response lengths of correct (reward > 0) samples separately")
