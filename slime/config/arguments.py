"""slime's command line: every flag, one small function per group, with slime's names and defaults.

Parsing only; the rules that tie flags together and the derived fields live in `validate_args.py`, so there is
one place to read them. `parse_args(argv)` returns the validated namespace that every piece of slime reads.
"""

from __future__ import annotations

import argparse
import logging

from slime.config.custom_config import apply_custom_config
from slime.config.flag_status import check_flag_status
from slime.config.flags_async import add_fully_async_arguments
from slime.config.flags_debug import add_debug_arguments
from slime.config.flags_engine_access import add_engine_access_arguments
from slime.config.flags_hooks import add_hook_arguments
from slime.config.flags_logging import add_logging_arguments
from slime.config.flags_lora import add_lora_arguments
from slime.config.flags_megatron import add_megatron_arguments, inert_flag_notices
from slime.config.flags_moe import add_moe_arguments
from slime.config.flags_on_policy import add_on_policy_arguments
from slime.config.flags_rollout import add_rollout_extra_arguments
from slime.config.flags_sglang import (
    add_router_arguments,
    add_sglang_arguments,
    closest_flag_error,
    engine_config_from_sglang_flags,
    router_cli_flags,
    type_sglang_values,
)
from slime.config.flags_training import add_training_extra_arguments
from slime.config.flags_weight_sync import add_weight_sync_arguments
from slime.config.validate import ArgumentError, resolve_rollout_backend, validate_args
from slime.utils.engine_access import ensure_admin_key

logger = logging.getLogger(__name__)


def add_cluster_arguments(parser):
    g = parser.add_argument_group("cluster")
    g.add_argument("--actor-num-nodes", type=int, default=1)
    g.add_argument("--actor-num-gpus-per-node", type=int, default=1,
                   help="trainer processes per node (GPUs; CPU processes when there is no GPU)")
    g.add_argument("--rollout-num-gpus", type=int, default=None)
    g.add_argument("--rollout-num-gpus-per-engine", type=int, default=1,
                   help="devices per rollout engine: the built-in engine runs N tensor-parallel ranks (SGLang's "
                        "--tp-size), all on one node; engine i takes devices [i*N, (i+1)*N) of the rollout's")
    g.add_argument("--num-gpus-per-node", type=int, default=8)
    g.add_argument("--colocate", action="store_true")
    g.add_argument("--offload", action="store_true")
    g.add_argument("--offload-train", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--offload-rollout", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--weight-snapshots-on-host", action="store_true",
                   help="keep the reference / OPD teacher weights (and the actor's copy during their log-prob "
                        "passes) in host memory only, even where the GPU has room for them")
    g.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting a local one")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    g.add_argument("--train-backend", choices=["fsdp", "megatron"], default=None,
                   help="fsdp (FSDP2 over the HF model) or megatron (megatron-core: tensor / pipeline / context / "
                        "expert parallel); default: megatron when a Megatron parallelism flag asks for more than "
                        "one way (as in slime's recipes), else fsdp")
    g.add_argument("--rollout-backend", choices=["slime", "sglang"], default=None,
                   help="slime = the built-in engine (default; an engine of --rollout-num-gpus-per-engine N devices "
                        "is N tensor-parallel ranks of it); sglang = real SGLang servers (must be installed)")


def add_model_arguments(parser):
    g = parser.add_argument_group("model")
    g.add_argument("--hf-checkpoint", required=False, default=None)
    g.add_argument("--ref-load", default=None)
    g.add_argument("--load", default=None,
                   help="resume from this checkpoint: a --save folder (its `latest`) or one of its rollout_<id> "
                        "folders; anything else, or an incomplete checkpoint, is an error")
    g.add_argument("--load-if-exists", action="store_true",
                   help="with --load: start fresh when the folder is absent or empty (e.g. --load DIR --save DIR for "
                        "a run that resumes itself); an incomplete checkpoint there is still an error")
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--recompute-activations", action="store_true")
    g.add_argument("--compile-model", action="store_true",
                   help="torch.compile each decoder layer's forward (dynamic shapes; fuses the elementwise work "
                        "around the matmuls; the first steps pay the compile time)")
    g.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                   help="FSDP2: free each decoder layer's gathered bf16 parameters after its forward and gather them "
                        "again for the backward (default). --no-reshard-after-forward keeps them: one gather and "
                        "fp32 -> bf16 cast fewer per layer and micro-batch, for a bf16 copy of the model's "
                        "parameters (unsharded) held in GPU memory through each pass")
    g.add_argument("--log-probs-chunk-size", type=int, default=-1,
                   help="tokens per chunk of the log-prob head; <= 0: its default (4096 with the fused GPU kernels, "
                        "1024 otherwise)")


def add_data_arguments(parser):
    g = parser.add_argument_group("data")
    g.add_argument("--prompt-data", default=None)
    g.add_argument("--input-key", default="input")
    g.add_argument("--label-key", default=None,
                   help="column of the label; a row without it is an error unless the reward reads no labels")
    g.add_argument("--allow-missing-labels", action="store_true",
                   help="rows may lack the --label-key column (their label is None)")
    g.add_argument("--metadata-key", default="metadata")
    g.add_argument("--tool-key", default="tools")
    g.add_argument("--apply-chat-template", action="store_true")
    g.add_argument("--rollout-shuffle", action="store_true")
    g.add_argument("--rollout-seed", type=int, default=42)
    g.add_argument("--num-rollout", type=int, default=None)
    g.add_argument("--num-epoch", type=int, default=None)
    g.add_argument("--start-rollout-id", type=int, default=None)
    g.add_argument("--data-source-path", default="slime.rollout.data_source.RolloutDataSourceWithBuffer")


def add_rollout_arguments(parser):
    g = parser.add_argument_group("rollout")
    g.add_argument("--rollout-function-path", default="slime.rollout.sglang_rollout.generate_rollout")
    g.add_argument("--rollout-batch-size", type=int, default=None)
    g.add_argument("--n-samples-per-prompt", type=int, default=1)
    g.add_argument("--rollout-temperature", type=float, default=1.0)
    g.add_argument("--rollout-top-p", type=float, default=1.0)
    g.add_argument("--rollout-top-k", type=int, default=-1)
    g.add_argument("--rollout-max-response-len", type=int, default=None,
                   help="max new tokens per sample (required by the default rollout)")
    g.add_argument("--rollout-max-prompt-len", type=int, default=None)
    g.add_argument("--rollout-max-context-len", type=int, default=None)
    g.add_argument("--rollout-stop", nargs="*", default=None)
    g.add_argument("--rollout-stop-token-ids", nargs="*", type=int, default=None)
    g.add_argument("--rollout-skip-special-tokens", action="store_true")
    g.add_argument("--custom-generate-function-path", default=None)
    g.add_argument("--over-sampling-batch-size", type=int, default=None)
    g.add_argument("--dynamic-sampling-filter-path", default=None)
    g.add_argument("--buffer-filter-path", default=None)
    g.add_argument("--partial-rollout", action="store_true")
    g.add_argument("--mask-offpolicy-in-partial-rollout", action="store_true")
    g.add_argument("--rollout-data-postprocess-path", default=None)
    g.add_argument("--keep-old-actor", action="store_true")


def add_fault_tolerance_arguments(parser):
    g = parser.add_argument_group("fault tolerance (docs/guides/fault-tolerance.md)")
    g.add_argument("--use-fault-tolerance", action="store_true",
                   help="health-check the engines during rollouts; a dead or hung engine leaves the router at once, "
                        "its requests go to the others, and it restarts with the trainer's current weights")
    g.add_argument("--rollout-health-check-interval", type=float, default=30.0,
                   help="seconds between two /health_generate heartbeats of an engine")
    g.add_argument("--rollout-health-check-timeout", type=float, default=30.0,
                   help="seconds a heartbeat may take before the engine counts as hung")
    g.add_argument("--rollout-health-check-first-wait", type=float, default=0.0,
                   help="seconds before the first heartbeat after the engines resume (warm-up)")
    g.add_argument("--max-engine-restarts", type=int, default=10,
                   help="engine restarts a run may use in all; one more failure ends the run with an error")


def add_multi_turn_arguments(parser):
    g = parser.add_argument_group("multi-turn (slime.rollout.multi_turn)")
    g.add_argument("--max-turns", type=int, default=1,
                   help="assistant turns per sample; > 1 makes slime.rollout.multi_turn.generate the generate function")
    g.add_argument("--tool-functions-path", action="append", default=None, metavar="MODULE.FN",
                   help="a tool (sync or async function; schema from its tool_schema attribute or its signature) or "
                        "a list of tools, by dotted path; repeatable")
    g.add_argument("--tool-call-parser", default="qwen",
                   help="how tool calls are written: qwen/hermes (<tool_call>{json}</tool_call>), tool_tag "
                        "(<tool>{json}</tool>), xml_tags (<NAME>text</NAME>), or a parser by dotted path")
    g.add_argument("--tool-timeout", type=float, default=30.0, help="seconds one tool call may take")
    g.add_argument("--max-tool-response-chars", type=int, default=8192, help="longer tool answers are cut")
    g.add_argument("--tool-response-template", default=None,
                   help="xml_tags format: how a tool's answer is written into the turn (default "
                        "'\\n\\n<information>{result}</information>\\n\\n')")
    g.add_argument("--env-path", default=None,
                   help="make_env(args) -> an environment with reset(sample) and step(text) (slime.rollout.environment)")


def add_reward_arguments(parser):
    g = parser.add_argument_group("reward")
    g.add_argument("--rm-type", default=None)
    g.add_argument("--rm-url", default=None)
    g.add_argument("--custom-rm-path", default=None)
    g.add_argument("--reward-key", default=None)
    g.add_argument("--eval-reward-key", default=None)
    g.add_argument("--group-rm", action="store_true")
    g.add_argument("--reward-timeout", type=float, default=30.0,
                   help="seconds a reward function may take before the sample gets the failure reward")
    g.add_argument("--reward-failure-value", type=float, default=0.0,
                   help="reward given to a sample whose reward function raised or timed out")


def add_training_arguments(parser):
    g = parser.add_argument_group("training")
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--num-steps-per-rollout", type=int, default=None)
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--use-dynamic-batch-size", action="store_true")
    g.add_argument("--max-tokens-per-gpu", type=int, default=None)
    g.add_argument("--lr", type=float, default=1e-6)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default=None,
                   help="default: constant (fsdp); linear (megatron, Megatron's)")
    g.add_argument("--weight-decay", type=float, default=None, help="default: 0 (fsdp); 0.01 (megatron, Megatron's)")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=None,
                   help="default: 0.98 (fsdp); 0.999 (megatron, Megatron's)")
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--custom-init-path", "--custom-megatron-init-path", dest="custom_init_path", default=None)
    g.add_argument("--custom-before-log-prob-hook-path", "--custom-megatron-before-log-prob-hook-path",
                   dest="custom_before_log_prob_hook_path", default=None)
    g.add_argument("--custom-before-train-step-hook-path", "--custom-megatron-before-train-step-hook-path",
                   dest="custom_before_train_step_hook_path", default=None)


def add_algorithm_arguments(parser):
    g = parser.add_argument_group("algorithm")
    g.add_argument("--advantage-estimator", default="grpo",
                   choices=["grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo", "rloo"])
    g.add_argument("--loss-type", choices=["policy_loss", "sft_loss", "custom_loss"], default="policy_loss")
    g.add_argument("--custom-loss-function-path", default=None)
    g.add_argument("--custom-advantage-function-path", default=None)
    g.add_argument("--eps-clip", type=float, default=0.2)
    g.add_argument("--eps-clip-high", type=float, default=None)
    g.add_argument("--eps-clip-c", type=float, default=None)
    g.add_argument("--value-clip", type=float, default=0.2, help="ppo critic: clip of V - V_old in the value loss")
    g.add_argument("--critic-load", default=None,
                   help="ppo critic: initial weights (HF folder; default --hf-checkpoint), value head starts at 0")
    g.add_argument("--critic-lr", type=float, default=None, help="ppo critic learning rate (default --lr)")
    g.add_argument("--kl-coef", type=float, default=0.0)
    g.add_argument("--use-kl-loss", action="store_true")
    g.add_argument("--kl-loss-coef", type=float, default=0.0)
    g.add_argument("--kl-loss-type", choices=["k1", "k2", "k3", "low_var_kl"], default="k1")
    g.add_argument("--use-unbiased-kl", action="store_true")
    g.add_argument("--ref-update-interval", type=int, default=None)
    g.add_argument("--entropy-coef", type=float, default=0.0)
    g.add_argument("--gamma", type=float, default=1.0)
    g.add_argument("--lambd", type=float, default=1.0)
    g.add_argument("--normalize-advantages", action="store_true")
    g.add_argument("--disable-grpo-std-normalization", action="store_false", dest="grpo_std_normalization")
    g.add_argument("--disable-rewards-normalization", action="store_false", dest="rewards_normalization")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="divide the loss by the global batch's token count (= --loss-agg-mode token_mean)")
    g.add_argument("--loss-agg-mode", choices=["sample_mean", "token_mean", "constant"], default=None,
                   help="loss aggregation over the global batch: sample_mean (slime default: mean over samples of "
                        "per-sample token means), token_mean (same as --calculate-per-token-loss), constant "
                        "(Dr.GRPO: token sum / (samples x --loss-agg-constant); use with "
                        "--disable-grpo-std-normalization)")
    g.add_argument("--loss-agg-constant", type=float, default=None,
                   help="the Dr.GRPO normaliser per sample for --loss-agg-mode constant "
                        "(default --rollout-max-response-len)")
    g.add_argument("--use-rollout-logprobs", action="store_true")
    g.add_argument("--use-tis", action="store_true")
    g.add_argument("--tis-clip", type=float, default=2.0)
    g.add_argument("--tis-clip-low", type=float, default=0.0)
    g.add_argument("--tis-mode", choices=["truncate", "mask_token", "mask_sequence"], default="truncate",
                   help="--use-tis weights w = exp(old - rollout): truncate (clamp to [--tis-clip-low, --tis-clip]), "
                        "mask_token (zero tokens outside it), mask_sequence (zero whole sequences with any token "
                        "outside it)")
    g.add_argument("--get-mismatch-metrics", action="store_true")
    g.add_argument("--num-critic-only-steps", type=int, default=0)
    g.add_argument("--use-opd", action="store_true")
    g.add_argument("--opd-kl-coef", type=float, default=1.0)
    g.add_argument("--opd-teacher-load", default=None)


def add_eval_arguments(parser):
    g = parser.add_argument_group("eval")
    g.add_argument("--eval-prompt-data", nargs="+", default=None, metavar="NAME PATH")
    g.add_argument("--eval-interval", type=int, default=None)
    g.add_argument("--eval-function-path", default=None)
    g.add_argument("--n-samples-per-eval-prompt", type=int, default=1)
    g.add_argument("--eval-temperature", type=float, default=None)
    g.add_argument("--eval-top-p", type=float, default=None)
    g.add_argument("--eval-top-k", type=int, default=None)
    g.add_argument("--eval-max-response-len", type=int, default=None)
    g.add_argument("--eval-input-key", default=None)
    g.add_argument("--eval-label-key", default=None)
    g.add_argument("--skip-eval-before-train", action="store_true")


ARGUMENT_GROUPS = [
    add_cluster_arguments,
    add_model_arguments,
    add_data_arguments,
    add_rollout_arguments,
    add_fault_tolerance_arguments,
    add_multi_turn_arguments,
    add_reward_arguments,
    add_training_arguments,
    add_algorithm_arguments,
    add_moe_arguments,
    add_lora_arguments,
    add_on_policy_arguments,
    add_eval_arguments,
    add_fully_async_arguments,
    add_logging_arguments,
    add_debug_arguments,
    add_engine_access_arguments,
    add_weight_sync_arguments,
    add_hook_arguments,
    add_training_extra_arguments,
    add_rollout_extra_arguments,
    add_sglang_arguments,
    add_router_arguments,
    add_megatron_arguments,
]


def build_parser(add_custom_arguments=None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="train.py", description="slime: RL post-training for LLMs", allow_abbrev=False, exit_on_error=False
    )
    for add_group in ARGUMENT_GROUPS:
        add_group(parser)
    if add_custom_arguments is not None:
        add_custom_arguments(parser)
    return parser


def parse_args(argv: list[str] | None = None, add_custom_arguments=None) -> argparse.Namespace:
    """Parse and validate; raises ArgumentError (a ValueError) naming the flag on any mistake."""
    parser = build_parser(add_custom_arguments)
    try:
        args, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:  # a bad value: the flag and the value, as a ValueError
        raise ArgumentError(str(exc)) from None
    if unknown:
        raise ArgumentError(closest_flag_error(next(t for t in unknown if t.startswith("-")) if any(
            t.startswith("-") for t in unknown) else unknown[0], parser))
    defaults = {action.dest: action.default for action in parser._actions}
    check_flag_status(args, defaults)
    type_sglang_values(args)
    resolve_rollout_backend(args)
    args.engine_config, unused_sglang_flags = engine_config_from_sglang_flags(args)
    if unused_sglang_flags and args.rollout_backend == "slime":
        logger.warning("the built-in engine has no use for these SGLang flags (they reach SGLang with "
                       "--rollout-backend sglang): %s", ", ".join(unused_sglang_flags))
    args.router_flags = router_cli_flags(args, defaults)
    validate_args(args)
    ensure_admin_key(args)
    apply_custom_config(args)
    for notice in inert_flag_notices(args, parser):
        logger.warning(notice)
    return args
