"""Random LoRA adapters in PEFT's on-disk format for the engine's LoRA tests, and an independent float64 reference:
the transformers model with the adapter merged into its weights (W + scale * B A), scoring given tokens."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp", "gate_up_proj": "mlp"}


def random_adapter(hf_config, rank: int, alpha: float, seed: int, targets=tuple(MODULES)[:7], std: float = 0.3):
    """(config dict, {PEFT name: tensor}) with B != 0: wide enough to move the logits clearly."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
              "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter),
              "gate_up_proj": (2 * inter, hidden)}  # GLM-4's fused MLP input
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for leaf in targets:
            out_features, in_features = shapes[leaf]
            prefix = f"base_model.model.model.layers.{layer}.{MODULES[leaf]}.{leaf}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * std
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none"}
    return config, tensors


def write_peft_folder(folder: Path, config: dict, tensors: dict, base_model: str = "") -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": base_model}))
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(folder / "adapter_model.safetensors"))
    return folder


def merged_log_probs(model_path, config: dict | None, tensors: dict | None, token_ids: list[int],
                     num_prompt_tokens: int) -> list[float]:
    """float64 log-probs of token_ids[num_prompt_tokens:] under the transformers model with the adapter merged
    (None: the base model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float64).eval()
    if config is not None:
        scale = config["lora_alpha"] / config["r"]
        modules = dict(model.named_modules())
        with torch.no_grad():
            for name, a in tensors.items():
                if not name.endswith(".lora_A.weight"):
                    continue
                module_name = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = tensors[name.replace(".lora_A.", ".lora_B.")]
                modules[module_name].weight += scale * (b.double() @ a.double())
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].double()
    log_probs = torch.log_softmax(logits, dim=-1)
    return [log_probs[pos - 1, token_ids[pos]].item() for pos in range(num_prompt_tokens, len(token_ids))]
