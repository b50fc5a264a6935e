"""The trained model: a Hugging Face causal LM wrapped so that one forward returns the log-probs and entropy of
the response tokens of a packed micro-batch (never the full logits), sharded with FSDP2.

`build_policy_model` is the one place that applies activation checkpointing and `fully_shard` (per decoder layer,
then the root).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from slime.backends.attention import VARLEN
from slime.backends.attention import register as register_varlen
from slime.backends.fsdp_utils.expert_weights import per_expert_tensors, stacked_tensor
from slime.backends.fsdp_utils.vision_language import (
    attention_implementations,
    check_supported,
    is_vision_language,
    packed_image_mask,
    packed_mrope_position_ids,
    vision_language_hidden_states,
)
from slime.backends.log_probs import chunked_log_probs_and_entropy
from slime.backends.lora_adapter import is_lora_name
from slime.backends.packing import PackedMicroBatch
from slime.backends.true_on_policy import install_tile_layers, packed_log_probs_and_entropy

HF_PREFIX = "hf_model."


class PolicyModel(nn.Module):
    """A causal LM whose forward takes a packed micro-batch and returns (log_probs, entropy) of its response
    tokens, computed by the chunked output head."""

    def __init__(self, hf_model: nn.Module, temperature: float = 1.0, chunk_size: int | None = None,
                 tile_spec=None, routing_replay=None):
        """tile_spec: a `DecoderSpec` under --true-on-policy-mode (the decoder layers then run the batch-invariant
        forward the engine runs, backends/true_on_policy.py, its MoE layers replaying `routing_replay`'s routing
        while it replays), else None."""
        super().__init__()
        self.routing_replay = routing_replay
        self.hf_model = hf_model
        self.temperature = temperature
        self.chunk_size = chunk_size
        self.tile_spec = tile_spec
        if getattr(hf_model.get_output_embeddings(), "bias", None) is not None:
            raise ValueError("models whose output layer has a bias are not supported by the chunked log-prob head")
        if tile_spec is not None:
            install_tile_layers(hf_model.get_decoder().layers, tile_spec)

    def forward(self, input_ids, position_ids, logit_index, target_ids, cu_seqlens=None, max_seqlen=None,
                pixel_values=None, image_grid_thw=None, num_images=None):
        if self.tile_spec is not None:  # true-on-policy mode (text models only: VL is refused at start-up)
            decoder = self.hf_model.get_decoder()
            routing = None if self.routing_replay is None else self.routing_replay.replayed_routing()
            return packed_log_probs_and_entropy(
                decoder.embed_tokens.weight, decoder.layers, decoder.norm.weight,
                self.hf_model.get_output_embeddings().weight, self.tile_spec, input_ids, logit_index, target_ids,
                cu_seqlens, self.temperature, routing)
        if is_vision_language(self.hf_model.config):
            hidden = packed_vision_language_hidden_states(self.hf_model, input_ids, cu_seqlens, max_seqlen,
                                                          pixel_values, image_grid_thw, num_images)
        else:
            hidden = packed_hidden_states(self.hf_model, input_ids, position_ids, cu_seqlens, max_seqlen)
        weight = self.hf_model.get_output_embeddings().weight
        return chunked_log_probs_and_entropy(hidden.index_select(0, logit_index), weight, target_ids,
                                             self.temperature, self.chunk_size)

    def forward_micro_batch(self, micro_batch: PackedMicroBatch):
        return self(micro_batch.input_ids, micro_batch.position_ids, micro_batch.logit_index, micro_batch.target_ids,
                    micro_batch.cu_seqlens, micro_batch.max_seqlen, micro_batch.pixel_values,
                    micro_batch.image_grid_thw, micro_batch.num_images)


def packed_hidden_states(hf_model: nn.Module, input_ids, position_ids, cu_seqlens=None, max_seqlen=None):
    """Final hidden states [num_tokens, hidden] of one packed row. No attention mask and no cache. sdpa:
    transformers derives a block-diagonal causal mask from the restarting position_ids. slime_varlen:
    cu_seqlens marks the samples (attention.py)."""
    outputs = hf_model.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                     **_varlen_kwargs(hf_model, cu_seqlens, max_seqlen))
    return outputs.last_hidden_state[0]


def packed_vision_language_hidden_states(hf_model: nn.Module, input_ids, cu_seqlens, max_seqlen, pixel_values=None,
                                         image_grid_thw=None, num_images=None):
    """packed_hidden_states for a vision-language model: the row's images through the vision tower and M-RoPE
    positions per sample (vision_language.py)."""
    num_images = num_images or [0] * (len(cu_seqlens) - 1)
    image_mask = packed_image_mask(hf_model, input_ids, cu_seqlens, image_grid_thw, num_images)
    position_ids = packed_mrope_position_ids(hf_model, input_ids, cu_seqlens, image_grid_thw, num_images, image_mask)
    return vision_language_hidden_states(hf_model, input_ids, position_ids, pixel_values, image_grid_thw, image_mask,
                                         _varlen_kwargs(hf_model, cu_seqlens, max_seqlen))


def _varlen_kwargs(hf_model: nn.Module, cu_seqlens, max_seqlen) -> dict:
    if hf_model.get_decoder().config._attn_implementation != VARLEN:
        return {}
    return dict(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_seqlen, max_length_k=max_seqlen)


def attention_implementation() -> str:
    """`slime_varlen` on every device: FlashAttention's varlen kernel on a GPU that has it, length-bucketed sdpa
    elsewhere (attention.py); never the dense [T, T] mask of plain sdpa over a packed row."""
    return register_varlen()


def load_hf_model(path: str, attn_implementation: str = "sdpa") -> nn.Module:
    """fp32 weights on the host. sdpa: with packed position_ids and no mask, transformers builds a dense
    block-diagonal causal mask, exact but quadratic in the packed length; the trainer loads `slime_varlen`
    (attention.py)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = checkpoint_config_override(path)
    if config is None:
        loaded = AutoConfig.from_pretrained(path)
        check_supported(loaded)
        if is_vision_language(loaded):  # the vision tower's attention is not causal: sdpa for it
            return AutoModelForImageTextToText.from_pretrained(
                path, dtype=torch.float32, attn_implementation=attention_implementations(attn_implementation))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation,
                                                **({"config": config} if config is not None else {}))


def checkpoint_config_override(path: str):
    """The config to load a checkpoint with when its config.json alone would not do, else None. Kimi K2 says
    model_type "kimi_k2" (its own remote code) over DeepseekV3ForCausalLM, a type transformers does not know: read
    as the DeepseekV3Config it is. A quantized checkpoint (DeepSeek's and Kimi's block FP8) is refused: the trainer
    keeps fp32 master weights of a bf16 checkpoint."""
    import json
    from pathlib import Path

    config_file = Path(path) / "config.json"
    raw = json.loads(config_file.read_text()) if config_file.is_file() else {}
    quantization = raw.get("quantization_config")
    if quantization:
        raise ValueError(f"--hf-checkpoint {path}: a quantized checkpoint (quantization_config.quant_method="
                         f"{quantization.get('quant_method')!r}) cannot be trained; convert it to bf16 first "
                         "(python tools/fp8_cast_bf16.py --input-fp8-hf-path IN --output-bf16-hf-path OUT for "
                         "block FP8), copy config.json without quantization_config and the tokenizer beside it")
    if raw.get("model_type") != "kimi_k2":
        return None
    from transformers import DeepseekV3Config

    raw.pop("auto_map", None)  # remote-code classes: never imported
    raw["model_type"] = "deepseek_v3"
    return DeepseekV3Config.from_dict(raw)


@dataclass(frozen=True)
class ShardOptions:
    """How `shard_model` prepares the decoder layers. mixed_precision: bf16 compute over fp32 parameters (GPU);
    recompute_activations: checkpoint each layer; compile_layers: torch.compile each layer's forward;
    reshard_after_forward: free each layer's gathered bf16 parameters after its forward (False keeps them for the
    backward: one gather and fp32 -> bf16 cast per layer per micro-batch fewer, for a bf16 copy of the whole
    model's share held through the pass)."""

    mixed_precision: bool
    recompute_activations: bool = False
    compile_layers: bool = False
    reshard_after_forward: bool = True

    @classmethod
    def from_args(cls, args, device: torch.device) -> ShardOptions:
        return cls(mixed_precision=device.type == "cuda", recompute_activations=args.recompute_activations,
                   compile_layers=args.compile_model, reshard_after_forward=args.reshard_after_forward)


def shard_model(model: nn.Module, hf_model: nn.Module, mesh, options: ShardOptions) -> nn.Module:
    """Checkpoint activations per decoder layer if asked, compile each layer's forward if asked (parameter names and
    FSDP's hooks stay outside the compiled code), then shard every decoder layer of `hf_model` (and every block of a
    vision-language model's vision tower) and finally `model` (the wrapper holding it) as the root."""
    if options.compile_layers:
        for layer in hf_model.get_decoder().layers:
            layer.forward = torch.compile(layer.forward, dynamic=True)
    if options.recompute_activations:
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_model.config.use_cache = False
    kwargs = {"mesh": mesh, "reshard_after_forward": options.reshard_after_forward}
    if options.mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in hf_model.get_decoder().layers:
        fully_shard(layer, **kwargs)
    if is_vision_language(hf_model.config):  # the vision tower's blocks too (Qwen2.5-VL-72B's: ~670M parameters)
        for block in hf_model.model.visual.blocks:
            fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def build_policy_model(hf_model: nn.Module, mesh, options: ShardOptions, *, temperature: float,
                       chunk_size: int | None, tile_spec=None, routing_replay=None) -> PolicyModel:
    return shard_model(PolicyModel(hf_model, temperature, chunk_size, tile_spec, routing_replay), hf_model, mesh,
                       options)


def reshard(model: nn.Module) -> None:
    """Return every FSDP module to its sharded state (the root stays unsharded after a forward), so that
    `named_parameters()` yields the sharded DTensors."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def hf_name(name: str) -> str:
    """Parameter name in the Hugging Face checkpoint (drops the wrapper prefix)."""
    return name[len(HF_PREFIX):] if name.startswith(HF_PREFIX) else name


@torch.no_grad()
def load_full_weights(model: nn.Module, full_state: dict[str, torch.Tensor]) -> None:
    """Copy full (unsharded) HF-named tensors into this rank's shards. Every rank passes the same tensors. LoRA
    adapters are not part of an HF checkpoint: they keep their values (lora_adapter.py loads them)."""
    reshard(model)
    for name, param in model.named_parameters():
        key = hf_name(name)
        if is_lora_name(key):
            continue
        full = full_state.get(key)
        if full is None:
            full = stacked_tensor(key, full_state)  # MoE experts: the checkpoint has one tensor per expert
        if full is None:
            tied = next((name for name in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
                         if name in full_state), None)
            if key == "lm_head.weight" and tied is not None:
                full = full_state[tied]
            else:
                raise ValueError(f"checkpoint has no tensor for parameter {key!r}")
        full = full.to(device=param.device, dtype=param.dtype)
        if isinstance(param, DTensor):
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)


def read_hf_weights(path: str) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors HF checkpoint folder, on the CPU."""
    from pathlib import Path

    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files (expected a Hugging Face checkpoint folder)")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def iter_full_parameters(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF checkpoint name, full tensor) per parameter, stacked MoE experts as one tensor per expert and projection.
    Collective: every rank must iterate in step."""
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        full = param.full_tensor() if isinstance(param, DTensor) else param
        if dtype is not None and dtype != full.dtype:
            full = full.to(dtype)  # a new tensor
        elif full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
            # One rank: the "gather" aliases the parameter. Sending by handle moves a tensor's storage into shared
            # memory, which must never happen to a parameter's own storage (FSDP resizes it: segfault).
            full = full.clone()
        yield from per_expert_tensors(hf_name(name), full.detach())  # MoE experts: the checkpoint's names
