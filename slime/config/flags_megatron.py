"""Megatron-LM's command-line flags, as slime's recipes pass them: names, dests and defaults of megatron-core
0.16.1's `megatron/training/arguments.py` (plus three switches of slime's patched Megatron).

`add_megatron_arguments(parser)` registers them; `slime.config.arguments` calls it once. PARALLELISM and TRAINING
flags are applied (their rules live in `slime.config.validate_megatron`). MODEL_SHAPE flags describe the
architecture, which both backends build from `--hf-checkpoint`'s config.json: those config.json states too are
checked against it. Every other flag carries the reason it changes nothing here (`inert_because`: the INERT and MOE
groups, the architecture switches), and a run that sets one is told once at start-up (`inert_flag_notices`).
Megatron's MoE shape, router and load-balancing flags are slime/config/flags_moe.py's, not this module's; the
Megatron flags the project already had under the same name (`--micro-batch-size`, `--lr`, `--clip-grad`, ...) stay
in `slime.config.arguments`. docs/guides/megatron-parallelism.md is the table of all of them.

This module parses nothing itself and imports nothing of megatron-core: the FSDP backend uses the same flags.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field


@dataclass(frozen=True)
class MegatronFlag:
    """One Megatron flag: its option string, argparse keywords (Megatron's dest and default), and for an inert
    flag the reason it has no effect here."""

    option: str
    kwargs: dict = field(default_factory=dict)
    inert_because: str | None = None

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest", self.option[2:].replace("-", "_"))


def _switch(option: str, inert_because: str | None = None, **kwargs) -> MegatronFlag:
    return MegatronFlag(option, {"action": "store_true", **kwargs}, inert_because)


PARALLELISM = [
    MegatronFlag("--tensor-model-parallel-size", {"type": int, "default": 1}),
    MegatronFlag("--pipeline-model-parallel-size", {"type": int, "default": 1}),
    MegatronFlag("--num-layers-per-virtual-pipeline-stage", {"type": int, "default": None}),
    MegatronFlag("--num-virtual-stages-per-pipeline-rank", {"type": int, "default": None}),
    MegatronFlag("--context-parallel-size", {"type": int, "default": 1}),
    MegatronFlag("--expert-model-parallel-size", {"type": int, "default": 1}),
    MegatronFlag("--expert-tensor-parallel-size", {"type": int, "default": None,
                                                  "help": "default: --tensor-model-parallel-size"}),
    _switch("--sequence-parallel", help="needs --tensor-model-parallel-size > 1 (Megatron turns it off at 1)"),
]

TRAINING = [
    _switch("--deterministic-mode", help="the same seed and flags give the same rollouts and training run after "
            "run: batch-invariant engine, sampling seeds from (--rollout-seed, rollout id, sample index, position), "
            "deterministic torch kernels (rules: slime/config/flags_on_policy.py)"),
    MegatronFlag("--recompute-granularity", {"choices": ["full", "selective"], "default": None}),
    MegatronFlag("--recompute-method", {"choices": ["uniform", "block"], "default": None}),
    MegatronFlag("--recompute-num-layers", {"type": int, "default": None}),
    _switch("--use-distributed-optimizer",
            help="Megatron backend: always on (as in slime); FSDP2 shards the optimizer state anyway"),
    _switch("--bf16", help="bf16 compute with fp32 master weights on the GPU (default there); fp32 on the CPU"),
    _switch("--fp16", help="not supported: use bf16"),
    MegatronFlag("--optimizer", {"choices": ["adam"], "default": "adam",
                                 "help": "adam = AdamW (decoupled weight decay), Megatron's and the FSDP trainer's"}),
    MegatronFlag("--lr-warmup-fraction", {"type": float, "default": None,
                                          "help": "warmup steps as a fraction of the run's optimizer steps "
                                                  "(sets --lr-warmup-iters; needs --num-rollout)"}),
    MegatronFlag("--attention-dropout", {"type": float, "default": None,
                                         "help": "only 0 (Megatron's default is 0.1; the trainers here run the "
                                                 "HF model's attention without dropout)"}),
    MegatronFlag("--hidden-dropout", {"type": float, "default": None, "help": "only 0, as --attention-dropout"}),
    MegatronFlag("--ckpt-step", {"type": int, "default": None,
                                 "help": "--load reads this step's checkpoint of the save folder (Megatron-LM's "
                                         "iter_%%07d, or rollout_<step>) instead of the latest"}),
]

_FROM_HF_CONFIG = "default: from --hf-checkpoint's config.json, which the value must match"
_ARCHITECTURE = "the backends build the architecture from config.json's model_type, which this flag describes"
MODEL_SHAPE = [
    MegatronFlag("--num-layers", {"type": int, "default": None, "help": _FROM_HF_CONFIG}),
    MegatronFlag("--hidden-size", {"type": int, "default": None, "help": _FROM_HF_CONFIG}),
    MegatronFlag("--ffn-hidden-size", {"type": int, "default": None, "help": _FROM_HF_CONFIG}),
    MegatronFlag("--num-attention-heads", {"type": int, "default": None, "help": _FROM_HF_CONFIG}),
    MegatronFlag("--num-query-groups", {"type": int, "default": None, "help": _FROM_HF_CONFIG}),
    MegatronFlag("--kv-channels", {"type": int, "default": None, "help": _FROM_HF_CONFIG}),
    MegatronFlag("--vocab-size", {"type": int, "default": None, "help": "at least config.json's vocab_size"}),
    MegatronFlag("--rotary-base", {"type": float, "default": None, "help": _FROM_HF_CONFIG}),
    MegatronFlag("--rotary-percent", {"type": float, "default": None, "help": _FROM_HF_CONFIG}),
    MegatronFlag("--norm-epsilon", {"type": float, "default": None, "dest": "layernorm_epsilon",
                                    "help": _FROM_HF_CONFIG}),
    MegatronFlag("--max-position-embeddings", {"type": int, "default": None, "help": _FROM_HF_CONFIG}),
    MegatronFlag("--normalization", {"choices": ["LayerNorm", "RMSNorm"], "default": None, "help": _FROM_HF_CONFIG}),
    _switch("--untie-embeddings-and-output-weights", default=None, help=_FROM_HF_CONFIG),
    _switch("--swiglu", help="checked against config.json's hidden_act"),
    _switch("--add-qkv-bias", help="checked against config.json's attention_bias where it has one"),
    # Architecture switches config.json does not state as such: the backends build the model from its model_type.
    _switch("--group-query-attention", _ARCHITECTURE),
    _switch("--disable-bias-linear", _ARCHITECTURE, dest="add_bias_linear", action="store_false"),
    _switch("--qk-layernorm", _ARCHITECTURE),
    _switch("--use-rotary-position-embeddings", _ARCHITECTURE),
    MegatronFlag("--position-embedding-type",
                 {"choices": ["learned_absolute", "rope", "mrope", "relative", "none"], "default": None},
                 _ARCHITECTURE),
    _switch("--no-position-embedding", _ARCHITECTURE, dest="add_position_embedding", action="store_false"),
    _switch("--rotary-interleaved", _ARCHITECTURE),
    _switch("--post-self-attn-layernorm", _ARCHITECTURE),
    _switch("--post-mlp-layernorm", _ARCHITECTURE),
    _switch("--apply-layernorm-1p", _ARCHITECTURE, dest="layernorm_zero_centered_gamma"),
    _switch("--attention-output-gate", _ARCHITECTURE),
    _switch("--use-gated-attention", _ARCHITECTURE),
    _switch("--use-rope-scaling", help="checked against config.json's rope_scaling (llama3 type)"),
    MegatronFlag("--rotary-scaling-factor", {"type": float, "default": 1.0,
                                             "help": "with --use-rope-scaling: config.json's rope_scaling factor"}),
    MegatronFlag("--mscale", {"type": float, "default": 1.0}, _ARCHITECTURE),
    MegatronFlag("--mscale-all-dim", {"type": float, "default": 0.0}, _ARCHITECTURE),
    _switch("--multi-latent-attention", _ARCHITECTURE),
    MegatronFlag("--q-lora-rank", {"type": int, "default": None}, _ARCHITECTURE),
    MegatronFlag("--kv-lora-rank", {"type": int, "default": 32}, _ARCHITECTURE),
    MegatronFlag("--qk-head-dim", {"type": int, "default": 128}, _ARCHITECTURE),
    MegatronFlag("--qk-pos-emb-head-dim", {"type": int, "default": 64}, _ARCHITECTURE),
    MegatronFlag("--v-head-dim", {"type": int, "default": 128}, _ARCHITECTURE),
]

# Megatron's MoE flags that slime/config/flags_moe.py (the MoE trainer's flags) does not define: --num-experts,
# --moe-router-topk, --moe-ffn-hidden-size, --moe-layer-freq, --moe-aux-loss-coeff, ... are that module's. A name
# it takes as well stays its own (add_megatron_arguments skips it).
_ROUTING_FROM_HF = "routing is built from config.json (the engine routes the same way)"
_NO_EXPERT_BIAS = "no expert-bias load balancing in the trainers here"
MOE = [
    _switch("--moe-router-pre-softmax", _ROUTING_FROM_HF),
    MegatronFlag("--moe-router-topk-scaling-factor", {"type": float, "default": None}, _ROUTING_FROM_HF),
    MegatronFlag("--moe-router-num-groups", {"type": int, "default": None}, _ROUTING_FROM_HF),
    MegatronFlag("--moe-router-group-topk", {"type": int, "default": None}, _ROUTING_FROM_HF),
    _switch("--moe-shared-expert-gate", _ROUTING_FROM_HF),
    _switch("--moe-router-enable-expert-bias", _NO_EXPERT_BIAS),
    MegatronFlag("--moe-router-bias-update-rate", {"type": float, "default": 0.001}, _NO_EXPERT_BIAS),
    MegatronFlag("--moe-token-drop-policy", {"choices": ["probs", "position"], "default": "probs"},
                 "no token dropping: every routed token reaches its experts"),
    _switch("--moe-enable-deepep", "DeepEP dispatch kernels are not used here"),
]

_KERNELS = "kernel choice: the trainers here pick their own kernels, varlen flash attention or SDPA with fp32 softmax"
_OPTIMIZER_PLACEMENT = ("optimizer state placement on the GPU; use --offload-train to move the training state "
                        "to host memory while the engines generate")
INERT = [
    _switch("--accumulate-allreduce-grads-in-fp32", "gradients are reduced in fp32 already"),
    _switch("--attention-softmax-in-fp32", "attention softmax is computed in fp32 already"),
    MegatronFlag("--attention-backend", {"choices": ["flash", "fused", "unfused", "local", "auto"], "default": "auto"},
                 _KERNELS),
    _switch("--no-masked-softmax-fusion", _KERNELS, dest="masked_softmax_fusion", action="store_false"),
    _switch("--no-rope-fusion", _KERNELS, dest="apply_rope_fusion", action="store_false"),
    _switch("--no-gradient-accumulation-fusion", _KERNELS, dest="gradient_accumulation_fusion",
            action="store_false"),
    _switch("--optimizer-cpu-offload", _OPTIMIZER_PLACEMENT),
    _switch("--overlap-cpu-optimizer-d2h-h2d", _OPTIMIZER_PLACEMENT),
    _switch("--use-precision-aware-optimizer", _OPTIMIZER_PLACEMENT),
    MegatronFlag("--spec", {"nargs": "*", "default": None},
                 "the layer spec is the backend's own, chosen from config.json's model_type"),
    MegatronFlag("--make-vocab-size-divisible-by", {"type": int, "default": 128},
                 "vocabulary padding is internal to the Megatron model; the HF-named weights keep the HF vocab"),
    MegatronFlag("--seq-length", {"type": int, "default": None},
                 "batches are packed variable-length sequences (slime's --max-tokens-per-gpu bounds them)"),
    MegatronFlag("--decoder-first-pipeline-num-layers", {"type": int, "default": None},
                 "the Megatron backend splits the layers evenly over the pipeline stages"),
    MegatronFlag("--decoder-last-pipeline-num-layers", {"type": int, "default": None},
                 "the Megatron backend splits the layers evenly over the pipeline stages"),
    _switch("--no-check-for-nan-in-loss-and-grad",
            "a non-finite gradient norm skips the optimizer step with a warning; there is no check to turn off",
            dest="check_for_nan_in_loss_and_grad", action="store_false"),
    _switch("--enable-experimental", "Megatron's experimental code paths are not used here"),
    _switch("--no-load-optim", "--load resumes the optimizer state with the weights", default=None),
    _switch("--no-load-rng", "--load resumes the random state with the weights", default=None),
    _switch("--finetune", "--load resumes a run; start a new one from an HF folder with --hf-checkpoint"),
    # Megatron flags whose defaults slime's arguments.py resets (slime's values here)
    MegatronFlag("--padded-vocab-size", {"type": int, "default": None},
                 "vocabulary padding is internal to the Megatron model; the HF-named weights keep the HF vocab"),
    MegatronFlag("--distributed-backend", {"choices": ["nccl", "gloo"], "default": "nccl"},
                 "the trainers use NCCL between GPUs and gloo on the CPU"),
    MegatronFlag("--distributed-timeout-minutes", {"type": int, "default": 10},
                 "the trainers' process groups time out after 30 minutes"),
    _switch("--async-save", "checkpoints are written before the next rollout, atomically"),
    _switch("--record-memory-history", "no CUDA memory-history recording here"),
    MegatronFlag("--mtp-num-layers", {"type": int, "default": None},
                 "no multi-token-prediction layers: the model is the HF causal LM"),
    MegatronFlag("--mtp-loss-scaling-factor", {"type": float, "default": 0.2},
                 "no multi-token-prediction layers: the model is the HF causal LM"),
]

MEGATRON_FLAGS = PARALLELISM + TRAINING + MODEL_SHAPE + MOE + INERT


def _inert_help(flag: MegatronFlag) -> str:
    return "no effect here: " + flag.inert_because


def add_megatron_arguments(parser: argparse.ArgumentParser) -> None:
    groups = [("megatron: parallelism", PARALLELISM), ("megatron: training", TRAINING),
              ("megatron: model shape (checked against --hf-checkpoint)", MODEL_SHAPE),
              ("megatron: MoE", MOE), ("megatron: accepted, no effect here", INERT)]
    for title, flags in groups:
        group = parser.add_argument_group(title)
        for flag in flags:
            kwargs = dict(flag.kwargs)
            if flag.inert_because is not None:
                kwargs["help"] = _inert_help(flag)
            try:
                group.add_argument(flag.option, **kwargs)
            except argparse.ArgumentError:
                if flag not in MOE:
                    raise
                # the MoE trainer's flags (registered earlier) give this name a meaning; their definition stands


def _default(flag: MegatronFlag):
    action = flag.kwargs.get("action")
    if action == "store_false":
        return True
    return flag.kwargs.get("default", False if action == "store_true" else None)


def inert_flag_notices(args, parser: argparse.ArgumentParser) -> list[str]:
    """One line per reason, naming the inert flags this run set away from their defaults; a flag whose name another
    group took over (its help is not ours) is that group's business."""
    set_flags: dict[str, list[str]] = {}
    for flag in MEGATRON_FLAGS:
        if flag.inert_because is None:
            continue
        action = parser._option_string_actions[flag.option]
        if action.help == _inert_help(flag) and getattr(args, flag.dest) != _default(flag):
            set_flags.setdefault(flag.inert_because, []).append(flag.option)
    return [f"{', '.join(options)}: no effect here ({reason})" for reason, options in set_flags.items()]
