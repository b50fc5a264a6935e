"""Architecture facts read from a checkpoint's config.json, and the list of supported architectures.

Reads the JSON directly (no transformers import) so an unsupported checkpoint fails fast with a ValueError
listing what is supported. Knows nothing about modules or weights (see `decoder.py`, `weight_loader.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from slime.engine.models.fp8_blocks import fp8_weight_block_size
from slime.engine.models.glm_config import GLM_MODEL_TYPES, glm_fields, sigmoid_moe_fields
from slime.engine.models.mla_config import MLAConfig, parse_mla_config
from slime.utils.moe_config import moe_layer_indices

# model_type -> (HF architecture class name, has qkv bias by default, has per-head q/k RMSNorm)
SUPPORTED_MODEL_TYPES = {
    "qwen2": ("Qwen2ForCausalLM", True, False),
    "qwen3": ("Qwen3ForCausalLM", False, True),
    "llama": ("LlamaForCausalLM", False, False),
    "qwen3_moe": ("Qwen3MoeForCausalLM", False, True),
    "qwen2_moe": ("Qwen2MoeForCausalLM", True, False),
    # GLM-4-0414 / GLM-Z1 and GLM-4.5 / 4.6 / 4.7: bias and q/k norm come from the config (glm_config.py)
    "glm4": ("Glm4ForCausalLM", True, False),
    "glm4_moe": ("Glm4MoeForCausalLM", False, False),
    # multi-head latent attention (mla_config.py) and GLM-4.5's router; Kimi K2 ships DeepseekV3ForCausalLM under
    # its own model_type
    "deepseek_v3": ("DeepseekV3ForCausalLM", False, False),
    "kimi_k2": ("DeepseekV3ForCausalLM", False, False),
    "glm4_moe_lite": ("Glm4MoeLiteForCausalLM", False, False),
    # vision-language (vl_model.py): the language model is Qwen2 / Qwen3's, from config.json's text_config
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", True, False),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", False, True),
}
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")  # softmax routers; the GLM-4.5 family's are in glm_config.py
MLA_MODEL_TYPES = ("deepseek_v3", "kimi_k2", "glm4_moe_lite")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None  # llama3 parameters, or None for plain RoPE
    qkv_bias: bool
    o_proj_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    torch_dtype: str | None
    eos_token_ids: list[int]
    # Mixture of experts (Qwen3-MoE, Qwen2-MoE); zeros and () for dense models.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert; 0 = none
    moe_layers: tuple[int, ...] = ()  # indices of the layers whose feed-forward is sparse
    # GLM families (glm_config.py); the defaults are Qwen / Llama's.
    rotary_dim: int = 0  # dims of a head that rotate (the first ones); 0 = all of head_dim
    rope_interleaved: bool = False  # rotary pairs (2i, 2i + 1) (GLM-4) instead of rotate-half
    sandwich_norms: bool = False  # GLM-4: RMSNorm on the attention's and the MLP's outputs before each residual add
    router: str = "softmax"  # "sigmoid": biased, group-limited sigmoid top-k (GLM-4.5, layers/grouped_router.py)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_nextn_predict_layers: int = 0  # multi-token-prediction layers in the checkpoint (skipped on load)
    mla: MLAConfig | None = None  # multi-head latent attention (DeepSeek-V3 family); None: the q/k/v decoder
    # Vision-language (Qwen2.5-VL / Qwen3-VL): M-RoPE's frequency bands per axis (t, h, w), interleaved (Qwen3-VL)
    # or in sections (Qwen2.5-VL), and the checkpoint's vision_config (None: a text model)
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False
    vision_config: dict | None = None

    @property
    def is_vision_language(self) -> bool:
        return self.vision_config is not None

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    def same_architecture(self, other: ModelConfig) -> bool:
        """Equal up to fields that do not change parameter shapes or the forward pass's structure (the engine's
        check before loading another checkpoint's weights)."""
        return replace(self, torch_dtype=None, eos_token_ids=[]) == replace(other, torch_dtype=None, eos_token_ids=[])


def supported_description() -> str:
    return ", ".join(f"{t} ({arch})" for t, (arch, _, _) in SUPPORTED_MODEL_TYPES.items())


def load_model_config(model_path: str | Path) -> ModelConfig:
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model: no config.json in {str(model_path)!r}; expected a Hugging Face checkpoint directory")
    return parse_model_config(json.loads(config_file.read_text()))


def _vl_text_fields(raw: dict) -> tuple[dict, dict]:
    """A Qwen2.5-VL / Qwen3-VL config.json as the text fields of its language model (top-level fields such as
    tie_word_embeddings and eos_token_id kept), and the fields of its M-RoPE and vision tower."""
    text = {**{k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}, **raw["text_config"]}
    text["model_type"], text["architectures"] = raw["model_type"], raw.get("architectures")
    text["tie_word_embeddings"] = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = tuple(rope.pop("mrope_section", ()) or ())
    interleaved = bool(rope.pop("mrope_interleaved", raw["model_type"] == "qwen3_vl"))
    rope.pop("type", None)
    if sum(section) * 2 != text.get("head_dim", text["hidden_size"] // text["num_attention_heads"]):
        raise ValueError(f"config.json text_config mrope_section {list(section)} must sum to head_dim / 2")
    text["rope_parameters"], text["rope_scaling"] = rope, None
    return text, dict(mrope_section=section, mrope_interleaved=interleaved, vision_config=dict(raw["vision_config"]))


def parse_model_config(raw: dict) -> ModelConfig:
    vl_fields = {}
    if raw.get("model_type") in ("qwen2_5_vl", "qwen3_vl"):
        raw, vl_fields = _vl_text_fields(raw)
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {supported_description()}")
    architecture, default_bias, qk_norm = SUPPORTED_MODEL_TYPES[model_type]
    architectures = raw.get("architectures") or [architecture]
    if architectures != [architecture]:
        raise ValueError(f"unsupported architectures {architectures}; supported: {supported_description()}")
    if raw.get("use_sliding_window"):
        raise ValueError("unsupported config: use_sliding_window=true (the engine implements full attention only)")
    if raw.get("mlp_bias"):
        raise ValueError("unsupported config: mlp_bias=true")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r}; only silu is implemented")
    fp8_weight_block_size(raw)  # refuses a quantization the loader cannot dequantize
    rope = dict(raw.get("rope_parameters") or {})
    if raw.get("rope_scaling"):
        rope.update(raw["rope_scaling"])
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    mla = parse_mla_config(raw, rope, rope_type) if model_type in MLA_MODEL_TYPES else None
    if mla is None and rope_type not in ("default", "llama3"):
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, llama3")
    num_heads = raw["num_attention_heads"]
    eos = raw.get("eos_token_id")
    fields = dict(
        model_type=model_type,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=mla.qk_head_dim if mla else raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
        rope_scaling=rope if rope_type == "llama3" else None,
        qkv_bias=raw.get("qkv_bias", default_bias) or raw.get("attention_bias", False),
        o_proj_bias=not default_bias and raw.get("attention_bias", False),
        qk_norm=qk_norm,
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        **(_moe_fields(raw) if model_type in MOE_MODEL_TYPES else {}),
        mla=mla,
    )
    if model_type in GLM_MODEL_TYPES:
        fields.update(glm_fields(raw, rope))
    if mla is not None:  # the DeepSeek-V3 family routes with GLM-4.5's router (its dense layers: first_k_dense_replace)
        fields.update(sigmoid_moe_fields(raw))
    return ModelConfig(**fields, **vl_fields)


def _moe_fields(raw: dict) -> dict:
    """The MoE fields of a Qwen3-MoE / Qwen2-MoE config.json (transformers 5 writes num_local_experts)."""
    num_experts = raw.get("num_experts", raw.get("num_local_experts"))
    if not num_experts or not raw.get("num_experts_per_tok"):
        raise ValueError(f"config of a {raw['model_type']} model needs num_experts and num_experts_per_tok")
    if raw["num_experts_per_tok"] > num_experts:
        raise ValueError(f"num_experts_per_tok={raw['num_experts_per_tok']} exceeds num_experts={num_experts}")
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=raw["num_experts_per_tok"],
        moe_intermediate_size=raw["moe_intermediate_size"],
        norm_topk_prob=raw.get("norm_topk_prob", False),
        shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 0) or 0,
        moe_layers=moe_layer_indices(raw),
    )
