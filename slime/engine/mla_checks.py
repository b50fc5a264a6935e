"""Start-up refusals of engine settings that multi-head latent attention (the DeepSeek-V3 family's latent KV cache)
does not cover, each naming the setting and what to use instead. Not the model's config parsing
(`models/mla_config.py`)."""

from __future__ import annotations

import torch

from slime.engine.config import Config
from slime.engine.dtypes import FP8_DTYPES
from slime.engine.models import ModelConfig


def check_mla_engine_config(config: Config, model_config: ModelConfig, kv_dtype: torch.dtype) -> None:
    if config.tp_size > 1:
        raise ValueError(f"tp_size={config.tp_size} (--tp-size): the built-in engine runs multi-head latent "
                         f"attention ({model_config.model_type}) at tp_size 1 only; use --tp-size 1, or "
                         "--rollout-backend sglang for a sharded DeepSeek-family engine")
    if kv_dtype in FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} (--kv-cache-dtype): the latent KV cache of "
                         f"multi-head latent attention ({model_config.model_type}) has no fp8 variant; use 'auto'")
