"""The single mapping between Hugging Face weight names and the engine's (fused, sharded) parameters, plus reading
checkpoints from disk (one or many *.safetensors, with or without model.safetensors.index.json).

`load_weights` accepts any subset of a model's HF-named weights (a trainer may push them in buckets) and raises a
ValueError naming the weight for an unknown name or a wrong shape. MoE experts use the HF checkpoint's per-expert
names (`mlp.experts.<e>.gate_proj.weight` ...), which load into slices of the stacked expert tensors. One buffer
loads too: the sigmoid router's `e_score_correction_bias` (GLM-4.5; a checkpoint tensor, but never among the
weights a trainer sends, so not in `named_weight_shapes`). GLM-4's checkpoint holds its dense MLPs' fused
`mlp.gate_up_proj.weight` (a rank takes its rows of the gate half and of the up half). Multi-token-prediction
layers of released checkpoints (`model.layers.<num_hidden_layers + i>.*`, config num_nextn_predict_layers) are
skipped. It does not decide dtype or device: tensors are copied into the existing parameters.

Every route (checkpoint, pushed tensors, broadcast, disk) hands every rank of a sharded engine the FULL tensors;
each rank copies only its shard, as the parallel layers describe it (`engine/parallel/`): q/k/v by heads (K/V
replicated when there are fewer heads than ranks), gate and up each by the rank's rows, row-parallel weights by
the input dimension, vocabulary rows (zero padding past the real vocabulary), experts of the rank's EP block by
its intermediate slice (the others are accepted and skipped), everything else whole. `named_weight_shapes` reports
the full HF shapes (what a push must send).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from slime.engine.layers.moe import GroupedExperts
from slime.engine.models.fp8_blocks import checkpoint_fp8_block_size, dequantize_fp8_blocks
from slime.engine.parallel.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from slime.engine.parallel.vocab import ParallelLMHead, VocabParallelEmbedding

# fused parameter module name -> the HF projections it holds, in order
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# Buffers some older checkpoints carry; they are recomputed, never loaded.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Checkpoints whose dense MLPs already hold the fused `mlp.gate_up_proj.weight` [gate; up] (GLM-4): each rank takes
# its rows of the gate half and of the up half (`_fused_gate_up_shard`).
FUSED_GATE_UP_MODEL_TYPES = ("glm4",)
LOADED_BUFFER_SUFFIXES = (".gate.e_score_correction_bias",)  # sigmoid_moe_block.CORRECTION_BIAS
LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def _is_mtp_weight(model: nn.Module, name: str) -> bool:
    """A weight of a multi-token-prediction layer the checkpoint carries after the decoder's layers."""
    match = LAYER_INDEX.match(name)
    config = model.config
    return bool(match) and config.num_nextn_predict_layers > 0 and (
        config.num_hidden_layers <= int(match[1]) < config.num_hidden_layers + config.num_nextn_predict_layers)


def loaded_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a checkpoint fills (the sigmoid routers' correction biases), by HF name."""
    return {name: buffer for name, buffer in model.named_buffers() if name.endswith(LOADED_BUFFER_SUFFIXES)}


@dataclass(frozen=True)
class Shard:
    """What one rank holds of one full HF tensor: along `dim` (None: the whole tensor), source elements
    [source_start, source_start + length) go to [target_start, target_start + length) of parameter `param` (its
    `expert`-th entry when given); the target's next `num_zero_padding` elements are zeroed (vocabulary padding).
    `skip`: held by another rank (an expert of another EP block); accepted, nothing copied."""

    param: str
    full_shape: tuple[int, ...]
    dim: int | None = None
    source_start: int = 0
    length: int = 0
    target_start: int = 0
    num_zero_padding: int = 0
    expert: int | None = None
    skip: bool = False

    def copy(self, params: dict[str, nn.Parameter], tensor: torch.Tensor) -> None:
        if self.skip:
            return
        target = params[self.param].data
        if self.expert is not None:
            target = target[self.expert]
        if self.dim is None:
            target.copy_(tensor)
            return
        target = target.narrow(self.dim, self.target_start, self.length + self.num_zero_padding)
        target.narrow(self.dim, 0, self.length).copy_(tensor.narrow(self.dim, self.source_start, self.length))
        if self.num_zero_padding:
            target.narrow(self.dim, self.length, self.num_zero_padding).zero_()


@dataclass(frozen=True)
class FusedShard:
    """One HF tensor holding several blocks of a fused parameter (GLM-4's `mlp.gate_up_proj.weight`, [gate; up]):
    this rank's part of each block, a Shard per block."""

    pieces: tuple[Shard, ...]

    @property
    def param(self) -> str:
        return self.pieces[0].param

    @property
    def full_shape(self) -> tuple[int, ...]:
        return self.pieces[0].full_shape

    def copy(self, params: dict[str, nn.Parameter], tensor: torch.Tensor) -> None:
        for piece in self.pieces:
            piece.copy(params, tensor)


def _fused_gate_up_shard(prefix: str, module: MergedColumnParallelLinear) -> dict[str, FusedShard]:
    """A checkpoint's own fused gate_up_proj [gate; up]: block k's rank rows lie at offset sum(sizes[:k]) of it."""
    assert module.bias is None
    full_shape = (sum(module.output_sizes), module.in_features)
    pieces, source_offset, target_start = [], 0, 0
    for size, local in zip(module.output_sizes, module.local_sizes):
        pieces.append(Shard(f"{prefix}.weight", full_shape, 0, source_offset + module.tp_rank * local, local,
                            target_start))
        source_offset, target_start = source_offset + size, target_start + local
    return {f"{prefix}.weight": FusedShard(tuple(pieces))}


def _column_shards(prefix: str, module: nn.Linear, hf_names: tuple[str, ...], full_sizes: list[int],
                   source_starts: list[int], local_sizes: list[int]) -> dict[str, Shard]:
    """A fused column-parallel linear's blocks (weight and bias), each narrowed along the output dimension."""
    parent = prefix.rsplit(".", 1)[0]
    shards = {}
    for suffix, param in module.named_parameters(recurse=False):
        target_start = 0
        for hf_name, full, start, local in zip(hf_names, full_sizes, source_starts, local_sizes):
            shards[f"{parent}.{hf_name}.{suffix}"] = Shard(
                f"{prefix}.{suffix}", (full, *param.shape[1:]), 0, start, local, target_start)
            target_start += local
    return shards


def _module_shards(prefix: str, module: nn.Module) -> dict[str, Shard] | None:
    """The HF tensors a sharded module's parameters hold, or None for a module whose parameters are held whole."""
    if isinstance(module, QKVParallelLinear):
        shard, head_dim = module.shard, module.head_dim
        heads = (shard.num_heads, shard.num_kv_heads, shard.num_kv_heads)
        totals = (module.total_num_heads, module.total_num_kv_heads, module.total_num_kv_heads)
        starts = (shard.q_start, shard.kv_start, shard.kv_start)
        return _column_shards(prefix, module, FUSED_MODULES["qkv_proj"], [n * head_dim for n in totals],
                              [n * head_dim for n in starts], [n * head_dim for n in heads])
    if isinstance(module, MergedColumnParallelLinear):
        starts = [module.tp_rank * local for local in module.local_sizes]
        return _column_shards(prefix, module, FUSED_MODULES[prefix.rsplit(".", 1)[1]], module.output_sizes, starts,
                              module.local_sizes)
    if isinstance(module, RowParallelLinear):
        weight = module.weight
        shards = {f"{prefix}.weight": Shard(f"{prefix}.weight", (weight.shape[0], module.total_input_size), 1,
                                            module.input_start, weight.shape[1])}
        if module.bias is not None:  # held whole: added once, after the all-reduce
            shards[f"{prefix}.bias"] = Shard(f"{prefix}.bias", tuple(module.bias.shape))
        return shards
    if isinstance(module, (VocabParallelEmbedding, ParallelLMHead)):
        return {f"{prefix}.weight": Shard(f"{prefix}.weight", (module.vocab_size, module.weight.shape[1]), 0,
                                          module.vocab_start, module.num_valid_rows, 0,
                                          module.num_local_rows - module.num_valid_rows)}
    if isinstance(module, GroupedExperts):
        return _expert_shards(prefix, module)
    return None


def _expert_shards(prefix: str, experts: GroupedExperts) -> dict[str, Shard]:
    """Per-expert HF names (`<prefix>.<e>.gate_proj.weight` ...) of every expert; those of other EP blocks skipped."""
    hidden = experts.down_proj.shape[1]
    full, local = experts.intermediate_size, experts.local_intermediate_size
    start = experts.moe_tp_rank * local
    shards = {}
    for expert in range(experts.num_experts):
        local_expert = expert - experts.first_expert
        skip = not 0 <= local_expert < experts.num_local_experts
        where = dict(expert=None if skip else local_expert, skip=skip)
        gate_up, down = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
        shards[f"{prefix}.{expert}.gate_proj.weight"] = Shard(gate_up, (full, hidden), 0, start, local, 0, **where)
        shards[f"{prefix}.{expert}.up_proj.weight"] = Shard(gate_up, (full, hidden), 0, start, local, local, **where)
        shards[f"{prefix}.{expert}.down_proj.weight"] = Shard(down, (hidden, full), 1, start, local, **where)
    return shards


def weight_shards(model: nn.Module) -> dict[str, Shard | FusedShard]:
    """HF name -> this rank's Shard of it, for every weight the model loads (a tied lm_head is the embedding's and
    is not listed). Built once per model."""
    cached = model.__dict__.get("_weight_shards")
    if cached is not None:
        return cached
    shards: dict[str, Shard | FusedShard] = {}
    covered: set[str] = set()
    fused_gate_up = model.config.model_type in FUSED_GATE_UP_MODEL_TYPES
    for prefix, module in model.named_modules():
        if fused_gate_up and prefix.endswith(".mlp.gate_up_proj"):
            module_shards = _fused_gate_up_shard(prefix, module)
        else:
            module_shards = _module_shards(prefix, module)
        if module_shards is None:
            continue
        covered.update(f"{prefix}.{suffix}" for suffix, _ in module.named_parameters(recurse=False))
        shards.update(module_shards)
    for name, param in model.named_parameters():  # tied weights are listed once, under their first name
        if name not in covered:
            shards[name] = Shard(name, tuple(param.shape))
    if model.config.tie_word_embeddings:
        shards.pop("lm_head.weight", None)
    model.__dict__["_weight_shards"] = shards
    return shards


def _hf_name(model: nn.Module, name: str) -> str:
    """A tied lm_head is the embedding: named as named_weight_shapes names it."""
    tied = name == "lm_head.weight" and model.config.tie_word_embeddings
    return model.embedding_weight_name if tied else name


def load_weights(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy this rank's shard of each full HF-named tensor into `model`; returns the set of names loaded."""
    shards = weight_shards(model)
    params = dict(model.named_parameters())
    buffers = loaded_buffers(model)
    loaded = set()
    with torch.no_grad():
        is_vl = model.config.vision_config is not None
        for name, tensor in named_tensors:
            if name.endswith(IGNORED_SUFFIXES) or _is_mtp_weight(model, name):
                continue
            name = vl_weight_name(name) if is_vl else name
            shard = shards.get(_hf_name(model, name))
            if shard is None and name in buffers:
                if tuple(tensor.shape) != tuple(buffers[name].shape):
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected "
                                     f"{tuple(buffers[name].shape)}")
                buffers[name].copy_(tensor)
                loaded.add(name)
                continue
            if shard is None:
                raise ValueError(f"unknown weight {name!r} for this {model.config.model_type} model")
            if tuple(tensor.shape) != shard.full_shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {shard.full_shape}")
            shard.copy(params, tensor)
            loaded.add(_hf_name(model, name))
    return loaded


def named_weight_shapes(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every HF weight name this model loads, with its full (unsharded) shape and dtype (tied lm_head omitted)."""
    params = dict(model.named_parameters())
    return {name: (shard.full_shape, params[shard.param].dtype) for name, shard in weight_shards(model).items()}


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


def load_checkpoint(model: nn.Module, model_path: str | Path, require_buffers: bool = True) -> None:
    """Load every weight of `model` from disk (a block-FP8 checkpoint dequantized, fp8_blocks.py); missing weights
    raise ValueError listing them. The loaded buffers (router correction biases) are required too unless
    `require_buffers` is False: a folder a trainer wrote holds parameters only, and a bias it lacks keeps its value."""
    named_tensors = iterate_checkpoint(model_path)
    block = checkpoint_fp8_block_size(model_path)
    loaded = load_weights(model, named_tensors if block is None else dequantize_fp8_blocks(named_tensors, block))
    if model.config.tie_word_embeddings:
        loaded.discard("lm_head.weight")
    required = set(named_weight_shapes(model)) | (set(loaded_buffers(model)) if require_buffers else set())
    missing = sorted(required - loaded)
    if missing:
        more = " ..." if len(missing) > 8 else ""
        raise ValueError(f"checkpoint {str(model_path)!r} lacks weight(s) {missing[:8]}{more}")


# Qwen2.5-VL checkpoints (released ones, and transformers' save of them) use the older names; the engine's VL model
# and a trainer's in-memory transformers model use the newer ones (model.language_model.*, model.visual.*).
LEGACY_VL_PREFIXES = (("model.layers.", "model.language_model.layers."),
                      ("model.embed_tokens.", "model.language_model.embed_tokens."),
                      ("model.norm.", "model.language_model.norm."), ("visual.", "model.visual."))


def vl_weight_name(name: str) -> str:
    """A VL weight's name in the newer layout, whichever layout it came in."""
    for old, new in LEGACY_VL_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


EMBEDDING_WEIGHT_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")


def tied_embedding_name(shapes: dict) -> str:
    """The HF name of the embedding a tied lm_head is (text models: model.embed_tokens; VL: in language_model)."""
    return next((name for name in EMBEDDING_WEIGHT_NAMES if name in shapes), EMBEDDING_WEIGHT_NAMES[0])


def check_named_tensors(shapes: dict[str, tuple], named_tensors, model_type: str) -> None:
    """Every name known to the model and every shape the full (unsharded) Hugging Face shape, or a ValueError naming
    the first that is not. `shapes` is `named_weight_shapes(model)`."""
    is_vl = EMBEDDING_WEIGHT_NAMES[1] in shapes
    for name, tensor in named_tensors:
        name = vl_weight_name(name) if is_vl else name
        lookup = tied_embedding_name(shapes) if name == "lm_head.weight" and name not in shapes else name
        if lookup not in shapes:
            raise ValueError(f"unknown weight {name!r} for this {model_type} model")
        expected = tuple(shapes[lookup][0])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
