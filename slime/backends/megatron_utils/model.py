"""A megatron-core `GPTModel` built from a Hugging Face config: Qwen2 / Qwen2.5 (QKV bias), Qwen3 (q/k RMSNorm),
Llama 3 (dense), Qwen3-MoE (MoE layers), and the GLM / DeepSeek families of family_config.py (GLM-4, GLM-4.5,
DeepSeek-V3 with multi-head latent attention), which always use the local spec.

Layer spec: Transformer Engine's when TE is importable (its attention core takes packed THD batches), otherwise
megatron-core's local spec with `PackedCoreAttention` in place of the local core (which refuses packed batches)
and norm.py's RMSNorm (which, unlike the local one, allows sequence parallelism).
MoE experts with --moe-grouped-gemm: TE's grouped experts with the TE spec, grouped_experts.py's (torch's grouped_mm;
megatron-core's own needs the grouped_gemm CUDA package) with the local spec; without it megatron-core's
`SequentialMLP` (one MLP per local expert). Token dispatcher: --moe-token-dispatcher-type (alltoall by default;
validate_megatron_args.py refuses the layouts where a type cannot work).
dtype: fp32 on the CPU (bf16 there is ~13x slower); on the GPU bf16 parameters with `--bf16` (the optimizer keeps
fp32 main params), else fp32.

At TP = 1 the last stage returns its final hidden states instead of logits (log_probs.py computes the log-probs
from them in chunks); a critic's last stage returns values (value_head.py). Not the weights: the model is randomly
initialised here; hf_mapping/ fills it from a checkpoint.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from slime.backends.megatron_utils import family_config
from slime.backends.megatron_utils.attention import PackedCoreAttention
from slime.backends.megatron_utils.log_probs import return_hidden_states
from slime.backends.megatron_utils.norm import RMSNorm
from slime.backends.megatron_utils.parallel import parallel_sizes
from slime.backends.megatron_utils.value_head import install_value_head

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen3_moe", *family_config.FAMILIES)
VOCAB_PAD_MULTIPLE = 128  # Megatron's --make-vocab-size-divisible-by default, times the TP size


def transformer_engine_available(device: torch.device, config=None) -> bool:
    """TE's layer spec: on a GPU with TE, for the Qwen / Llama families (the GLM and DeepSeek families' layers are
    built on the local spec everywhere: `config` tells them apart)."""
    if config is not None and getattr(config, "slime_model_type", None) in family_config.FAMILIES:
        return False
    return device.type == "cuda" and importlib.util.find_spec("transformer_engine") is not None


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    multiple = VOCAB_PAD_MULTIPLE * tp_size
    return -(-vocab_size // multiple) * multiple


def transformer_config(args, hf_config, device: torch.device):
    """megatron-core `TransformerConfig` for the HF config and the parallelism flags."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    model_type = hf_config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"--train-backend megatron supports model_type {', '.join(SUPPORTED_MODEL_TYPES)}; "
                         f"{args.hf_checkpoint} is {model_type!r} (use --train-backend fsdp for it)")
    on_gpu = device.type == "cuda"
    use_bf16 = bool(args.bf16) and on_gpu
    dispatcher = args.moe_token_dispatcher_type or "alltoall"  # dense models ignore it
    config_class = TransformerConfig
    if model_type in family_config.FAMILIES:
        architecture = family_config.family_fields(args, hf_config)
        if model_type in family_config.MLA_FAMILIES:
            from megatron.core.transformer.transformer_config import MLATransformerConfig

            config_class = MLATransformerConfig
    else:
        architecture = _qwen_llama_fields(args, hf_config)
    interleaved = args.virtual_pipeline_model_parallel_size is not None
    config = config_class(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **parallel_sizes(args),
        sequence_parallel=args.sequence_parallel,
        # Megatron's defaults for the interleaved schedule: each direction's sends and receives are their own
        # exchange (a batched exchange of both directions pairs them crosswise when the previous and the next
        # stage are one rank, as at PP=2, whose shape messages then mismatch).
        overlap_p2p_comm=interleaved,
        batch_p2p_comm=not interleaved,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        variable_seq_lengths=dispatcher != "allgather",
        # The loss function returns its share of the global loss: the schedules must not divide it again.
        calculate_per_token_loss=True,
        use_cpu_initialization=not on_gpu,
        perform_initialization=True,
        params_dtype=torch.bfloat16 if use_bf16 else torch.float32,
        bf16=use_bf16,
        pipeline_dtype=torch.bfloat16 if use_bf16 else torch.float32,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        deallocate_pipeline_outputs=False,
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
        moe_token_dispatcher_type=dispatcher,
        **architecture,
    )
    config.slime_model_type = model_type  # the layer spec's choices (block_spec)
    # megatron-core refuses allgather with variable lengths: the dispatcher gathers equal token counts from the
    # expert tensor x expert parallel ranks. validate_megatron_args allows it only where those ranks are tensor-
    # parallel peers of one micro-batch; the pipeline's messages still vary in length.
    config.variable_seq_lengths = True
    return config


def _qwen_llama_fields(args, hf_config) -> dict:
    model_type = hf_config.model_type
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    moe = {}
    if model_type == "qwen3_moe":
        moe = dict(
            num_moe_experts=hf_config.num_experts,
            moe_router_topk=hf_config.num_experts_per_tok,
            moe_ffn_hidden_size=hf_config.moe_intermediate_size,
            # Qwen3-MoE: softmax over all experts, top-k, renormalised when norm_topk_prob; Megatron's top-k of
            # the logits then softmax over the k equals the renormalised form.
            moe_router_pre_softmax=not hf_config.norm_topk_prob,
            moe_router_load_balancing_type="none",  # the router losses are router_losses.py's
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=args.moe_grouped_gemm,
            moe_router_dtype=args.moe_router_dtype or "fp32",
        )
        if hf_config.decoder_sparse_step != 1 or hf_config.mlp_only_layers:
            raise ValueError("Qwen3-MoE with dense layers (mlp_only_layers / decoder_sparse_step != 1) is not "
                             "supported by --train-backend megatron")
    return dict(
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=head_dim,
        add_qkv_bias=model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
        qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
        **moe,
    )


def block_spec(config, device: torch.device, vp_stage: int | None):
    """The decoder of this pipeline stage: its layers' spec and the final norm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if transformer_engine_available(device, config):
        return _layer_spec(config, device, moe=bool(config.num_moe_experts))
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    pattern = moe_layer_pattern(config)
    layers = range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage))
    return TransformerBlockSubmodules(layer_specs=[_layer_spec(config, device, moe=bool(pattern[layer]))
                                                   for layer in layers], layer_norm=RMSNorm)


def moe_layer_pattern(config) -> list[int]:
    """Per global decoder layer 1 (MoE) or 0 (dense), from `moe_layer_freq` (megatron-core's rule)."""
    if not config.num_moe_experts:
        return [0] * config.num_layers
    if isinstance(config.moe_layer_freq, int):
        return [int(layer % config.moe_layer_freq == 0) for layer in range(config.num_layers)]
    return list(config.moe_layer_freq)


def _layer_spec(config, device: torch.device, moe: bool | None = None):
    """One layer's spec; `moe`: an MoE layer (default: the model has experts)."""
    moe = bool(config.num_moe_experts) if moe is None else moe
    if transformer_engine_available(device, config):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
            qk_layernorm=config.qk_layernorm)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.spec_utils import ModuleSpec

    from slime.backends.megatron_utils.grouped_experts import GroupedExperts

    if config.num_moe_experts and not hasattr(moe_utils, "te_general_gemm"):
        # megatron-core 0.16.1 without Transformer Engine leaves this name undefined, and the router's gating
        # linear tests it against None: None is the fallback to torch's matmul it intends.
        moe_utils.te_general_gemm = None
    mla = bool(getattr(config, "multi_latent_attention", False))
    if mla:
        from slime.backends.megatron_utils.mla_local_spec import patch_mla_for_local_spec

        patch_mla_for_local_spec(device)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts if moe else None, moe_grouped_gemm=False,
                                    qk_layernorm=config.qk_layernorm, multi_latent_attention=mla,
                                    normalization="RMSNorm")
    if moe and config.moe_grouped_gemm:
        spec.submodules.mlp.submodules.experts = ModuleSpec(module=GroupedExperts)
    spec.submodules.self_attention.submodules.core_attention = PackedCoreAttention
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = RMSNorm  # sequence parallel allowed
    attention = spec.submodules.self_attention.submodules
    if mla:  # the q / kv latents' norms: under sequence parallelism (MoE with TP) each rank normalises its tokens
        attention.q_layernorm = attention.kv_layernorm = RMSNorm
    elif config.qk_layernorm:  # their gradients are summed over TP in any case (grads.py)
        attention.q_layernorm = attention.k_layernorm = RMSNorm
    if config.slime_model_type == "glm4":
        from slime.backends.megatron_utils.sandwich_norm_layer import SandwichNormLayer

        spec.module = SandwichNormLayer
    return spec


def build_model_chunks(args, hf_config, device: torch.device, *, critic: bool = False) -> list:
    """This rank's model chunks: one GPTModel per virtual pipeline stage (megatron's interleaved layout: chunk v of
    pipeline rank p holds the layers of virtual stage v * PP + p), one without virtual stages."""
    num_chunks = args.virtual_pipeline_model_parallel_size
    if num_chunks is None:
        return [build_gpt_model(args, hf_config, device, critic=critic)]
    return [build_gpt_model(args, hf_config, device, vp_stage, critic=critic) for vp_stage in range(num_chunks)]


def build_gpt_model(args, hf_config, device: torch.device, vp_stage: int | None = None, *, critic: bool = False):
    """This pipeline stage's GPTModel on `device` (model chunk `vp_stage` with virtual pipeline stages); a
    `critic`'s last stage ends in the value head (value_head.py) instead of the output layer."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    if args.custom_model_provider_path:
        model = custom_model(args.custom_model_provider_path, pre_process, post_process, vp_stage)
        return _with_head(model, args, critic).to(device)
    config = transformer_config(args, hf_config, device)
    rope = hf_config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default" and hf_config.model_type not in family_config.MLA_FAMILIES:
        raise ValueError(f"rope_parameters {rope} of {args.hf_checkpoint}: --train-backend megatron supports plain "
                         "RoPE only (rope_type 'default'; YaRN for the DeepSeek-V3 family)")
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(config, device, vp_stage),
        vocab_size=padded_vocab_size(hf_config.vocab_size, args.tensor_model_parallel_size),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings) and not critic,
        position_embedding_type="rope",  # multi-head latent attention builds its own (rope or YaRN)
        rotary_base=int(rope["rope_theta"]),
        rotary_percent=family_config.rotary_percent(hf_config),
        vp_stage=vp_stage,
    )
    if config.moe_router_num_groups:
        from slime.backends.megatron_utils.grouped_routing import install_group_limited_topk

        install_group_limited_topk(model)
    return _with_head(model, args, critic).to(device)


def _with_head(model, args, critic: bool):
    if model.post_process and critic:
        install_value_head(model)
    elif model.post_process and args.tensor_model_parallel_size == 1:
        return_hidden_states(model)  # the log-prob head works from hidden states (log_probs.py)
    return model


def custom_model(path: str, pre_process: bool, post_process: bool, vp_stage: int | None):
    """slime's --custom-model-provider-path: fn(pre_process, post_process[, vp_stage]) -> GPTModel, in place of
    the model built from the HF config (its parameter names must be GPTModel's: the HF weights and checkpoints are
    mapped onto them)."""
    import inspect

    from megatron.core.models.gpt import GPTModel

    from slime.utils.misc import load_function

    provider = load_function(path, "--custom-model-provider-path")
    kwargs = {"vp_stage": vp_stage} if "vp_stage" in inspect.signature(provider).parameters else {}
    model = provider(pre_process=pre_process, post_process=post_process, **kwargs)
    if not isinstance(model, GPTModel):
        raise ValueError(f"--custom-model-provider-path {path} returned a {type(model).__name__}; it must return a "
                         "megatron.core GPTModel")
    return model
