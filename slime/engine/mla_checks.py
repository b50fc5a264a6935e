"""Start-up refusals of engine settings that multi-head latent attention (the DeepSeek-V3 family's latent KV cache)
does not cover, each naming the setting and what to use instead. Not the model's config parsing
(`models/mla_config.py`)."""

from __future__ import annotations

from slime.engine.config import Config
from slime.engine.dtypes import FP8_DTYPES, KV_CACHE_TORCH_DTYPES
from slime.engine.models import ModelConfig


def check_mla_engine_config(config: Config, model_config: ModelConfig) -> None:
    """Called by the engine before it starts any rank or allocates anything."""
    if model_config.mla is None:
        return
    if config.tp_size > 1:
        raise ValueError(f"tp_size={config.tp_size} (--tp-size): the built-in engine runs multi-head latent "
                         f"attention ({model_config.model_type}) at tp_size 1 only; use --tp-size 1, or "
                         "--rollout-backend sglang for a sharded DeepSeek-family engine")
    if KV_CACHE_TORCH_DTYPES[config.kv_cache_dtype] in FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} (--kv-cache-dtype): the latent KV cache of "
                         f"multi-head latent attention ({model_config.model_type}) has no fp8 variant; use 'auto'")
