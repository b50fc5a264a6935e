"""Which engine linear each Hugging Face module path names. The engine's module names follow Hugging Face's except
that q/k/v are fused into `qkv_proj` and gate/up into `gate_up_proj`: a q_proj adapter updates the q slice of
qkv_proj's output, and so on. A checkpoint whose own module is fused (GLM-4's `mlp.gate_up_proj`) has one adapter
for the whole output: its A goes to every slice and its B is cut by the slices' rows (the same product). Only the dense projections are targets (q, k, v, o, gate, up, down); MoE experts,
routers, embeddings and the LM head are not. In an engine of several ranks each rank's targets name the part of an
adapter it holds: B's rows of its output shard (column-parallel q/k/v by heads, gate/up by the intermediate size) or
A's columns of its input shard (row-parallel o/down). Pure bookkeeping over the built model: no tensors are made here.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from slime.engine.lora.adapter import AdapterError

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
PLAIN = ("o_proj", "down_proj")
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                     "gate_up_proj")
WHOLE = -1  # Target.slice_index of an adapter on a fused module as a whole


@dataclass(frozen=True)
class Target:
    """HF module `hf_name` is slice `slice_index` of engine linear `module_name` (WHOLE: every slice). `size` and
    `in_features` are the HF module's full output and input sizes (what an adapter's B and A have); `rows` are this
    rank's rows of the full B, one (start, end) per slice written (one for a slice, every slice's for WHOLE), and
    `columns` this rank's columns of the full A (all of them but for a row-parallel linear's input shard)."""

    module_name: str
    slice_index: int
    size: int
    in_features: int
    rows: tuple[tuple[int, int], ...]
    columns: tuple[int, int]


def fused_output_sizes(module: nn.Linear, leaf: str) -> list[tuple[int, int, int]]:
    """Per slice of a fused linear, in order: (full output size, this rank's first row in it, this rank's rows).
    Tensor parallel: q/k/v by heads (K/V heads replicated when fewer than ranks), gate/up by the intermediate size."""
    if leaf == "qkv_proj":
        shard, head_dim = module.shard, module.head_dim
        q = (module.total_num_heads * head_dim, shard.q_start * head_dim, shard.num_heads * head_dim)
        kv = (module.total_num_kv_heads * head_dim, shard.kv_start * head_dim, shard.num_kv_heads * head_dim)
        return [q, kv, kv]
    return [(full, module.tp_rank * local, local) for full, local in zip(module.output_sizes, module.local_sizes)]


def find_targets(model: nn.Module) -> tuple[dict[str, Target], dict[str, list[int]]]:
    """(HF module path -> Target, engine module name -> its slices' output sizes on this rank) for every targetable
    linear."""
    targets, slices = {}, {}
    for name, module in model.named_modules():
        prefix, _, leaf = name.rpartition(".")
        if not isinstance(module, nn.Linear) or ".experts." in name:
            continue
        if leaf in FUSED:
            parts, hf_leaves = fused_output_sizes(module, leaf), FUSED[leaf]
        elif leaf in PLAIN:
            parts, hf_leaves = [(module.out_features, 0, module.out_features)], (leaf,)
        else:
            continue
        slices[name] = [local for _, _, local in parts]
        input_start = getattr(module, "input_start", 0)  # a row-parallel linear holds a shard of the input
        in_features = getattr(module, "total_input_size", module.in_features)
        columns = (input_start, input_start + module.in_features)
        offset, whole_rows = 0, []
        for index, (hf_leaf, (full, first, local)) in enumerate(zip(hf_leaves, parts)):
            targets[f"{prefix}.{hf_leaf}"] = Target(name, index, full, in_features, ((first, first + local),), columns)
            whole_rows.append((offset + first, offset + first + local))
            offset += full
        if leaf in FUSED:
            targets[name] = Target(name, WHOLE, offset, in_features, tuple(whole_rows), columns)
    return targets, slices


def check_adapter_shapes(adapter_modules: dict, targets: dict[str, Target]) -> None:
    """AdapterError naming the first module the model has no target for, whose A/B shapes do not fit it, or that is
    adapted both as a whole and by slice (e.g. gate_up_proj and gate_proj)."""
    whole = {targets[name].module_name for name in adapter_modules if name in targets
             and targets[name].slice_index == WHOLE}
    for hf_name, (a, b) in adapter_modules.items():
        target = targets.get(hf_name)
        if target is None:
            raise AdapterError(f"adapter module {hf_name!r} is not a LoRA target of this model (the engine adapts "
                               f"{', '.join(SUPPORTED_TARGETS)} of the decoder layers; not MoE experts, MLA's "
                               "latent projections, embeddings or the LM head)")
        if a.shape[1] != target.in_features or b.shape[0] != target.size:
            raise AdapterError(f"adapter module {hf_name!r}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do "
                               f"not fit the model's [{target.size} x {target.in_features}] projection")
        if target.slice_index != WHOLE and target.module_name in whole:
            raise AdapterError(f"adapter module {hf_name!r} is part of {target.module_name!r}, which the adapter "
                               "also adapts as a whole; give one or the other")
