"""The patches megatron-core 0.16.1 needs to train multi-head latent attention (MLA, the DeepSeek-V3 family) on its
local spec, without Transformer Engine. The first two were hard failures when building the model, the third a
silently wrong gradient under tensor parallelism:

1. `multi_latent_attention` imports `megatron.core.extensions.transformer_engine`, which imports without TE and
   leaves `TELinear` a `MagicMock`; the module's `HAVE_TE` then reads True and `MLASelfAttention.__init__` calls
   `isinstance(self.linear_proj, TELinear)`, a TypeError (a mock is no type). Here `HAVE_TE` is set to what it
   means, TE importable. `TELinear` appears only in the FP8 / FP4 branch and the `parallel_mode='duplicated'`
   choice of the down projections, neither of which the local spec takes.
2. On the CPU: MLA builds its own `RotaryEmbedding` / `YarnRotaryEmbedding` without `use_cpu_initialization`, and
   both ask `torch.cuda.current_device()` (in `__init__`; YaRN's `get_emb` moves its frequencies there too). Those
   two modules get cpu_shim.py's torch whose CUDA device is the CPU.
3. Under TP the local spec's down projections are column-parallel (the TE spec's are replicated, `duplicated`):
   `linear_kv_down_proj`'s output is gathered over TP, so each rank holds the whole shared rope key (one head for
   all query heads), but each rank's attention uses it only for its own heads: its gradient there is a partial
   sum, and the gather's backward (a split) hands every rank just its own columns of that partial sum. The
   DeepSeek-V3 tiny model's embedding gradient at TP=2 was off by ~1e-2. The key's RoPE (`apply_rotary_pos_emb` of
   the one-head tensor) is wrapped so that its input passes `copy_to_tensor_model_parallel_region` first: identity
   forward, gradient summed over TP. Recognising the key by its one head needs more than one query head per TP
   rank (family_config.py refuses --tensor-model-parallel-size equal to the number of heads).

The third gap (MLA builds its core attention with `k_channels` / `v_channels`, which the local
`DotProductAttention` does not take) is closed by attention.py's `PackedCoreAttention`, which takes them.
Anything else of MLA that needs TE (fused YaRN RoPE, FP8, latent caching for inference) stays refused:
model.py turns rope fusion off, and family_config.py refuses sequence parallelism with MLA.
"""

from __future__ import annotations

import importlib.util

import torch

_patched_devices: set[str] = set()


def _rope_summing_shared_key_gradients(apply_rotary_pos_emb):
    def apply(t, freqs, config, *args, **kwargs):
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        if tp_size > 1 and t.shape[-2] == 1:  # the shared rope key ([tokens, 1, rope]); queries have > 1 head here
            assert config.num_attention_heads // tp_size > 1, "family_config.py refuses one query head per TP rank"
            t = copy_to_tensor_model_parallel_region(t)
        return apply_rotary_pos_emb(t, freqs, config, *args, **kwargs)

    apply.slime_sums_shared_key_gradients = True
    return apply


def patch_mla_for_local_spec(device: torch.device) -> None:
    """Idempotent; the CPU part only for a process that builds its model on the CPU."""
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
    rope = multi_latent_attention.apply_rotary_pos_emb
    if not getattr(rope, "slime_sums_shared_key_gradients", False):
        multi_latent_attention.apply_rotary_pos_emb = _rope_summing_shared_key_gradients(rope)
    if device.type != "cpu" or "cpu" in _patched_devices:
        return
    from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding

    from slime.backends.megatron_utils.cpu_shim import cpu_device_torch

    rotary_pos_embedding.torch = cpu_device_torch()
    yarn_rotary_pos_embedding.torch = cpu_device_torch()
    _patched_devices.add("cpu")
