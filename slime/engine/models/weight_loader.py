"""The single mapping between Hugging Face weight names and the engine's (fused) parameters, plus reading
checkpoints from disk (one or many *.safetensors, with or without model.safetensors.index.json).

`load_weights` accepts any subset of a model's HF-named weights (a trainer may push them in buckets) and raises a
ValueError naming the weight for an unknown name or a wrong shape. MoE experts use the HF checkpoint's per-expert
names (`mlp.experts.<e>.gate_proj.weight` ...), which load into slices of the stacked expert tensors. It does not
decide dtype or device: tensors are copied into the existing parameters.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

# HF projection name -> (fused parameter module name, index of the slice within it)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# HF checkpoint name of one expert's projection -> (stacked parameter, which half of gate_up_proj or None)
EXPERT_WEIGHT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
EXPERT_SLICES = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None)}
# Buffers some older checkpoints carry; they are recomputed, never loaded.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _slice_sizes(model: nn.Module, fused: str, param: torch.Tensor) -> list[int]:
    if fused == "gate_up_proj":  # dense MLPs and the shared expert: two equal halves
        return [param.shape[0] // 2] * 2
    config = model.config
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    return [q_size, kv_size, kv_size]


def _expert_target(model: nn.Module, params: dict[str, nn.Parameter], name: str, match: re.Match) -> torch.Tensor:
    stacked_name, half = EXPERT_SLICES[match["proj"]]
    param = params.get(f"{match['prefix']}.{stacked_name}")
    expert = int(match["expert"])
    if param is None or expert >= param.shape[0]:
        raise ValueError(f"unknown weight {name!r} for this {model.config.model_type} model")
    target = param.data[expert]
    if half is None:
        return target
    size = target.shape[0] // 2
    return target.narrow(0, half * size, size)


def _target(model: nn.Module, params: dict[str, nn.Parameter], name: str) -> torch.Tensor:
    """The parameter tensor (or slice of a fused one) that HF weight `name` loads into."""
    if name == "lm_head.weight" and model.config.tie_word_embeddings:
        name = "model.embed_tokens.weight"
    expert = EXPERT_WEIGHT.match(name)
    if expert:
        return _expert_target(model, params, name, expert)
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in PACKED_MODULES:
        fused, index = PACKED_MODULES[parts[-2]]
        param = params.get(".".join(parts[:-2] + [fused, parts[-1]]))
        if param is None:
            raise ValueError(f"unknown weight {name!r} for this {model.config.model_type} model")
        sizes = _slice_sizes(model, fused, param)
        return param.data.narrow(0, sum(sizes[:index]), sizes[index])
    if name not in params:
        raise ValueError(f"unknown weight {name!r} for this {model.config.model_type} model")
    return params[name].data


def load_weights(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy HF-named tensors into `model`; returns the set of names loaded."""
    params = dict(model.named_parameters())
    loaded = set()
    with torch.no_grad():
        for name, tensor in named_tensors:
            if name.endswith(IGNORED_SUFFIXES):
                continue
            target = _target(model, params, name)
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor)
            # a tied lm_head is the embedding: named as named_weight_shapes names it
            tied = name == "lm_head.weight" and model.config.tie_word_embeddings
            loaded.add("model.embed_tokens.weight" if tied else name)
    return loaded


def named_weight_shapes(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every HF weight name this model loads, with its shape and dtype (tied lm_head omitted)."""
    fused_to_hf: dict[str, list[str]] = {}
    for hf_name, (fused, index) in PACKED_MODULES.items():
        fused_to_hf.setdefault(fused, [None, None, None])[index] = hf_name
    shapes = {}
    for name, param in model.named_parameters():
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] == "experts":
            shapes.update(_expert_shapes(name, param))
        elif len(parts) >= 2 and parts[-2] in fused_to_hf:
            for index, size in enumerate(_slice_sizes(model, parts[-2], param)):
                hf_name = ".".join(parts[:-2] + [fused_to_hf[parts[-2]][index], parts[-1]])
                shapes[hf_name] = ((size, *param.shape[1:]), param.dtype)
        else:
            shapes[name] = (tuple(param.shape), param.dtype)
    return shapes


def _expert_shapes(name: str, param: torch.Tensor) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The per-expert checkpoint names of a stacked expert parameter (`...experts.gate_up_proj` or `down_proj`)."""
    prefix, stacked_name = name.rsplit(".", 1)
    num_experts, rows, columns = param.shape
    projections = ("gate_proj", "up_proj") if stacked_name == "gate_up_proj" else ("down_proj",)
    row_count = rows // len(projections)
    return {
        f"{prefix}.{expert}.{projection}.weight": ((row_count, columns), param.dtype)
        for expert in range(num_experts) for projection in projections
    }


def checkpoint_files(model_path: str | Path) -> list[Path]:
    model_path = Path(model_path)
    index_file = model_path / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        return [model_path / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {str(model_path)!r}")
    return files


def iterate_checkpoint(model_path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in checkpoint_files(model_path):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def load_checkpoint(model: nn.Module, model_path: str | Path) -> None:
    """Load every weight of `model` from disk; missing weights raise ValueError listing them."""
    loaded = load_weights(model, iterate_checkpoint(model_path))
    if model.config.tie_word_embeddings:
        loaded.discard("lm_head.weight")
    missing = sorted(set(named_weight_shapes(model)) - loaded)
    if missing:
        more = " ..." if len(missing) > 8 else ""
        raise ValueError(f"checkpoint {str(model_path)!r} lacks weight(s) {missing[:8]}{more}")


def check_named_tensors(shapes: dict[str, tuple], named_tensors, model_type: str) -> None:
    """Every name known to the model and every shape the full (unsharded) Hugging Face shape, or a ValueError naming
    the first that is not. `shapes` is `named_weight_shapes(model)`."""
    for name, tensor in named_tensors:
        lookup = "model.embed_tokens.weight" if name == "lm_head.weight" and name not in shapes else name
        if lookup not in shapes:
            raise ValueError(f"unknown weight {name!r} for this {model_type} model")
        expected = tuple(shapes[lookup][0])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
