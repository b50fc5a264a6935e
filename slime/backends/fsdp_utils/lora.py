"""LoRA on the FSDP backend: `LoRALinear` takes the place of each targeted `nn.Linear` of the Hugging Face model
before sharding. It keeps the base layer's `weight` and `bias` under their own names (so HF names, checkpoints of
the base and the weight export are unchanged) and adds `lora_A` (Kaiming-uniform, as PEFT) and `lora_B` (zeros):
the adapted model starts equal to the base. The base is frozen (requires_grad False: no gradient, no optimizer
state). With several adapters (--lora-adapter-names) `MultiLoRALinear` holds one pair per adapter and each token
uses its sample's (`select_adapters`, around every forward).

Not the shared naming, merging and PEFT files (lora_adapter.py), nor the ref pass (train_flow.py).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from slime.backends.lora_adapter import (
    AdapterSwitch,
    copy_adapter_into,
    is_lora_name,
    load_peft_folder,
    resumed_adapters,
    start_adapter_folder,
)


class LoRALinear(nn.Module, AdapterSwitch):
    def __init__(self, base: nn.Linear, rank: int, alpha: int, dropout: float):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        factory = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **factory)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **factory)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / rank
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.adapter_enabled:
            return y
        return y + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


class MultiLoRALinear(nn.Module, AdapterSwitch):
    """Several adapters on one base layer (--lora-adapter-names): `lora_A.<name>` / `lora_B.<name>` (PEFT's own
    in-memory naming), each token computing with the adapter its sample chose (`select_adapters`). Every adapter runs
    on every token and is masked, so every adapter parameter takes part in every forward and backward (FSDP2 reduces
    the same gradients on every rank), and a token's gradient reaches its own adapter only."""

    def __init__(self, base: nn.Linear, names: list[str], rank: int, alpha: int, dropout: float):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        factory = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.ModuleDict({name: nn.Linear(self.in_features, rank, bias=False, **factory) for name in names})
        self.lora_B = nn.ModuleDict({name: nn.Linear(rank, self.out_features, bias=False, **factory) for name in names})
        for name in names:
            nn.init.kaiming_uniform_(self.lora_A[name].weight, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B[name].weight)
        self.scaling = alpha / rank
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.token_masks: torch.Tensor | None = None  # [num_adapters, 1, num_tokens, 1], set by select_adapters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.adapter_enabled:
            return y
        if self.token_masks is None:
            raise RuntimeError("a forward of a model with several LoRA adapters outside select_adapters(): which "
                               "adapter each token uses is not known")
        x = self.lora_dropout(x)
        for mask, name in zip(self.token_masks, self.lora_A):  # the mask in the compute dtype (mixed precision)
            y = y + self.lora_B[name](self.lora_A[name](x)) * (mask * self.scaling).to(y.dtype)
        return y


@contextlib.contextmanager
def select_adapters(model: nn.Module, token_adapters: torch.Tensor | None):
    """Inside the block each token of the packed row computes with adapter `token_adapters[t]` (an index into
    --lora-adapter-names). A no-op for a model without several adapters."""
    layers = [module for module in model.modules() if isinstance(module, MultiLoRALinear)]
    if not layers:
        yield
        return
    if token_adapters is None:
        raise ValueError("the model trains several LoRA adapters but the micro-batch names none per token (train "
                         "data without 'lora_adapters': --lora-adapter-key)")
    num_adapters = len(layers[0].lora_A)
    ids = torch.arange(num_adapters, device=token_adapters.device)[:, None]
    masks = (token_adapters[None, :] == ids).float()[:, None, :, None]
    for layer in layers:
        layer.token_masks = masks
    try:
        yield
    finally:
        for layer in layers:
            layer.token_masks = None


def _is_target(leaf: str, targets: set[str]) -> bool:
    """A checkpoint's own fused gate/up layer (GLM-4's `gate_up_proj`) is adapted as a whole when both are targets."""
    return leaf in targets or (leaf == "gate_up_proj" and {"gate_proj", "up_proj"} <= targets)


def apply_lora(hf_model: nn.Module, target_modules: list[str], rank: int, alpha: int, dropout: float,
               adapter_names: list[str] | None = None) -> list[str]:
    """Replace every nn.Linear whose leaf name is in `target_modules` (inside the decoder: never the output layer) by
    a LoRALinear (a MultiLoRALinear with `adapter_names`) and freeze every other parameter. Returns the adapted
    layers' HF names. A target this model does not have (an MLA model has no q_proj / k_proj / v_proj) is an error
    naming it, never fewer adapters than asked."""
    targets = set(target_modules)
    decoder_prefix = next(name for name, module in hf_model.named_modules() if module is hf_model.get_decoder())
    adapted = []
    for name, module in list(hf_model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and _is_target(leaf, targets) and name.startswith(decoder_prefix + "."):
            parent_name, _, leaf = name.rpartition(".")
            layer = (MultiLoRALinear(module, adapter_names, rank, alpha, dropout) if adapter_names
                     else LoRALinear(module, rank, alpha, dropout))
            setattr(hf_model.get_submodule(parent_name), leaf, layer)
            adapted.append(name)
    found = {name.rsplit(".", 1)[-1] for name in adapted}
    if "gate_up_proj" in found:
        found |= {"gate_proj", "up_proj"}
    missing = sorted(targets - found)
    if missing:
        raise ValueError(f"--target-modules: this model ({type(hf_model).__name__}) has no nn.Linear named "
                         f"{', '.join(missing)} in its decoder; drop them (--exclude-modules {','.join(missing)})")
    for name, param in hf_model.named_parameters():
        param.requires_grad_(is_lora_name(name))
    return adapted


def load_start_adapter(hf_model: nn.Module, args, weights_path: str) -> None:
    """The adapter's start values (before sharding): a resumed checkpoint's, --lora-adapter-path's, or the fresh
    initialisation."""
    if args.lora_adapter_key:  # several adapters: a resumed checkpoint's adapter/<name>/ folders, or fresh
        adapter = resumed_adapters(args, weights_path)
        if adapter is not None:
            copy_adapter_into(hf_model.named_parameters(), adapter, Path(weights_path) / "adapter")
        return
    folder = start_adapter_folder(args, weights_path)
    if folder is not None:
        copy_adapter_into(hf_model.named_parameters(), load_peft_folder(folder)[1], folder)
