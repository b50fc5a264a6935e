"""What both backends share about LoRA adapters: PEFT's names and config, the adapter's scale, switching the adapters
off (the reference model is the base), merging an adapter into its base weight, and PEFT folders on disk.

Every adapted layer holds `lora_A` [r, in] and `lora_B` [out, r]; its output is `W x + b + s * B (A dropout(x))`
with s = lora_alpha / r. In memory the adapter of HF layer `model.layers.0.self_attn.q_proj` is named
`model.layers.0.self_attn.q_proj.lora_A.weight`; PEFT's file and the engine push prefix `base_model.model.`.

Not the layers (fsdp_utils/lora.py wraps nn.Linear, megatron_utils/lora.py the parallel linears).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from slime.engine.lora.adapter import CONFIG_FILE as ADAPTER_CONFIG_FILE
from slime.engine.lora.adapter import PEFT_PREFIX
from slime.engine.lora.adapter import WEIGHTS_FILE as ADAPTER_WEIGHTS_FILE

LORA_A, LORA_B = "lora_A", "lora_B"


def lora_scale(args) -> float:
    return args.lora_alpha / args.lora_rank


def is_lora_name(name: str) -> bool:
    return f".{LORA_A}." in name or f".{LORA_B}." in name


def peft_config(args, adapted: Iterable[str] = ()) -> dict:
    """adapter_config.json's fields (the engine push carries the same dict). `adapted`: the adapted layers' names
    (their leaf names are PEFT's target_modules: a fused `gate_up_proj` is one), else --target-modules'."""
    leaves = sorted({name.rsplit(".", 1)[-1] for name in adapted}) or list(args.lora_target_modules)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": args.lora_rank, "lora_alpha": args.lora_alpha,
            "lora_dropout": args.lora_dropout, "target_modules": leaves, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "init_lora_weights": True, "inference_mode": True,
            "base_model_name_or_path": str(args.hf_checkpoint)}


def to_peft_name(hf_name: str) -> str:
    return PEFT_PREFIX + hf_name


def from_peft_name(peft_name: str) -> str:
    name = peft_name[len(PEFT_PREFIX):] if peft_name.startswith(PEFT_PREFIX) else peft_name
    return name.replace(f".{LORA_A}.default.", f".{LORA_A}.").replace(f".{LORA_B}.default.", f".{LORA_B}.")


class AdapterSwitch:
    """Mixin of an adapted layer: `adapter_enabled` False makes it compute the base layer alone."""

    adapter_enabled: bool = True


def adapters_disabled(model: nn.Module):
    """Inside the block every adapted layer of `model` computes its base layer only: the reference model."""
    return adapters_disabled_in([model])


@contextlib.contextmanager
def adapters_disabled_in(models: list[nn.Module]):
    layers = [m for model in models for m in model.modules() if isinstance(m, AdapterSwitch)]
    for layer in layers:
        layer.adapter_enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.adapter_enabled = True


def adapted_layers(names: Iterable[str]) -> set[str]:
    """The layers (`model.layers.0.self_attn.q_proj`) that hold an adapter, from parameter / tensor names."""
    return {name.rsplit(".", 2)[0] for name in names if is_lora_name(name)}


def merged_hf_weights(named: Iterable[tuple[str, torch.Tensor]], layers: set[str],
                      scale: float) -> Iterator[tuple[str, torch.Tensor]]:
    """A stream of (HF name, full tensor) with adapters -> the same stream with the weight of each adapted layer in
    `layers` replaced by W + s * B @ A (computed in float64) and no adapter tensors: what an engine that does not
    serve adapters, or a --save-hf folder, loads. Holds one layer's three tensors at most, if they come together."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        layer, _, kind = name.rpartition(".weight")[0].rpartition(".") if is_lora_name(name) else (
            name[: -len(".weight")], ".", "weight")
        if not (is_lora_name(name) or (name.endswith(".weight") and layer in layers)):
            yield name, tensor
            continue
        parts = pending.setdefault(layer, {})
        parts[kind] = tensor
        if len(parts) == 3:
            del pending[layer]
            weight = parts["weight"]
            delta = (parts[LORA_B].double() @ parts[LORA_A].double()) * scale
            yield layer + ".weight", (weight.double() + delta).to(weight.dtype)
    if pending:
        raise ValueError(f"adapted layers with missing parts: {sorted(pending)}")


def merge_adapter_into(named: Iterable[tuple[str, torch.Tensor]], adapter: dict[str, torch.Tensor],
                       scale: float) -> Iterator[tuple[str, torch.Tensor]]:
    """A stream of base (HF name, full tensor) with each weight that has an adapter in `adapter` ({HF name: tensor},
    full) replaced by W + s * B @ A (float64 sum)."""
    for name, tensor in named:
        layer = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{layer}.{LORA_A}.weight" in adapter:
            a, b = adapter[f"{layer}.{LORA_A}.weight"], adapter[f"{layer}.{LORA_B}.weight"]
            delta = (b.double() @ a.double()).to(tensor.device) * scale
            tensor = (tensor.double() + delta).to(tensor.dtype)
        yield name, tensor


def save_peft_folder(folder: str | Path, config: dict, adapter: dict[str, torch.Tensor]) -> Path:
    """adapter_config.json + adapter_model.safetensors; `adapter` is keyed by HF names (`...q_proj.lora_A.weight`)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({to_peft_name(name): tensor.detach().cpu().clone() for name, tensor in adapter.items()},
              str(folder / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return folder


def load_peft_folder(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config, {HF name: tensor}) of a PEFT folder."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / ADAPTER_CONFIG_FILE).read_text())
    return config, {from_peft_name(name): t for name, t in load_file(str(folder / ADAPTER_WEIGHTS_FILE)).items()}


ADAPTER_SUBDIR = "adapter"  # a --save checkpoint's PEFT folder


def start_adapter_folder(args, weights_path: str | Path) -> Path | None:
    """The adapter a run starts from: a resumed checkpoint's own, else --lora-adapter-path, else none (fresh)."""
    own = Path(weights_path) / ADAPTER_SUBDIR
    if (own / ADAPTER_WEIGHTS_FILE).is_file():
        return own
    return Path(args.lora_adapter_path) if args.lora_adapter_path else None


@torch.no_grad()
def copy_adapter_into(named_parameters: Iterable[tuple[str, torch.Tensor]], adapter: dict[str, torch.Tensor],
                      source: str | Path) -> None:
    """Copy a full adapter {HF name: tensor} into the model's (unsharded) adapter parameters, by HF name; a missing
    or extra tensor, or a shape that differs, is an error naming it and `source`."""
    expected = {name: param for name, param in named_parameters if is_lora_name(name)}
    missing, extra = sorted(expected.keys() - adapter.keys()), sorted(adapter.keys() - expected.keys())
    if missing or extra:
        raise ValueError(f"adapter {source}: tensors missing {missing[:3]} ({len(missing)}), not in the model "
                         f"{extra[:3]} ({len(extra)}); it was trained with other --target-modules or another model")
    for name, param in expected.items():
        if tuple(adapter[name].shape) != tuple(param.shape):
            raise ValueError(f"adapter {source}: {name} has shape {tuple(adapter[name].shape)}, the model's is "
                             f"{tuple(param.shape)}")
        param.copy_(adapter[name].to(param.dtype))


def split_by_adapter(adapter: dict[str, torch.Tensor], names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Several adapters ({`...q_proj.lora_A.<name>.weight`: tensor}, PEFT's in-memory naming) -> per adapter name
    its own tensors under single-adapter names (`...q_proj.lora_A.weight`)."""
    parts: dict[str, dict[str, torch.Tensor]] = {name: {} for name in names}
    for key, tensor in adapter.items():
        layer, kind, name, suffix = key.rsplit(".", 3)
        if kind not in (LORA_A, LORA_B) or name not in parts:
            raise ValueError(f"{key}: not a tensor of one of the adapters {names}")
        parts[name][f"{layer}.{kind}.{suffix}"] = tensor
    return parts


def join_adapters(parts: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The inverse of `split_by_adapter`."""
    joined = {}
    for name, part in parts.items():
        for key, tensor in part.items():
            layer, kind, suffix = key.rsplit(".", 2)
            joined[f"{layer}.{kind}.{name}.{suffix}"] = tensor
    return joined


def save_adapters(folder: str | Path, args, adapter: dict[str, torch.Tensor]) -> None:
    """A checkpoint's `adapter/`: one PEFT folder, or with --lora-adapter-names one per adapter (`adapter/<name>/`,
    as PEFT saves a model's non-default adapters)."""
    if not args.lora_adapter_key:
        save_peft_folder(folder, peft_config(args, adapted_layers(adapter)), adapter)
        return
    for name, part in split_by_adapter(adapter, args.lora_adapter_names).items():
        save_peft_folder(Path(folder) / name, peft_config(args, adapted_layers(part)), part)


def resumed_adapters(args, weights_path: str | Path) -> dict[str, torch.Tensor] | None:
    """--lora-adapter-names: the adapters of a resumed checkpoint (`adapter/<name>/`, every one of them, joined), or
    None when the run starts fresh."""
    own = Path(weights_path) / ADAPTER_SUBDIR
    folders = {name: own / name for name in args.lora_adapter_names}
    present = [name for name, folder in folders.items() if (folder / ADAPTER_WEIGHTS_FILE).is_file()]
    if not present:
        return None
    if len(present) != len(folders):
        raise ValueError(f"{own}: holds the adapters {present}, the run trains {list(folders)} "
                         "(--lora-adapter-names must name the checkpoint's adapters)")
    return join_adapters({name: load_peft_folder(folder)[1] for name, folder in folders.items()})
