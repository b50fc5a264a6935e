"""The two patches megatron-core 0.16.1 needs to build multi-head latent attention (MLA, the DeepSeek-V3 family) on
its local spec, without Transformer Engine. Each was a hard failure when building the model:

1. `multi_latent_attention` imports `megatron.core.extensions.transformer_engine`, which imports without TE and
   leaves `TELinear` a `MagicMock`; the module's `HAVE_TE` then reads True and `MLASelfAttention.__init__` calls
   `isinstance(self.linear_proj, TELinear)`, a TypeError (a mock is no type). Here `HAVE_TE` is set to what it
   means, TE importable. `TELinear` appears only in the FP8 / FP4 branch and the `parallel_mode='duplicated'`
   choice of the down projections, neither of which the local spec takes.
2. On the CPU: MLA builds its own `RotaryEmbedding` / `YarnRotaryEmbedding` without `use_cpu_initialization`, and
   both ask `torch.cuda.current_device()` (in `__init__`; YaRN's `get_emb` moves its frequencies there too). Those
   two modules get cpu_shim.py's torch whose CUDA device is the CPU.

The third gap (MLA builds its core attention with `k_channels` / `v_channels`, which the local
`DotProductAttention` does not take) is closed by attention.py's `PackedCoreAttention`, which takes them.
Anything else of MLA that needs TE (fused YaRN RoPE, FP8, latent caching for inference) stays refused:
model.py turns rope fusion off, and family_config.py refuses sequence parallelism with MLA.
"""

from __future__ import annotations

import importlib.util

import torch

_patched_devices: set[str] = set()


def patch_mla_for_local_spec(device: torch.device) -> None:
    """Idempotent; the CPU part only for a process that builds its model on the CPU."""
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
    if device.type != "cpu" or "cpu" in _patched_devices:
        return
    from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding

    from slime.backends.megatron_utils.cpu_shim import cpu_device_torch

    rotary_pos_embedding.torch = cpu_device_torch()
    yarn_rotary_pos_embedding.torch = cpu_device_torch()
    _patched_devices.add("cpu")
