"""The rules of Megatron's flags (`slime.config.flags_megatron`) and the fields derived from them.

`validate_args` calls `validate_megatron_args` once the cluster is resolved: which training backend runs
(`train_backend`), the parallel layout (`data_parallel_size`, `expert_tensor_parallel_size`,
`virtual_pipeline_model_parallel_size`, `sequence_parallel`), recompute, precision (`bf16`, dropout), the chosen
backend's optimizer defaults, and the model-shape flags against --hf-checkpoint's config.json (resolving
`untie_embeddings_and_output_weights` from it), the token dispatcher types that can run in the layout.
`validate_megatron_batches` runs once the batch sizes are known: Megatron's micro-batch rules (the interleaved
schedule's too) and --lr-warmup-fraction. Each rule follows Megatron's own validation where it has one, raising
`ArgumentError` naming the flag. The MoE flags' own rules are slime/config/flags_moe.py's.

No megatron-core import here, so slime's recipes parse on any machine; `require_train_backend` is the start-up
check (train.py / train_async.py) that the chosen backend can be imported and run what the flags ask.
"""

from __future__ import annotations

import importlib.util
import logging

from slime.config.errors import ArgumentError, cli_flag, require
from slime.config.flags_megatron import MEGATRON_FLAGS
from slime.config.validate_families import check_mla_flags, is_mla
from slime.utils.hf_config import hf_text_config

logger = logging.getLogger(__name__)

MEGATRON_BACKEND_MODULE = "slime.backends.megatron_utils.backend"
PARALLEL_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                  "expert_model_parallel_size", "expert_tensor_parallel_size")
VIRTUAL_STAGES = ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank")
# Optimizer flags whose default differs between the backends: the project's FSDP trainer's, and Megatron's.
OPTIMIZER_DEFAULTS = {
    "fsdp": {"adam_beta2": 0.98, "weight_decay": 0.0, "lr_decay_style": "constant"},
    "megatron": {"adam_beta2": 0.999, "weight_decay": 0.01, "lr_decay_style": "linear"},
}
# Megatron flag -> config.json key (looked up at the top level, then in rope_parameters), and its value there
# when the key is absent.
MODEL_FLAG_TO_HF = {
    "num_layers": ("num_hidden_layers", None),
    "hidden_size": ("hidden_size", None),
    "ffn_hidden_size": ("intermediate_size", None),
    "num_attention_heads": ("num_attention_heads", None),
    "num_query_groups": ("num_key_value_heads", None),
    "kv_channels": ("head_dim", None),
    "layernorm_epsilon": ("rms_norm_eps", None),
    "rotary_base": ("rope_theta", None),
    "rotary_percent": ("partial_rotary_factor", 1.0),
    "max_position_embeddings": ("max_position_embeddings", None),
}
OPTION_BY_DEST = {flag.dest: flag.option for flag in MEGATRON_FLAGS}
EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def _hf_value(config: dict, key: str, absent):
    if key in config:
        return config[key]
    return (config.get("rope_parameters") or {}).get(key, absent)


def _num_experts(config: dict) -> int:
    return next((config[key] for key in EXPERT_COUNT_KEYS if config.get(key)), 0)


def megatron_parallelism_set(args) -> list[str]:
    """The Megatron parallelism flags of this run that only the Megatron backend can honour (the expert tensor
    size once it is resolved to the tensor size is not one of them)."""
    sizes = [dest for dest in PARALLEL_SIZES if (getattr(args, dest) or 1) > 1]
    if args.expert_tensor_parallel_size == args.tensor_model_parallel_size and "tensor_model_parallel_size" in sizes:
        sizes.remove("expert_tensor_parallel_size")
    asked = [f"{cli_flag(dest)} {getattr(args, dest)}" for dest in sizes]
    asked += [f"{cli_flag(dest)} {getattr(args, dest)}" for dest in VIRTUAL_STAGES if getattr(args, dest) is not None]
    return asked


def _resolve_backend(args) -> None:
    megatron_only = megatron_parallelism_set(args)
    if args.train_backend is None:
        args.train_backend = "megatron" if megatron_only else "fsdp"
        if megatron_only:
            logger.warning("--train-backend megatron (chosen for %s)", ", ".join(megatron_only))
    require(args.train_backend == "megatron" or not megatron_only,
             f"{megatron_only[0] if megatron_only else ''} needs --train-backend megatron (FSDP2 is data parallel "
             "only); drop the flag or pass --train-backend megatron")
    for dest, value in OPTIMIZER_DEFAULTS[args.train_backend].items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)


def _check_model_shape(args, config: dict) -> None:
    """Model-shape flags (slime's scripts/models/*.sh) must agree with the HF config they are run against."""
    if not config:
        return
    for dest, (hf_key, absent) in MODEL_FLAG_TO_HF.items():
        value = getattr(args, dest)
        if value is None or (dest == "kv_channels" and is_mla(config)):  # MLA: Megatron's kv_channels is no HF field
            continue
        actual = _hf_value(config, hf_key, absent)
        if hf_key == "head_dim" and actual is None and "num_attention_heads" in config:
            actual = config["hidden_size"] // config["num_attention_heads"]
        if hf_key == "num_key_value_heads" and actual is None:
            actual = config.get("num_attention_heads")
        require(actual is not None and float(actual) == float(value),
                 f"{OPTION_BY_DEST[dest]} {value} does not match "
                 f"{hf_key}={actual} in {args.hf_checkpoint}/config.json; fix the model preset or the checkpoint")
    if args.vocab_size is not None and "vocab_size" in config:
        require(args.vocab_size >= config["vocab_size"],
                 f"--vocab-size {args.vocab_size} is smaller than the checkpoint's vocab_size {config['vocab_size']}")
    tied = config.get("tie_word_embeddings", True)
    if args.untie_embeddings_and_output_weights is not None:
        require(tied != args.untie_embeddings_and_output_weights,
                 f"--untie-embeddings-and-output-weights disagrees with tie_word_embeddings={tied} in the HF config")
    args.untie_embeddings_and_output_weights = not tied
    require(not args.swiglu or config.get("hidden_act", "silu") in ("silu", "swiglu"),
             f"--swiglu disagrees with hidden_act={config.get('hidden_act')} in the HF config")
    require(not args.add_qkv_bias or is_mla(config) or config.get("attention_bias", True),  # MLA has no qkv
             "--add-qkv-bias disagrees with attention_bias=false in the HF config")
    check_mla_flags(args, config, require)
    if args.use_rope_scaling:
        scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
        kind, factor = scaling.get("rope_type", scaling.get("type")), scaling.get("factor")
        require(kind == "llama3" and factor is not None and float(factor) == args.rotary_scaling_factor,
                 f"--use-rope-scaling --rotary-scaling-factor {args.rotary_scaling_factor} disagrees with "
                 f"rope_scaling type {kind!r} factor {factor} in the HF config")
    require(args.normalization in (None, "RMSNorm") or "rms_norm_eps" not in config,
             f"--normalization {args.normalization}: the HF config's model uses RMSNorm (rms_norm_eps)")


def _resolve_layout(args, config: dict) -> None:
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    require(args.world_size % (tp * pp * cp) == 0,
             f"{args.world_size} trainer processes (--actor-num-nodes x --actor-num-gpus-per-node) are not "
             f"divisible by --tensor-model-parallel-size x --pipeline-model-parallel-size x --context-parallel-size "
             f"({tp} x {pp} x {cp})")
    args.data_parallel_size = args.world_size // (tp * pp * cp)
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    require(args.world_size % (etp * ep * pp) == 0,
             f"{args.world_size} trainer processes are not divisible by --expert-tensor-parallel-size x "
             f"--expert-model-parallel-size x --pipeline-model-parallel-size ({etp} x {ep} x {pp})")
    num_experts = _num_experts(config)
    require(ep == 1 or not config or num_experts > 0,
             f"--expert-model-parallel-size {ep} needs an MoE model; {args.hf_checkpoint} has no experts "
             f"({' / '.join(EXPERT_COUNT_KEYS)} in config.json)")
    require(num_experts % ep == 0,
             f"the model's {num_experts} experts are not divisible by --expert-model-parallel-size {ep}")
    heads = args.num_attention_heads or config.get("num_attention_heads")
    groups = args.num_query_groups or config.get("num_key_value_heads") or heads
    require(heads is None or heads % tp == 0,
             f"the model's {heads} attention heads are not divisible by --tensor-model-parallel-size {tp}")
    require(groups is None or groups % tp == 0 or tp % groups == 0,
             f"the model's {groups} key/value heads (query groups) must be a multiple or a divisor of "
             f"--tensor-model-parallel-size {tp}")
    if args.sequence_parallel and tp == 1:
        logger.warning("--sequence-parallel has no effect with --tensor-model-parallel-size 1 (Megatron turns it "
                       "off too)")
        args.sequence_parallel = False
    require(not (num_experts and tp > 1 and args.train_backend == "megatron" and not args.sequence_parallel),
             f"--tensor-model-parallel-size {tp} on an MoE model needs --sequence-parallel (megatron-core trains MoE "
             "layers under tensor parallelism only with it)")
    replay = [flag for flag, on in (("--use-routing-replay", args.use_routing_replay),
                                    ("--use-rollout-routing-replay", args.use_rollout_routing_replay)) if on]
    require(cp == 1 or not replay,
             f"{replay[0] if replay else ''} with --context-parallel-size {cp}: the routing records are not split "
             "over context-parallel ranks; use --context-parallel-size 1 or drop the routing replay flag")
    require(not (args.sequence_parallel and args.moe_router_load_balancing_type == "seq_aux_loss"
                  and args.moe_aux_loss_coeff > 0),
             "--moe-router-load-balancing-type seq_aux_loss with --sequence-parallel: each tensor-parallel rank "
             "routes a slice of the packed row, not whole samples; use aux_loss")
    _resolve_pipeline(args, args.num_layers or config.get("num_hidden_layers"))


def _check_moe_kernels(args, config: dict) -> None:
    """--moe-token-dispatcher-type on the Megatron backend: the types megatron-core can run on packed batches of
    uneven lengths here (flex, which slime's large-MoE recipes pass, is refused at start-up: unbuilt_megatron_features)."""
    if args.train_backend != "megatron" or not _num_experts(config):
        return
    dispatcher = args.moe_token_dispatcher_type
    tp, ep, etp = (args.tensor_model_parallel_size, args.expert_model_parallel_size,
                   args.expert_tensor_parallel_size)
    require(dispatcher != "allgather" or tp % (ep * etp) == 0,
             f"--moe-token-dispatcher-type allgather gathers an equal number of tokens from each of the "
             f"{etp * ep} ranks of --expert-tensor-parallel-size x --expert-model-parallel-size ({etp} x {ep}), "
             "but those ranks train different packed micro-batches (of different lengths) unless they are "
             f"tensor-parallel peers (the product divides --tensor-model-parallel-size {tp}); use "
             "--moe-token-dispatcher-type alltoall")


def _resolve_pipeline(args, num_layers: int | None) -> None:
    pp = args.pipeline_model_parallel_size
    uneven = [cli_flag(d) for d in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
              if getattr(args, d) is not None]
    require(pp > 1 or not uneven, f"{' and '.join(uneven)} need --pipeline-model-parallel-size > 1")
    virtual = [dest for dest in VIRTUAL_STAGES if getattr(args, dest) is not None]
    require(len(virtual) <= 1, "give one of --num-layers-per-virtual-pipeline-stage and "
                                "--num-virtual-stages-per-pipeline-rank, not both")
    require(pp > 1 or not virtual, f"{cli_flag(virtual[0]) if virtual else ''} (virtual pipeline stages) needs "
                                    "--pipeline-model-parallel-size > 1")
    args.virtual_pipeline_model_parallel_size = None
    if num_layers is None:
        return
    # Megatron's rule: the stages other than an uneven first / last one share the remaining layers evenly
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    even_layers, even_stages = num_layers - (first or 0) - (last or 0), pp - (first is not None) - (last is not None)
    require(even_layers >= 0 and (even_layers % even_stages == 0 if even_stages else even_layers == 0),
             f"the model's {num_layers} layers are not divisible by --pipeline-model-parallel-size {pp}"
             + (f" (besides {' and '.join(uneven)}: {even_layers} layers over {even_stages} stages)" if uneven else ""))
    layers_per_stage = even_layers // even_stages if even_stages else num_layers // pp
    if args.num_layers_per_virtual_pipeline_stage is not None:
        require(layers_per_stage % args.num_layers_per_virtual_pipeline_stage == 0,
                 f"{layers_per_stage} layers per pipeline stage are not divisible by "
                 f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage}")
        virtual_stages = layers_per_stage // args.num_layers_per_virtual_pipeline_stage
    else:
        virtual_stages = args.num_virtual_stages_per_pipeline_rank or 1
        require(layers_per_stage % virtual_stages == 0,
                 f"{layers_per_stage} layers per pipeline stage are not divisible by "
                 f"--num-virtual-stages-per-pipeline-rank {virtual_stages}")
    args.virtual_pipeline_model_parallel_size = virtual_stages if virtual_stages > 1 else None


def _resolve_recompute(args, num_layers: int | None) -> None:
    granularity, method, count = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    require(granularity is not None or (method is None and count is None),
             "--recompute-method / --recompute-num-layers need --recompute-granularity full")
    if args.train_backend == "fsdp":
        require(granularity in (None, "full") and method in (None, "uniform") and count in (None, 1),
                 "the FSDP trainer recomputes whole decoder layers: use --recompute-granularity full "
                 "--recompute-method uniform --recompute-num-layers 1 (or --recompute-activations), or "
                 "--train-backend megatron")
        args.recompute_activations = args.recompute_activations or granularity == "full"
        return
    if args.recompute_activations:  # Megatron's --recompute-activations means selective recompute
        require(granularity in (None, "selective"),
                 f"--recompute-activations (selective recompute) contradicts --recompute-granularity {granularity}")
        args.recompute_granularity = granularity = "selective"
    if granularity == "selective":
        require(method is None and count is None,
                 "--recompute-granularity selective takes no --recompute-method / --recompute-num-layers")
    elif granularity == "full":
        require(method is not None and count is not None,
                 "--recompute-granularity full needs --recompute-method (uniform or block) and --recompute-num-layers")
        layers_per_stage = num_layers // args.pipeline_model_parallel_size if num_layers else count
        require(count <= layers_per_stage,
                 f"--recompute-num-layers {count} is more than the {layers_per_stage} layers per pipeline stage")


def _resolve_precision(args) -> None:
    require(not args.fp16, "--fp16 is not supported; bf16 is used on the GPU (fp32 on the CPU)")
    if args.bf16 and args.device == "cpu":
        logger.warning("--bf16 has no effect on the CPU: the trainer runs fp32 there")
    args.bf16 = args.device != "cpu"  # with --device auto the trainer's own device decides (model.py)
    if args.train_backend == "megatron":
        args.use_distributed_optimizer = True  # as slime: always Megatron's distributed optimizer
    for dest in ("attention_dropout", "hidden_dropout"):
        require(getattr(args, dest) in (None, 0.0),
                 f"{cli_flag(dest)} {getattr(args, dest)}: the trainers here run without dropout; pass 0 or drop it")
        setattr(args, dest, 0.0)


def validate_megatron_args(args) -> None:
    config = hf_text_config(args)
    _resolve_backend(args)
    require(args.save_hf is None or args.train_backend == "megatron" or args.lora_rank > 0,
             "--save-hf: the FSDP backend's --save folders are Hugging Face checkpoints already (rollout_<id>/); "
             "drop it, or train with --train-backend megatron (torch_dist checkpoints) (with --lora-rank > 0 it "
             "writes the merged model)")
    require(not args.compile_model or args.train_backend == "fsdp",
             "--compile-model compiles the FSDP trainer's decoder layers; the Megatron backend has no compiled path: "
             "drop the flag, or train with --train-backend fsdp")
    _check_model_shape(args, config)
    _resolve_layout(args, config)
    _check_moe_kernels(args, config)
    _resolve_recompute(args, args.num_layers or config.get("num_hidden_layers"))
    _resolve_precision(args)


def validate_megatron_batches(args) -> None:
    if args.train_backend == "megatron" and not args.use_dynamic_batch_size:
        per_step = args.micro_batch_size * args.data_parallel_size
        require(args.global_batch_size % per_step == 0,
                 f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
                 f"{args.micro_batch_size} x {args.data_parallel_size} data-parallel ranks (Megatron's rule)")
    if args.train_backend == "megatron" and args.virtual_pipeline_model_parallel_size:
        _check_interleaved_micro_batches(args)
    if args.lr_warmup_fraction is None:
        return
    require(args.lr_warmup_iters == 0, "give one of --lr-warmup-fraction and --lr-warmup-iters, not both")
    if args.num_rollout is None:
        logger.warning("--lr-warmup-fraction has no effect without --num-rollout (the run's length in optimizer "
                       "steps is not known before the data loads); use --lr-warmup-iters")
        return
    args.lr_warmup_iters = round(args.lr_warmup_fraction * args.num_rollout * args.num_steps_per_rollout)


def _check_interleaved_micro_batches(args) -> None:
    """megatron's interleaved schedule runs a step's micro-batches in groups of the pipeline size: their number must
    be a multiple of it. Fixed-size micro-batches: Megatron's rule on the flags. Dynamic ones (packed by tokens)
    are split until their number is one (slime/backends/schedule.py), which needs a multiple of it in samples."""
    pp, dp = args.pipeline_model_parallel_size, args.data_parallel_size
    given = next(cli_flag(dest) for dest in VIRTUAL_STAGES if getattr(args, dest) is not None)
    samples = args.global_batch_size // dp
    if args.use_dynamic_batch_size:
        require(samples % pp == 0,
                 f"{given} (virtual pipeline stages) with --use-dynamic-batch-size: --global-batch-size "
                 f"{args.global_batch_size} over {dp} data-parallel ranks is {samples} samples per rank and step, "
                 f"not a multiple of --pipeline-model-parallel-size {pp} (megatron's interleaved schedule runs the "
                 "micro-batches in groups of the pipeline size); change --global-batch-size")
        return
    num_micro_batches = samples // args.micro_batch_size
    require(num_micro_batches % pp == 0,
             f"{given} (virtual pipeline stages): --global-batch-size {args.global_batch_size} / (--micro-batch-size "
             f"{args.micro_batch_size} x {dp} data-parallel ranks) = {num_micro_batches} micro-batches per step, not a "
             f"multiple of --pipeline-model-parallel-size {pp} (megatron's interleaved schedule runs them in groups of "
             "the pipeline size); change --global-batch-size or --micro-batch-size")


def unbuilt_megatron_features(args) -> list[str]:
    """What this run asks of the Megatron backend that it does not do (yet, or on this device): each entry names
    the flag and how to run without it."""
    unbuilt = []
    if args.context_parallel_size > 1 and _num_experts(hf_text_config(args)):
        unbuilt.append(f"--context-parallel-size {args.context_parallel_size} on an MoE model: the router losses "
                       "and routing records are per sample, not split over context-parallel ranks; use "
                       "--context-parallel-size 1 (or a dense model)")
    if args.moe_grouped_gemm and args.expert_tensor_parallel_size > 1 and not _transformer_engine_runs(args):
        unbuilt.append(f"--moe-grouped-gemm with --expert-tensor-parallel-size {args.expert_tensor_parallel_size}: "
                       "without Transformer Engine the grouped experts hold whole experts on each rank; pass "
                       "--expert-tensor-parallel-size 1 (or drop --moe-grouped-gemm)")
    uneven = [cli_flag(d) for d in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
              if getattr(args, d) is not None]
    if uneven:
        unbuilt.append(f"{' and '.join(uneven)}: the Megatron backend builds pipeline stages of equal layer counts "
                       "only; drop the flag (with a layer count divisible by --pipeline-model-parallel-size)")
    if args.moe_token_dispatcher_type == "flex" and _num_experts(hf_text_config(args)):
        unbuilt.append("--moe-token-dispatcher-type flex runs megatron-core's flex dispatcher on DeepEP kernels, which "
                       "the Megatron backend does not use; use alltoall")
    if args.sequence_parallel and args.device != "cuda":
        unbuilt.append("--sequence-parallel runs on GPUs only with --train-backend megatron (megatron-core's "
                       "sequence-parallel collectives allocate on CUDA); drop it for a CPU run")
    return unbuilt


def _transformer_engine_runs(args) -> bool:
    """The Megatron backend builds Transformer Engine's layer spec (megatron_utils/model.py's rule: on a GPU, with
    TE installed; with --device auto the trainer's device decides, and TE installs only where there are GPUs)."""
    return args.device != "cpu" and importlib.util.find_spec("transformer_engine") is not None


def require_train_backend(args) -> None:
    """At start-up (train.py / train_async.py, before Ray starts): the chosen training backend imports
    (megatron-core installed, the backend module present) and can run what the flags ask on this device. Not part
    of parsing, which checks Megatron's own rules: slime's stock recipes (context parallelism for GLM4, sequence
    parallelism for Qwen3-4B) must parse on any machine, the CPU machines included."""
    if args.train_backend != "megatron":
        return
    chosen_for = megatron_parallelism_set(args)
    fallback = "use --train-backend fsdp" + (f" without {', '.join(chosen_for)}" if chosen_for else "")
    try:
        has_megatron_core = importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        has_megatron_core = False
    if not has_megatron_core:
        raise ArgumentError("--train-backend megatron needs megatron-core: pip install megatron-core==0.16.1 "
                            f"(scripts/setup.sh installs it), or {fallback}")
    try:
        has_backend = importlib.util.find_spec(MEGATRON_BACKEND_MODULE) is not None
    except ModuleNotFoundError:
        has_backend = False
    if not has_backend:
        raise ArgumentError(f"--train-backend megatron: this slime has no Megatron training backend (module "
                            f"{MEGATRON_BACKEND_MODULE} not found); {fallback}")
    unbuilt = unbuilt_megatron_features(args)
    if unbuilt:
        raise ArgumentError("; ".join(unbuilt))
