"""slime's model, training and algorithm flags beyond the core groups of `arguments.py`: parameter freezing,
data-parallel balancing, extra token budgets, OPSM / OPD options, and Megatron-side switches slime defines itself.

Registration only; `validate_args` checks the combinations and `flag_status` says which cannot apply here.
"""

from __future__ import annotations


def add_training_extra_arguments(parser):
    g = parser.add_argument_group("training (more of slime's)")
    g.add_argument("--model-name", default=None, help="model family for Megatron -> HF weight conversion")
    g.add_argument("--custom-model-provider-path", default=None, metavar="MODULE.FN")
    g.add_argument("--recompute-loss-function", action="store_true")
    g.add_argument("--only-train-params-name-list", nargs="*", default=None, metavar="REGEX")
    g.add_argument("--freeze-params-name-list", nargs="*", default=None, metavar="REGEX")
    g.add_argument("--freeze-indexer", action="store_true")
    g.add_argument("--allgather-cp", action="store_true")
    g.add_argument("--ref-ckpt-step", type=int, default=None)
    g.add_argument("--save-hf", default=None, metavar="PATH_TEMPLATE")
    g.add_argument("--megatron-config-path", default=None)
    g.add_argument("--reset-optimizer-states", action="store_true")
    g.add_argument("--use-stateless-adam", action="store_true")
    g.add_argument("--balance-data", action="store_true",
                   help="split each optimizer step's samples over the data-parallel ranks so that their token "
                        "counts are as even as possible (same number of samples per rank)")
    g.add_argument("--balance-by-flops", action="store_true")
    g.add_argument("--log-probs-max-tokens-per-gpu", type=int, default=None)
    g.add_argument("--data-pad-size-multiplier", type=int, default=128)
    g.add_argument("--loss-mask-type", choices=["qwen", "qwen3", "qwen3_5", "distill_qwen"], default="qwen")
    g.add_argument("--disable-compute-advantages-and-returns", action="store_false",
                   dest="compute_advantages_and_returns")
    g.add_argument("--use-rollout-entropy", action="store_true")
    g.add_argument("--use-opsm", action="store_true")
    g.add_argument("--opsm-delta", type=float, default=1e-4)
    g.add_argument("--opd-type", choices=["sglang", "megatron"], default=None)
    g.add_argument("--opd-teacher-ckpt-step", type=int, default=None)
    g.add_argument("--enable-mtp-training", action="store_true")
    for name in ("forward-layers", "moe-forward-layers"):
        g.add_argument(f"--megatron-deepgemm-{name}", nargs="+", type=int, default=None)
    for name in ("forward-modules", "moe-forward-modules"):
        g.add_argument(f"--megatron-deepgemm-{name}", nargs="+", default=None)
