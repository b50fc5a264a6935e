"""A rank's Megatron parameter names <-> the whole model's: a pipeline stage numbers its layers from 0 and an
expert-parallel rank its local experts from 0; the HF mappings and checkpoints use global numbers. The stacked
expert weights of grouped_experts.py (`mlp.experts.linear_fc{1,2}.weight`, one row per local expert) carry no expert
number: `unstack_experts` names their experts as TE's grouped experts name theirs (`linear_fc1.weight{e}`).

Not the HF names (hf_mapping/ does those).
"""

from __future__ import annotations

import re

_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")
_LOCAL_EXPERT = re.compile(r"(\.local_experts\.)(\d+)(\.)")
_GROUPED_EXPERT = re.compile(r"(\.experts\.linear_fc[12]\.weight)(\d+)$")
_STACKED_EXPERTS = re.compile(r"\.experts\.linear_fc[12]\.weight$")


def strip_wrappers(name: str) -> str:
    """The GPTModel's own name of a parameter of a DDP / Float16Module-wrapped chunk."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def global_name(local_name: str, layer_offset: int, expert_offset: int) -> str:
    name = strip_wrappers(local_name)
    name = _LAYER.sub(lambda m: f"{m[1]}{int(m[2]) + layer_offset}{m[3]}", name)
    name = _LOCAL_EXPERT.sub(lambda m: f"{m[1]}{int(m[2]) + expert_offset}{m[3]}", name)
    return _GROUPED_EXPERT.sub(lambda m: f"{m[1]}{int(m[2]) + expert_offset}", name)


def renumber_expert(name: str, shift: int) -> str:
    """A global expert weight name with its expert number moved by `shift` (another expert-parallel rank's)."""
    name = _LOCAL_EXPERT.sub(lambda m: f"{m[1]}{int(m[2]) + shift}{m[3]}", name)
    return _GROUPED_EXPERT.sub(lambda m: f"{m[1]}{int(m[2]) + shift}", name)


def is_stacked_experts(name: str) -> bool:
    return _STACKED_EXPERTS.search(name) is not None


def unstack_experts(name: str, stacked, first_expert: int) -> list:
    """(per-expert global name, weight) of each row of a stacked expert weight whose first row is expert
    `first_expert`; the weights are views of `stacked`."""
    return [(f"{name}{first_expert + index}", weight) for index, weight in enumerate(stacked)]


def chunk_offsets(model_chunk, vp_stage: int | None) -> tuple[int, int]:
    """(first global layer, first global expert) of this rank's model chunk."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = model_chunk.config
    layer_offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    expert_offset = 0
    if config.num_moe_experts:
        num_local = config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
        expert_offset = parallel_state.get_expert_model_parallel_rank() * num_local
    return layer_offset, expert_offset


def named_global_parameters(model_chunks):
    """(global name, parameter) of every parameter of this rank's model chunks."""
    for vp_stage, chunk in enumerate(model_chunks):
        offsets = chunk_offsets(chunk, vp_stage if len(model_chunks) > 1 else None)
        for name, param in chunk.named_parameters():
            yield global_name(name, *offsets), param


ROUTER_EXPERT_BIAS = ".mlp.router.expert_bias"  # the only buffer a checkpoint carries: the expert-score correction


def named_global_buffers(model_chunks):
    """(global name, buffer) of the routers' expert biases of this rank's chunks (the GLM-4.5 / DeepSeek-V3 routers'
    `e_score_correction_bias`): persistent buffers, not parameters, replicated on every rank."""
    for vp_stage, chunk in enumerate(model_chunks):
        offsets = chunk_offsets(chunk, vp_stage if len(model_chunks) > 1 else None)
        for name, buffer in chunk.named_buffers():
            if name.endswith(ROUTER_EXPERT_BIAS):
                yield global_name(name, *offsets), buffer
