"""Which models `--true-on-policy-mode` covers, decided from the checkpoint's config.json (the engine's
`ModelConfig`) for the engine and both trainers: a covered model gets its `DecoderSpec`, anything else is refused at
start-up by name with the reason (never served or trained on an approximate path). The family table is
slime/utils/true_on_policy_families.py (the flag checks read it too)."""

from __future__ import annotations

import torch

from slime.engine.models.model_config import ModelConfig
from slime.engine.true_on_policy.tile_decoder import DecoderSpec
from slime.utils.true_on_policy_families import FIX, family_refusal


def decoder_spec(config: ModelConfig) -> DecoderSpec:
    """The covered model's spec; ValueError naming the model family (or config field) otherwise."""
    refusal = family_refusal(config.model_type)
    if refusal is not None:
        raise ValueError(refusal)
    name = f"--true-on-policy-mode: model_type {config.model_type!r}"
    if config.rope_scaling is not None:
        raise ValueError(f"{name} with rope_scaling (llama3 RoPE scaling) is not covered: the batch-invariant decoder "
                         f"implements plain RoPE; {FIX}")
    if config.shared_expert_intermediate_size:
        raise ValueError(f"{name} with shared_expert_intermediate_size (a shared expert) is not covered; {FIX}")
    if config.o_proj_bias:
        raise ValueError(f"{name} with attention_bias (a bias on o_proj) is not covered; {FIX}")
    return DecoderSpec(num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                       head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
                       qk_norm=config.qk_norm)


def pin_cpu_threads(device: torch.device) -> None:
    """On the CPU, the mode runs torch single-threaded in the engine and in the trainer: a kernel's split of a
    reduction over threads could then never differ between the two processes, and the tiles' small ops skip the
    thread pool (on a loaded 2-core machine its barriers cost ~10 ms per op: the trainer's tile forward took 34 s
    with 2 threads, 1.6 s with 1)."""
    if torch.device(device).type == "cpu":
        torch.set_num_threads(1)
