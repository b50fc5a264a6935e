"""Multi-head latent attention (MLA) facts of a DeepSeek-V3-family config.json (DeepSeek V3 / V3.1 / R1, Kimi K2,
Moonlight, GLM-4.7-Flash's `glm4_moe_lite`): the low-rank sizes, the rope slice and DeepSeek's YaRN parameters, and
the softmax scale they give.

Plain JSON, no torch. Not the attention module (`layers/mla_attention.py`) or the rotary tables
(`layers/mla_rotary.py`); the decoder's other fields stay in `model_config.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# transformers' q_a_layernorm / kv_a_layernorm are built without the config's eps (DeepseekV3RMSNorm's default).
LATENT_NORM_EPS = 1e-6


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """DeepSeek-YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """DeepSeek-YaRN's parameters (transformers' names; None where the config leaves them to the defaults)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int | None  # None: a plain q_proj (Moonlight); else q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # DeepSeek's checkpoints lay the rope dims out as (x0, x1), (x2, x3), ... pairs
    attention_bias: bool  # on q_a_proj, kv_a_proj_with_mqa and o_proj
    yarn: YarnScaling | None = None  # rope_type "yarn"; None for plain RoPE

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token and layer in the latent KV cache: the normed kv latent and the rotated shared k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (transformers' yarn_apply_mscale)."""
        scale = self.qk_head_dim**-0.5
        if self.yarn is not None and self.yarn.mscale_all_dim:
            scale *= yarn_mscale(self.yarn.factor, self.yarn.mscale_all_dim) ** 2
        return scale


def parse_mla_config(raw: dict, rope: dict, rope_type: str) -> MLAConfig:
    """The MLA fields of a config.json; `rope` is its merged rope_parameters / rope_scaling, of type `rope_type`."""
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"unsupported rope type {rope_type!r} for multi-head latent attention; supported: default, "
                         "yarn")
    for field in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not raw.get(field):
            raise ValueError(f"config of a {raw['model_type']} model needs {field} (multi-head latent attention)")
    if raw["qk_rope_head_dim"] % 2:
        raise ValueError(f"qk_rope_head_dim={raw['qk_rope_head_dim']} must be even")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("unsupported config: rope partial_rotary_factor with multi-head latent attention")
    yarn = None
    if rope_type == "yarn":
        original = rope.get("original_max_position_embeddings")
        if not original:
            raise ValueError("rope type 'yarn' needs original_max_position_embeddings")
        optional = {key: float(rope[key]) for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                                                        "attention_factor") if rope.get(key) is not None}
        yarn = YarnScaling(factor=float(rope.get("factor") or raw["max_position_embeddings"] / original),
                           original_max_position_embeddings=int(original),
                           truncate=rope.get("truncate", True) is not False, **optional)
    return MLAConfig(
        q_lora_rank=raw.get("q_lora_rank") or None,
        kv_lora_rank=raw["kv_lora_rank"],
        qk_nope_head_dim=raw["qk_nope_head_dim"],
        qk_rope_head_dim=raw["qk_rope_head_dim"],
        v_head_dim=raw["v_head_dim"],
        rope_interleave=raw.get("rope_interleave", True),
        attention_bias=bool(raw.get("attention_bias", False)),
        yarn=yarn,
    )
