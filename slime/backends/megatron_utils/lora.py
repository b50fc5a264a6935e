"""LoRA on the Megatron backend, on the tensor-parallel linears of megatron-core's layers (Miles' `lora` type):
- column-parallel `linear_qkv`, `linear_fc1`: A [r, in] replicated, B [out/TP, r] sharded like the base's output
  rows (fc1's [gate_r; up_r] layout included); the low-rank activation A x enters the TP region through
  `copy_to_tensor_model_parallel_region`, so A's gradient is summed over the TP ranks (each B shard sees part of
  the output);
- row-parallel `linear_proj`, `linear_fc2`: A [r, in/TP] sharded like the base's input columns, B [out, r]
  replicated; the partial A x of each rank is summed with `reduce_from_tensor_model_parallel_region`.
A fused layer has one adapter: the HF layers it holds (q, k, v; gate, up) share A, and their B rows are the fused
B's (`adapter_to_hf` splits them as the base weight is split). Each adapter is an `AdapterPair` module beside its
linear (`linear_qkv_lora`), since a parallel linear's checkpoint treats every child tensor as its own shard layout;
a forward hook on the linear adds `s * B A dropout(x)` to its output. The base is frozen.

Not the HF names of the adapter beyond the fused split (hf_mapping/), nor PEFT files (lora_adapter.py).
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from slime.backends.lora_adapter import LORA_A, LORA_B, AdapterSwitch, is_lora_name

COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")
ROW_PARALLEL = ("linear_proj", "linear_fc2")
# HF leaf names (args.lora_target_modules) -> the Megatron layer holding them; a fused layer needs all of its names.
LAYER_OF_HF = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
               "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
SUFFIX = "_lora"


def megatron_targets(target_modules: list[str]) -> list[str]:
    """The Megatron layers to adapt; a fused layer whose HF names are only partly targeted is an error."""
    layers = sorted({LAYER_OF_HF[name] for name in target_modules})
    for layer in layers:
        held = sorted(name for name, owner in LAYER_OF_HF.items() if owner == layer)
        if not set(held) <= set(target_modules):
            raise ValueError(f"--target-modules {','.join(target_modules)}: the Megatron backend adapts the fused "
                             f"{layer} as one layer ({', '.join(held)}): target all of them or none")
    return layers


class AdapterPair(nn.Module, AdapterSwitch):
    """lora_A and lora_B of one parallel linear, with their tensor-parallel layout (and checkpoint sharding)."""

    def __init__(self, base, rank: int, alpha: int, dropout: float, column_parallel: bool, seed: int):
        super().__init__()
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        weight = base.weight
        out_local, in_local = weight.shape
        self.column_parallel = column_parallel
        factory = dict(device=weight.device, dtype=weight.dtype)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        in_full = in_local if column_parallel else in_local * tp
        self.lora_A = nn.Linear(in_local, rank, bias=False, **factory)
        self.lora_B = nn.Linear(rank, out_local, bias=False, **factory)
        with torch.no_grad():  # PEFT's init of the full A from `seed` (equal at any TP), then this rank's part
            full_a = torch.empty(rank, in_full, dtype=torch.float32)
            nn.init.kaiming_uniform_(full_a, a=math.sqrt(5), generator=torch.Generator().manual_seed(seed))
            if not column_parallel:
                full_a = full_a.chunk(tp, dim=1)[parallel_state.get_tensor_model_parallel_rank()]
            self.lora_A.weight.copy_(full_a)
            self.lora_B.weight.zero_()
        if column_parallel:
            set_tensor_model_parallel_attributes(self.lora_B.weight, True, 0, 1)
        else:
            set_tensor_model_parallel_attributes(self.lora_A.weight, True, 1, 1)
        self.scaling = alpha / rank
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        low_rank = self.lora_A(self.lora_dropout(x))
        if self.column_parallel:
            low_rank = copy_to_tensor_model_parallel_region(low_rank)
        else:
            low_rank = reduce_from_tensor_model_parallel_region(low_rank)
        return self.lora_B(low_rank) * self.scaling

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axis = {f"{LORA_B}.weight": 0} if self.column_parallel else {f"{LORA_A}.weight": 1}
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axis,
                                                   sharded_offsets)


def _add_adapter_output(pair: AdapterPair):
    def hook(module, inputs, output):
        if not pair.adapter_enabled:
            return output
        result, bias = output
        return result + pair.delta(inputs[0]), bias

    return hook


def apply_lora(model_chunks, target_modules: list[str], rank: int, alpha: int, dropout: float, seed: int) -> int:
    """Adapters on the targeted parallel linears of every chunk; every other parameter frozen. Each A starts from a
    generator seeded by `seed` and the layer's global name, so any layout starts from the same adapter. Returns the
    number of adapted layers on this rank."""
    from slime.backends.megatron_utils.names import chunk_offsets, global_name

    layers = set(megatron_targets(target_modules))
    count, found = 0, set()
    for vp_stage, chunk in enumerate(model_chunks):
        offsets = chunk_offsets(chunk, vp_stage if len(model_chunks) > 1 else None)
        for name, module in list(chunk.named_modules()):
            leaf = name.rsplit(".", 1)[-1]
            if leaf not in layers or ".experts." in name or not hasattr(module, "weight"):
                continue
            if hasattr(module, "layer_norm_weight"):  # TE's fused norm + linear: its input is not normalised yet
                raise ValueError(f"--lora-rank: {name} is Transformer Engine's fused layer-norm linear, whose input "
                                 "the adapter would see before the norm; LoRA on the Megatron backend runs on "
                                 "megatron-core's local layer spec (uninstall transformer_engine, or train with "
                                 "--train-backend fsdp)")
            parent = chunk.get_submodule(name.rpartition(".")[0])
            layer_seed = seed + zlib.crc32(global_name(name, *offsets).encode())
            pair = AdapterPair(module, rank, alpha, dropout, leaf in COLUMN_PARALLEL, layer_seed)
            setattr(parent, leaf + SUFFIX, pair)
            module.register_forward_hook(_add_adapter_output(pair))
            count += 1
            found.add(leaf)
        for name, param in chunk.named_parameters():
            param.requires_grad_(is_lora_name(name))
    has_layers = any(len(chunk.decoder.layers) for chunk in model_chunks)  # a pipeline stage may hold none
    if has_layers and found != layers:
        raise ValueError(f"--target-modules: this Megatron model has no {', '.join(sorted(layers - found))} layers "
                         f"(an MLA model's attention is not linear_qkv); drop them from --target-modules")
    return count


def _pairs(model_chunks) -> dict[str, dict[str, tuple[str, torch.nn.Parameter]]]:
    """{global name of the adapted linear's weight: {"lora_A" / "lora_B": (global name, parameter)}} of this rank."""
    from slime.backends.megatron_utils.names import named_global_parameters

    pairs: dict[str, dict] = {}
    for name, param in named_global_parameters(model_chunks):
        if is_lora_name(name):
            pair, kind, _ = name.rsplit(".", 2)
            pairs.setdefault(pair.removesuffix(SUFFIX) + ".weight", {})[kind] = (name, param)
    return pairs


def adapter_to_hf(model_chunks, hf_config, local_of=lambda param: param) -> dict[str, torch.Tensor]:
    """This rank's pipeline stage's adapter as full tensors under HF names (`...q_proj.lora_A.weight`); a fused
    layer's HF layers share its A and split its B as the base weight splits. Collective over tensor parallelism.
    `local_of(param)`: the local tensor laid out like the parameter to convert (its `main_grad`, for tests)."""
    from slime.backends.megatron_utils import tp_shards
    from slime.backends.megatron_utils.hf_mapping import mapping_for

    mapping = mapping_for(hf_config)
    out = {}
    for base, parts in _pairs(model_chunks).items():
        # the base weight's name: tp_shards knows fc1's [gate_r; up_r] shard layout, which B shares
        full_a, full_b = (tp_shards.full_tensor(base, parts[kind][1], local_of(parts[kind][1]).detach())
                          .float().cpu().clone() for kind in (LORA_A, LORA_B))
        column = base.rsplit(".", 2)[-2] in COLUMN_PARALLEL
        split = mapping.to_hf(base, full_b if column else full_a, hf_config)
        for hf_weight, tensor in split:
            layer = hf_weight.removesuffix(".weight")
            out[f"{layer}.{LORA_A}.weight"] = full_a if column else tensor
            out[f"{layer}.{LORA_B}.weight"] = tensor if column else full_b
    return out


@torch.no_grad()
def load_adapter_from_hf(model_chunks, hf_config, adapter: dict[str, torch.Tensor], source) -> None:
    """Fill this rank's adapter shards from a full HF-named adapter (a PEFT folder's); the HF layers of one fused
    layer must share lora_A (as this backend trains them)."""
    from slime.backends.megatron_utils import tp_shards
    from slime.backends.megatron_utils.hf_mapping import mapping_for

    mapping = mapping_for(hf_config)
    padded_vocab = model_chunks[0].vocab_size

    def read(kind):
        def read_hf(hf_weight: str) -> torch.Tensor:
            key = hf_weight.removesuffix(".weight") + f".{kind}.weight"
            if key not in adapter:
                raise ValueError(f"adapter {source}: no tensor {key} (trained with other --target-modules?)")
            return adapter[key]
        return read_hf

    for base, parts in _pairs(model_chunks).items():
        column = base.rsplit(".", 2)[-2] in COLUMN_PARALLEL
        fused_kind, shared_kind = (LORA_B, LORA_A) if column else (LORA_A, LORA_B)
        fused = mapping.to_megatron(base, read(fused_kind), hf_config, padded_vocab)
        hf_layers = [name.removesuffix(".weight") for name, _ in mapping.to_hf(base, fused, hf_config)]
        shared = [read(shared_kind)(layer + ".weight") for layer in hf_layers]
        if any(not torch.equal(shared[0], other) for other in shared[1:]):
            raise ValueError(f"adapter {source}: {', '.join(hf_layers)} have different {shared_kind}; the Megatron "
                             f"backend's fused {base.rsplit('.', 2)[-2]} has one (train it with --train-backend "
                             "fsdp, or start without --lora-adapter-path)")
        for kind, full in ((fused_kind, fused), (shared_kind, shared[0])):
            name, param = parts[kind]
            shard = tp_shards.shard_of(full, base, param)
            if shard.shape != param.shape:
                raise ValueError(f"adapter {source}: {name} has shape {tuple(shard.shape)} after conversion, the "
                                 f"model's is {tuple(param.shape)}")
            param.copy_(shard)
